// The C ABI's ops.  Each reads as: its contract (a table of its arguments, validate.h), its shape
// equations, the source its rows read (sources.h, backward_params.h), and route.h.  Every argument
// is validated once, before anything is written.  The sources are built in the Real of the call's
// precision (dispatch_real): float, or double for a float64 call.
#include <cinttypes>
#include <utility>

#include "route.h"

namespace attnmerge {
namespace detail {
namespace {

// The start of every op: no error, nothing launched yet.
void begin_call() {
  clear_error();
  forget_launch();
}

// ---- shape equations ------------------------------------------------------------------------

// A two-way merge's (and the in-place merge's): sizes from the input that always covers every
// token (o_b, o_other), and the tokens of a that are read.
attnmerge_status pair_sizes(Views, const View& b, const attnmerge_options& opt, Sizes& n) {
  n.tokens = b.shape[0];
  n.heads = b.shape[1];
  n.head_size = b.shape[2];
  attnmerge_status s;
  if ((s = check_head_size(b, n.head_size)) || (s = read_a_tokens(opt, b, n))) return s;
  return ATTNMERGE_SUCCESS;
}

// An N-way merge's: o [tokens, S, heads, head_size].
attnmerge_status stack_sizes(Views, const View& o, const attnmerge_options&, Sizes& n) {
  n.tokens = o.shape[0];
  n.states = o.shape[1];
  n.heads = o.shape[2];
  n.head_size = o.shape[3];
  if (attnmerge_status s = check_head_size(o, n.head_size)) return s;
  if (n.states > INT32_MAX)
    return fail(ATTNMERGE_ERROR_VALUE, "%s: expected at most 2^31 - 1 states, got %" PRId64, o.name(), n.states);
  return ATTNMERGE_SUCCESS;
}

// A share's: o [tokens, heads, head_size], lse [tokens, S, heads].
attnmerge_status share_sizes(Views views, const View& o, const attnmerge_options&, Sizes& n) {
  n.tokens = o.shape[0];
  n.heads = o.shape[1];
  n.head_size = o.shape[2];
  if (attnmerge_status s = check_head_size(o, n.head_size)) return s;
  for (const View& v : views)
    if (same_name(v.spec->name, "lse")) {  // [tokens, S, heads]
      n.states = v.shape[1];
      if (n.states > INT32_MAX)
        return fail(ATTNMERGE_ERROR_VALUE, "%s: expected at most 2^31 - 1 states, got %" PRId64, v.name(), n.states);
    }
  return ATTNMERGE_SUCCESS;
}

// A variable-length merge's: o [total, heads, head_size], indptr [rows + 1].
attnmerge_status range_sizes(Views views, const View& o, const attnmerge_options&, Sizes& n) {
  n.total = o.shape[0];
  n.heads = o.shape[1];
  n.head_size = o.shape[2];
  if (attnmerge_status s = check_head_size(o, n.head_size)) return s;
  for (const View& v : views)
    if (v.spec->shape[0] == Dim::kRowsPlus1) {  // indptr (num_tokens shares its dtypes, not its shape)
      if (v.shape[0] < 1) return fail(ATTNMERGE_ERROR_VALUE, "%s: expected rows + 1 >= 1 entries, got 0", v.name());
      n.rows = v.shape[0] - 1;
    }
  return ATTNMERGE_SUCCESS;
}

// An exchange's merge: the states' sizes from o (the ranks' layout), its slice's from out (the
// first argument of the table, whose tokens and heads are the slice's: check_slice holds them to
// the states'); its states (the world size) are the caller's, set before validate().
attnmerge_status exchange_sizes(Views views, const View& o, const attnmerge_options&, Sizes& n) {
  n.tokens = o.shape[0];
  n.heads = o.shape[1];
  n.head_size = o.shape[2];
  const View& out = views.v[0];
  n.slice_tokens = out.shape[0];
  n.slice_heads = out.shape[1];
  return check_head_size(o, n.head_size);
}

// ---- the ops' contracts -----------------------------------------------------------------------

constexpr uint32_t kOIn = ATTNMERGE_ROLE_O_IN, kOOut = ATTNMERGE_ROLE_O_OUT, kLse = ATTNMERGE_ROLE_LSE,
                   kMask = ATTNMERGE_ROLE_MASK, kIndptr = ATTNMERGE_ROLE_INDPTR, kScale = ATTNMERGE_ROLE_SCALE,
                   kValid = ATTNMERGE_ROLE_MASK | ATTNMERGE_ROLE_INDPTR;  // options.valid: a mask or counts
// The tables' axes: tokens, heads, head_size, S, the total states and rows of a variable-length
// merge (R1 = rows + 1), the tokens of a that are read, and a itself, an output's last axis (NVFP4's
// bytes), the group scales' axes (in their layout) (Dim).
constexpr Dim T = Dim::kTokens, H = Dim::kHeads, D = Dim::kHeadSize, S = Dim::kStates, N = Dim::kTotal, R = Dim::kRows,
              R1 = Dim::kRowsPlus1, A = Dim::kATokens, AOrMore = Dim::kATokensOrMore, DO = Dim::kOutHeadSize,
              G0 = Dim::kScales0, G1 = Dim::kScales1, G2 = Dim::kScales2, P = Dim::kPair, One = Dim::kOne,
              ST = Dim::kSliceTokens, SH = Dim::kSliceHeads;
constexpr Use kRead = Use::kRead, kWrite = Use::kWrite, kReadWrite = Use::kReadWrite;
constexpr Presence kRequired = Presence::kRequired, kOptional = Presence::kOptional;
constexpr Alias kMayBeOutput = Alias::kMayBeOutput, kNoAlias = Alias::kNone;

constexpr uint32_t kBase2 = ATTNMERGE_LSE_BASE2, kHeadsFirst = ATTNMERGE_LSE_HEADS_FIRST, kATokens = ATTNMERGE_A_TOKENS,
                   kPdl = ATTNMERGE_PDL, kBBase = ATTNMERGE_LSE_B_BASE2 | ATTNMERGE_LSE_B_BASE_E,
                   kOutBase = ATTNMERGE_OUT_LSE_BASE2 | ATTNMERGE_OUT_LSE_BASE_E, kUe8m0 = ATTNMERGE_GROUP_SCALE_UE8M0,
                   kInvariant = ATTNMERGE_BATCH_INVARIANT,
                   // the block-scaled formats, with per-group FP8 what the forwards that take group scales take
                   kGroups = kUe8m0 | ATTNMERGE_BLOCK_MXFP8 | ATTNMERGE_BLOCK_NVFP4 | ATTNMERGE_SCALE_RCEIL |
                             ATTNMERGE_SCALE_SWIZZLED;

// Each op: its arguments' table, then make_op(table, the options.flags it takes, the argument whose
// dtype allows an output scale, the state its sizes come from and that state's LSE, its shape
// equations).
// clang-format off
// (out, out_lse) = merge((o_a, lse_a), (o_b, lse_b)) and each head's sink where given; out may be
// o_a or o_b itself, out_lse lse_a or lse_b.
constexpr ArgSpec kMergeArgs[] = {
    // name      role   shape            use     presence    alias          dtype of
    {"out",      kOOut, {T, H, DO},      kWrite, kRequired},
    {"out_lse",  kLse,  {T, H},          kWrite, kOptional},
    {"o_a",      kOIn,  {AOrMore, H, D}, kRead,  kRequired,  kMayBeOutput},
    {"lse_a",    kLse,  {AOrMore, H},    kRead,  kRequired,  kMayBeOutput},
    {"o_b",      kOIn,  {T, H, D},       kRead,  kRequired,  kMayBeOutput,  "o_a"},
    {"lse_b",    kLse,  {T, H},          kRead,  kRequired,  kMayBeOutput},
    {"sink",     kLse,  {H},             kRead,  kOptional},
    {"group_scales", kScale, {G0, G1, G2}, kWrite, kOptional},
    {"sum_a",    kLse,  {AOrMore, H},    kRead,  kOptional},
    {"sum_b",    kLse,  {T, H},          kRead,  kOptional},
    {"valid",    kValid, {T, P},         kRead,  kOptional},
    {"num_tokens", kIndptr, {One},       kRead,  kOptional},
    {"a_tokens", kIndptr,  {One},        kRead,  kOptional},
};
struct MergeArg {
  enum : int { kOut, kOutLse, kOA, kLseA, kOB, kLseB, kSink, kGroupScales, kSumA, kSumB, kValid, kNumTokens, kACount };
};
static_assert(indexed(kMergeArgs, {{MergeArg::kOut, "out"}, {MergeArg::kOutLse, "out_lse"}, {MergeArg::kOA, "o_a"},
                                   {MergeArg::kLseA, "lse_a"}, {MergeArg::kOB, "o_b"}, {MergeArg::kLseB, "lse_b"},
                                   {MergeArg::kSink, "sink"}, {MergeArg::kGroupScales, "group_scales"},
                                   {MergeArg::kSumA, "sum_a"}, {MergeArg::kSumB, "sum_b"},
                                   {MergeArg::kValid, "valid"}, {MergeArg::kNumTokens, "num_tokens"},
                                   {MergeArg::kACount, "a_tokens"}}),
              "MergeArg indexes kMergeArgs");
constexpr OpSpec kMerge = make_op(kMergeArgs, kBase2 | kBBase | kOutBase | kHeadsFirst | kATokens | kPdl | kGroups | kInvariant,
                                  "out", "o_b", "lse_b", pair_sizes);
static_assert(names_resolve(kMerge), "kMerge names its own arguments");

// (o, lse) <- merge((o, lse), (o_other, lse_other)) on the rows whose mask is not 0.
constexpr ArgSpec kInplaceArgs[] = {
    {"o",         kOIn,  {T, H, D}, kReadWrite, kRequired},
    {"lse",       kLse,  {T, H},    kReadWrite, kRequired},
    {"o_other",   kOIn,  {T, H, D}, kRead,      kRequired, kMayBeOutput, "o"},
    {"lse_other", kLse,  {T, H},    kRead,      kRequired, kMayBeOutput},
    {"mask",      kMask, {T},       kRead,      kOptional},
    {"sum_b",     kLse,  {T, H},    kRead,      kOptional},
    {"valid",     kValid, {T, P},   kRead,      kOptional},
    {"num_tokens", kIndptr, {One},  kRead,      kOptional},
};
struct InplaceArg {
  enum : int { kO, kLse, kOOther, kLseOther, kMask, kSumB, kValid, kNumTokens };
};
static_assert(indexed(kInplaceArgs, {{InplaceArg::kO, "o"}, {InplaceArg::kLse, "lse"}, {InplaceArg::kOOther, "o_other"},
                                     {InplaceArg::kLseOther, "lse_other"}, {InplaceArg::kMask, "mask"},
                                     {InplaceArg::kSumB, "sum_b"}, {InplaceArg::kValid, "valid"},
                                     {InplaceArg::kNumTokens, "num_tokens"}}),
              "InplaceArg indexes kInplaceArgs");
constexpr OpSpec kInplace =
    make_op(kInplaceArgs, kBase2 | kBBase | kHeadsFirst | kPdl | kInvariant, "o", "o_other", "lse_other", pair_sizes);
static_assert(names_resolve(kInplace), "kInplace names its own arguments");

// (out, out_lse) = merge of the S states of o, lse, and each head's sink (options.sink) where given.
constexpr ArgSpec kStatesArgs[] = {
    {"out",     kOOut, {T, H, DO},   kWrite, kRequired},
    {"out_lse", kLse,  {T, H},       kWrite, kOptional},
    {"o",       kOIn,  {T, S, H, D}, kRead,  kRequired},
    {"lse",     kLse,  {T, S, H},    kRead,  kRequired},
    {"sink",    kLse,  {H},          kRead,  kOptional},
    {"group_scales", kScale, {G0, G1, G2}, kWrite, kOptional},
    {"sum_a",   kLse,  {T, S, H},    kRead,  kOptional},
    {"valid",   kValid, {T, S},      kRead,  kOptional},
    {"num_tokens", kIndptr, {One},   kRead,  kOptional},
};
struct StatesArg {
  enum : int { kOut, kOutLse, kO, kLse, kSink, kGroupScales, kSumA, kValid, kNumTokens };
};
static_assert(indexed(kStatesArgs, {{StatesArg::kOut, "out"}, {StatesArg::kOutLse, "out_lse"}, {StatesArg::kO, "o"},
                                    {StatesArg::kLse, "lse"}, {StatesArg::kSink, "sink"},
                                    {StatesArg::kGroupScales, "group_scales"}, {StatesArg::kSumA, "sum_a"},
                                    {StatesArg::kValid, "valid"}, {StatesArg::kNumTokens, "num_tokens"}}),
              "StatesArg indexes kStatesArgs");
constexpr OpSpec kStates = make_op(kStatesArgs, kBase2 | kOutBase | kPdl | kGroups | kInvariant, "out", "o", "lse", stack_sizes);
static_assert(names_resolve(kStates), "kStates names its own arguments");

// Row r of (out, out_lse) = merge of states indptr[r] to indptr[r + 1] - 1 of o, lse, and the sink.
constexpr ArgSpec kVarlenArgs[] = {
    {"out",     kOOut,   {R, H, DO}, kWrite, kRequired},
    {"out_lse", kLse,    {R, H},    kWrite, kOptional},
    {"o",       kOIn,    {N, H, D}, kRead,  kRequired},
    {"lse",     kLse,    {N, H},    kRead,  kRequired},
    {"indptr",  kIndptr, {R1},      kRead,  kRequired},
    {"sink",    kLse,    {H},       kRead,  kOptional},
    {"group_scales", kScale, {G0, G1, G2}, kWrite, kOptional},
    {"sum_a",   kLse,    {N, H},    kRead,  kOptional},
    {"valid",   kValid,  {N},       kRead,  kOptional},
    {"num_tokens", kIndptr, {One},  kRead,  kOptional},
};
struct VarlenArg {
  enum : int { kOut, kOutLse, kO, kLse, kIndptr, kSink, kGroupScales, kSumA, kValid, kNumTokens };
};
static_assert(indexed(kVarlenArgs, {{VarlenArg::kOut, "out"}, {VarlenArg::kOutLse, "out_lse"}, {VarlenArg::kO, "o"},
                                    {VarlenArg::kLse, "lse"}, {VarlenArg::kIndptr, "indptr"},
                                    {VarlenArg::kSink, "sink"}, {VarlenArg::kGroupScales, "group_scales"},
                                    {VarlenArg::kSumA, "sum_a"}, {VarlenArg::kValid, "valid"},
                                    {VarlenArg::kNumTokens, "num_tokens"}}),
              "VarlenArg indexes kVarlenArgs");
constexpr OpSpec kVarlen =
    make_op(kVarlenArgs, kBase2 | kOutBase | kPdl | kGroups | kInvariant, "out", "o", "lse", range_sizes);
static_assert(names_resolve(kVarlen), "kVarlen names its own arguments");

// (out, out_lse) = the share of state `index` (whose O is o) in the merge of the S states of lse
// and the sink: out may be o itself.
constexpr ArgSpec kShareArgs[] = {
    {"out",     kOOut, {T, H, DO},   kWrite, kRequired},
    {"out_lse", kLse,  {T, H},       kWrite, kOptional},
    {"o",       kOIn,  {T, H, D},    kRead,  kRequired, kMayBeOutput},
    {"lse",     kLse,  {T, S, H},    kRead,  kRequired},
    {"sink",    kLse,  {H},          kRead,  kOptional},
    {"group_scales", kScale, {G0, G1, G2}, kWrite, kOptional},
    {"sum_a",   kLse,  {T, S, H},    kRead,  kOptional},
    {"valid",   kValid, {T, S},      kRead,  kOptional},
    {"num_tokens", kIndptr, {One},   kRead,  kOptional},
};
struct ShareArg {
  enum : int { kOut, kOutLse, kO, kLse, kSink, kGroupScales, kSumA, kValid, kNumTokens };
};
static_assert(indexed(kShareArgs, {{ShareArg::kOut, "out"}, {ShareArg::kOutLse, "out_lse"}, {ShareArg::kO, "o"},
                                   {ShareArg::kLse, "lse"}, {ShareArg::kSink, "sink"},
                                   {ShareArg::kGroupScales, "group_scales"}, {ShareArg::kSumA, "sum_a"},
                                   {ShareArg::kValid, "valid"}, {ShareArg::kNumTokens, "num_tokens"}}),
              "ShareArg indexes kShareArgs");
constexpr OpSpec kShare = make_op(kShareArgs, kBase2 | kOutBase | kPdl | kGroups | kInvariant, "out", "o", "lse", share_sizes);
static_assert(names_resolve(kShare), "kShare names its own arguments");

// (out, out_lse) = the merge of every rank's rows of this rank's slice, and each head's sink: o and
// lse are the layout every rank's state shares (attnmerge_exchange's o_layout, lse_layout), at this
// rank's own pointers; every rank's are checked against it (check_exchange_pointers,
// check_apart_from_ranks), and out's first axes are the slice's (check_slice).  valid: per token of
// the slice and rank (S, the world size, set before the table is read).  The ranks' sums share
// lse's layout: checked as the ranks' pointers are.
constexpr ArgSpec kExchangeArgs[] = {
    {"out",     kOOut, {ST, SH, D}, kWrite, kRequired},
    {"out_lse", kLse,  {ST, SH},    kWrite, kOptional},
    {"o",       kOIn,  {T, H, D},   kRead,  kRequired},
    {"lse",     kLse,  {T, H},      kRead,  kRequired},
    {"sink",    kLse,  {SH},        kRead,  kOptional},
    {"valid",   kValid, {ST, S},    kRead,  kOptional},
};
struct ExchangeArg {
  enum : int { kOut, kOutLse, kO, kLse, kSink, kValid };
};
static_assert(indexed(kExchangeArgs, {{ExchangeArg::kOut, "out"}, {ExchangeArg::kOutLse, "out_lse"},
                                      {ExchangeArg::kO, "o"}, {ExchangeArg::kLse, "lse"}, {ExchangeArg::kSink, "sink"},
                                      {ExchangeArg::kValid, "valid"}}),
              "ExchangeArg indexes kExchangeArgs");
constexpr OpSpec kExchange = make_op(kExchangeArgs, kBase2 | kOutBase | kPdl, "out", "o", "lse", exchange_sizes);
static_assert(names_resolve(kExchange), "kExchange names its own arguments");

// The backward: the gradients (each optional: not written), dO and dLSE (optional: 0), the
// forward's O (optional: <dO, O> from the states) and LSE, then the forward's inputs.  No output
// aliases an input: dO and O are read again for rows of many states.  grad_out's dtype says that
// no output scale applies (it has none: a scaled FP8 output has no gradient).
constexpr ArgSpec kMergeBackwardArgs[] = {
    {"grad_o_a",     kOIn, {A, H, D},       kWrite, kOptional, kNoAlias, "o_a"},
    {"grad_lse_a",   kLse, {A, H},          kWrite, kOptional},
    {"grad_o_b",     kOIn, {T, H, D},       kWrite, kOptional, kNoAlias, "o_a"},
    {"grad_lse_b",   kLse, {T, H},          kWrite, kOptional},
    {"grad_out",     kOIn, {T, H, D},       kRead,  kRequired, kNoAlias, "out"},
    {"grad_out_lse", kLse, {T, H},          kRead,  kOptional},
    {"out",          kOIn, {T, H, D},       kRead,  kOptional},
    {"out_lse",      kLse, {T, H},          kRead,  kRequired},
    {"o_a",          kOIn, {AOrMore, H, D}, kRead,  kRequired},
    {"lse_a",        kLse, {AOrMore, H},    kRead,  kRequired},
    {"o_b",          kOIn, {T, H, D},       kRead,  kRequired, kNoAlias, "o_a"},
    {"lse_b",        kLse, {T, H},          kRead,  kRequired},
};
struct MergeBackwardArg {
  enum : int { kGradOA, kGradLseA, kGradOB, kGradLseB, kGradOut, kGradOutLse, kOut, kOutLse, kOA, kLseA, kOB, kLseB };
};
static_assert(indexed(kMergeBackwardArgs,
                      {{MergeBackwardArg::kGradOA, "grad_o_a"}, {MergeBackwardArg::kGradLseA, "grad_lse_a"},
                       {MergeBackwardArg::kGradOB, "grad_o_b"}, {MergeBackwardArg::kGradLseB, "grad_lse_b"},
                       {MergeBackwardArg::kGradOut, "grad_out"}, {MergeBackwardArg::kGradOutLse, "grad_out_lse"},
                       {MergeBackwardArg::kOut, "out"}, {MergeBackwardArg::kOutLse, "out_lse"},
                       {MergeBackwardArg::kOA, "o_a"}, {MergeBackwardArg::kLseA, "lse_a"},
                       {MergeBackwardArg::kOB, "o_b"}, {MergeBackwardArg::kLseB, "lse_b"}}),
              "MergeBackwardArg indexes kMergeBackwardArgs");
constexpr OpSpec kMergeBackward =
    make_op(kMergeBackwardArgs, kBase2 | kHeadsFirst | kATokens | kPdl, "grad_out", "o_b", "lse_b", pair_sizes);
static_assert(names_resolve(kMergeBackward), "kMergeBackward names its own arguments");

constexpr ArgSpec kStatesBackwardArgs[] = {
    {"grad_o",       kOIn, {T, S, H, D}, kWrite, kOptional, kNoAlias, "o"},
    {"grad_lse",     kLse, {T, S, H},    kWrite, kOptional},
    {"grad_out",     kOIn, {T, H, D},    kRead,  kRequired, kNoAlias, "out"},
    {"grad_out_lse", kLse, {T, H},       kRead,  kOptional},
    {"out",          kOIn, {T, H, D},    kRead,  kOptional},
    {"out_lse",      kLse, {T, H},       kRead,  kRequired},
    {"o",            kOIn, {T, S, H, D}, kRead,  kRequired},
    {"lse",          kLse, {T, S, H},    kRead,  kRequired},
};
struct StatesBackwardArg {
  enum : int { kGradO, kGradLse, kGradOut, kGradOutLse, kOut, kOutLse, kO, kLse };
};
static_assert(indexed(kStatesBackwardArgs,
                      {{StatesBackwardArg::kGradO, "grad_o"}, {StatesBackwardArg::kGradLse, "grad_lse"},
                       {StatesBackwardArg::kGradOut, "grad_out"}, {StatesBackwardArg::kGradOutLse, "grad_out_lse"},
                       {StatesBackwardArg::kOut, "out"}, {StatesBackwardArg::kOutLse, "out_lse"},
                       {StatesBackwardArg::kO, "o"}, {StatesBackwardArg::kLse, "lse"}}),
              "StatesBackwardArg indexes kStatesBackwardArgs");
constexpr OpSpec kStatesBackward = make_op(kStatesBackwardArgs, kBase2 | kPdl, "grad_out", "o", "lse", stack_sizes);
static_assert(names_resolve(kStatesBackward), "kStatesBackward names its own arguments");

constexpr ArgSpec kVarlenBackwardArgs[] = {
    {"grad_o",       kOIn,    {N, H, D}, kWrite, kOptional, kNoAlias, "o"},
    {"grad_lse",     kLse,    {N, H},    kWrite, kOptional},
    {"grad_out",     kOIn,    {R, H, D}, kRead,  kRequired, kNoAlias, "out"},
    {"grad_out_lse", kLse,    {R, H},    kRead,  kOptional},
    {"out",          kOIn,    {R, H, D}, kRead,  kOptional},
    {"out_lse",      kLse,    {R, H},    kRead,  kRequired},
    {"o",            kOIn,    {N, H, D}, kRead,  kRequired},
    {"lse",          kLse,    {N, H},    kRead,  kRequired},
    {"indptr",       kIndptr, {R1},      kRead,  kRequired},
};
struct VarlenBackwardArg {
  enum : int { kGradO, kGradLse, kGradOut, kGradOutLse, kOut, kOutLse, kO, kLse, kIndptr };
};
static_assert(indexed(kVarlenBackwardArgs,
                      {{VarlenBackwardArg::kGradO, "grad_o"}, {VarlenBackwardArg::kGradLse, "grad_lse"},
                       {VarlenBackwardArg::kGradOut, "grad_out"}, {VarlenBackwardArg::kGradOutLse, "grad_out_lse"},
                       {VarlenBackwardArg::kOut, "out"}, {VarlenBackwardArg::kOutLse, "out_lse"},
                       {VarlenBackwardArg::kO, "o"}, {VarlenBackwardArg::kLse, "lse"},
                       {VarlenBackwardArg::kIndptr, "indptr"}}),
              "VarlenBackwardArg indexes kVarlenBackwardArgs");
constexpr OpSpec kVarlenBackward = make_op(kVarlenBackwardArgs, kBase2 | kPdl, "grad_out", "o", "lse", range_sizes);
static_assert(names_resolve(kVarlenBackward), "kVarlenBackward names its own arguments");
// clang-format on

// ---- sources ------------------------------------------------------------------------------------

// A view's pointer and strides where it is given; null and zero strides where it is not, so that
// every address of it a source computes is null (not read, not written).
const void* data_or_null(const View& v) { return v.present() ? v.t->data : nullptr; }
int64_t stride_or_0(const View& v, int axis) { return v.present() ? v.strides[axis] : 0; }

// The LSE of a view in Real, the call's (null where absent).
template <typename Real>
const Real* lse_data(const View& lse) {
  return static_cast<const Real*>(data_or_null(lse));
}

// O [tokens, heads, ...] and an LSE, either of which may be absent.
template <typename Real>
BasicStateView<Real> state_of(const View& o, const View& lse) {
  return BasicStateView<Real>{data_or_null(o),     stride_or_0(o, 0),   stride_or_0(o, 1),
                              lse_data<Real>(lse), stride_or_0(lse, 0), stride_or_0(lse, 1)};
}

// The sink [heads], where one is given and not empty (else no sink).
template <typename Real>
BasicSinkView<Real> sink_view(const View* sink) {
  if (sink == nullptr || !sink->present() || sink->empty) return BasicSinkView<Real>{};
  return BasicSinkView<Real>{lse_data<Real>(*sink), sink->strides[0]};
}

// o [tokens, S, heads, ...] and lse [tokens, S, heads], either of which may be absent, and the sink.
template <typename Real>
BasicStackSource<Real> stack_of(const View& o, const View& lse, int64_t states, const View* sink = nullptr) {
  return BasicStackSource<Real>{data_or_null(o),
                                stride_or_0(o, 0),
                                stride_or_0(o, 1),
                                stride_or_0(o, 2),
                                lse_data<Real>(lse),
                                stride_or_0(lse, 0),
                                stride_or_0(lse, 1),
                                stride_or_0(lse, 2),
                                states,
                                sink_view<Real>(sink)};
}

// A softmax-sum tensor (sum_a, sum_b) laid out as its LSE argument: [tokens, heads], [total,
// heads] or [tokens, S, heads]; absent or empty: none (an empty one is never read).
template <typename Real>
BasicSumView<Real> sum_view(const View& v) {
  if (!v.present() || v.empty) return BasicSumView<Real>{};
  const Real* p = static_cast<const Real*>(v.t->data);
  return v.ndim == 3 ? BasicSumView<Real>{p, v.strides[0], v.strides[1], v.strides[2]}
                     : BasicSumView<Real>{p, v.strides[0], 0, v.strides[1]};
}

// options.valid: [tokens, S] (S = 2 for a two-way or in-place merge) or a variable-length merge's
// [total]; absent or empty: none.
ValidView valid_view(const View& v) {
  if (!v.present() || v.empty) return ValidView{};
  return ValidView{v.t->data, v.strides[0], v.ndim > 1 ? v.strides[1] : 0,
                   static_cast<int32_t>(dtype_size(v.t->dtype))};
}

// What a call's states carry beside their LSEs: the sums of its first and second LSE arguments
// and which states hold keys (any absent: none).
template <typename Real>
BasicStateExtras<Real> extras_of(const View& sum_a, const View& sum_b, const View& valid) {
  BasicStateExtras<Real> e{sum_view<Real>(sum_a), sum_view<Real>(sum_b), valid_view(valid)};
  e.on = e.sum_a.p != nullptr || e.sum_b.p != nullptr || e.valid.p != nullptr;
  return e;
}

// Two stacked states as a pair, for the two-way merge's kernel: the same weights, fewer registers
// (no offset from the pointer of an empty tensor, which may be null and is never read).
// `empty_o`, `empty_lse`: those of x's views (an absent one counts as empty); `dtype`: x's O's.
// x's extras follow: its states' sums as a's and b's, its valid [tokens, 2] as theirs.
template <typename Real>
BasicPairSource<Real> pair_of(const BasicStackSource<Real>& x, int dtype, bool empty_o, bool empty_lse,
                              int64_t tokens) {
  const char* o1 = static_cast<const char*>(x.o) + (empty_o ? 0 : x.o_ss * static_cast<int64_t>(dtype_size(dtype)));
  BasicPairSource<Real> pair{
      BasicStateView<Real>{x.o, x.o_st, x.o_sh, x.lse, x.lse_st, x.lse_sh},
      BasicStateView<Real>{o1, x.o_st, x.o_sh, x.lse + (empty_lse ? 0 : x.lse_ss), x.lse_st, x.lse_sh}, tokens,
      nullptr, 0};
  pair.extras = x.extras;
  if (x.extras.sum_a.p != nullptr) {
    pair.extras.sum_b = x.extras.sum_a;
    pair.extras.sum_b.p += x.extras.sum_a.ss;
  }
  return pair;
}

// o [total, heads, ...] and lse [total, heads], either of which may be absent, with indptr and the
// sink.
template <typename Real>
BasicRangeSource<Real> range_of(const View& o, const View& lse, const View& indptr, int64_t total,
                                const View* sink = nullptr) {
  return BasicRangeSource<Real>{data_or_null(o),
                     stride_or_0(o, 0),
                     stride_or_0(o, 1),
                     lse_data<Real>(lse),
                     stride_or_0(lse, 0),
                     stride_or_0(lse, 1),
                     indptr.t->data,
                     indptr.strides[0],
                     indptr.t->dtype == ATTNMERGE_INT64,
                     total,
                     sink_view<Real>(sink)};
}

// The share of state `own` whose O is o [tokens, heads, ...], of the states of lse [tokens, S,
// heads] and the sink: every state's O address is o's (a states stride of 0), read for own alone.
template <typename Real>
BasicShareSource<Real> share_of(const View& o, const View& lse, int64_t states, int64_t own, const View* sink) {
  BasicShareSource<Real> src{stack_of<Real>(o, lse, states, sink), own};
  src.o_st = stride_or_0(o, 0), src.o_ss = 0, src.o_sh = stride_or_0(o, 1);
  return src;
}

// Every rank's states of an exchange as this rank reads them: o and lse its layouts' views, the
// slice's first token or head `begin`, the sink, and valid [tokens of the slice, world].  The
// pointers past world_size repeat rank 0's, so that every address a kernel computes is one of a
// rank's rows; without sums the sums' are the LSEs' (never read).
ExchangeSource exchange_of(const attnmerge_exchange& x, const View& o, const View& lse, int32_t slice, int64_t begin,
                           const View* sink, const View& valid) {
  ExchangeSource src{};
  for (int p = 0; p < exchange::kMaxWorld; ++p) {
    const int from = p < x.world_size ? p : 0;
    src.o[p] = x.o[from];
    src.lse[p] = static_cast<const float*>(x.lse[from]);
    src.sum[p] = static_cast<const float*>(x.sum != nullptr ? x.sum[from] : x.lse[from]);
  }
  src.extras.sums = x.sum != nullptr;
  src.extras.valid = valid_view(valid);
  src.extras.on = src.extras.sums || src.extras.valid.p != nullptr;
  src.o_st = o.strides[0], src.o_sh = o.strides[1], src.lse_st = lse.strides[0], src.lse_sh = lse.strides[1];
  src.token0 = slice == ATTNMERGE_SLICE_TOKENS ? begin : 0;
  src.head0 = slice == ATTNMERGE_SLICE_HEADS ? begin : 0;
  src.world = x.world_size;
  src.sink = sink_view<float>(sink);
  return src;
}

// The protocol's part of an exchange (every rank's pad, checked), for `epoch` (0: the pad's).
exchange::Sync sync_of(const attnmerge_exchange& x, int64_t epoch) {
  exchange::Sync sync{};
  for (int p = 0; p < exchange::kMaxWorld; ++p) sync.pads[p] = static_cast<uint64_t*>(x.pads[p < x.world_size ? p : 0]);
  sync.rank = x.rank, sync.world = x.world_size;
  sync.epoch = static_cast<uint64_t>(epoch);
  sync.timeout_ns = static_cast<uint64_t>(x.timeout_ns);
  sync.reuse = static_cast<exchange::Reuse>(x.reuse);
  return sync;
}

// An epoch argument: >= 0 (0: the pad's).
attnmerge_status check_epoch_arg(int64_t epoch, const ArgNames& names) {
  if (epoch >= 0) return ATTNMERGE_SUCCESS;
  return fail(ATTNMERGE_ERROR_VALUE, "%s: expected an epoch >= 0 (0: the one the pad keeps), got %" PRId64,
              names.of("epoch"), epoch);
}

// The start of the exchange's publish and status: the exchange's pads and this rank's device.
attnmerge_status pads_call(const attnmerge_exchange* x, const ArgNames& names, int& device) {
  attnmerge_status s;
  if ((s = check_exchange(x, ExchangeUse::kPads, names)) || (s = check_exchange_pointers(x, ExchangeUse::kPads, names)))
    return s;
  return locate_exchange(Views{nullptr, 0, &names}, nullptr, x, ExchangeUse::kPads, device);
}

// The LSE bases of a call (options.flags, checked): the inputs' (a's, every state's, the sink's),
// and that of an argument with flags of its own (to_base2, to_base_e: at most one set), the
// inputs' where it has neither.
bool inputs_base2(uint32_t flags) { return (flags & ATTNMERGE_LSE_BASE2) != 0; }
bool lse_base2(uint32_t flags, uint32_t to_base2, uint32_t to_base_e) {
  return (flags & to_base2) ? true : (flags & to_base_e) ? false : inputs_base2(flags);
}

// `scales`: the group scales [tokens, heads, groups] (absent: none).
template <typename Real>
BasicOutView<Real> out_view(const View& out, const View& out_lse, const View& scales, const Checked& c) {
  BasicOutView<Real> v{out.t->data,
                       out.strides[0],
                       out.strides[1],
                       out_lse.present() ? static_cast<Real*>(out_lse.t->data) : nullptr,
                       stride_or_0(out_lse, 0),
                       stride_or_0(out_lse, 1),
                       c.inv_scale,
                       c.opt.output_scale_ptr,
                       false,
                       base_change<Real>(inputs_base2(c.opt.flags),
                                         lse_base2(c.opt.flags, ATTNMERGE_OUT_LSE_BASE2, ATTNMERGE_OUT_LSE_BASE_E))};
  if (scales.present() && !scales.empty) {
    const uint32_t flags = c.opt.flags;
    v.group_scales = scales.t->data;
    v.gs_st = scales.strides[0], v.gs_sh = scales.strides[1], v.gs_sg = scales.strides[2];
    v.group = c.opt.group_size;
    v.ue8m0 = (flags & ATTNMERGE_GROUP_SCALE_UE8M0) != 0;
    v.block = (flags & ATTNMERGE_BLOCK_NVFP4)   ? BlockScales::kNvfp4
              : (flags & ATTNMERGE_BLOCK_MXFP8) ? ((flags & ATTNMERGE_SCALE_RCEIL) ? BlockScales::kMxRceil
                                                                                   : BlockScales::kMxFloor)
                                                : BlockScales::kFloat;
    if (v.block != BlockScales::kFloat) v.group = v.block == BlockScales::kNvfp4 ? 16 : 32;  // 0: the format's
    v.swizzled = (flags & ATTNMERGE_SCALE_SWIZZLED) != 0;
    v.head_groups = static_cast<int32_t>(c.sizes.head_size / v.group);
    if (v.block == BlockScales::kNvfp4) {  // the output scale is the global one: no part of the merge's weights
      v.global = c.opt.output_scale != 0.0f ? c.opt.output_scale : 1.0f;
      v.global_ptr = c.opt.output_scale_ptr;
      v.inv_scale = 1;
      v.scale = nullptr;
    }
  }
  return v;
}

// The output storage type a call's kernels (and CPU loop) are instantiated with: out's dtype, or
// FP8 for NVFP4, a run-time mode of the FP8 kernels (OutView::block).
int kernel_out_dtype(const View& out, const Checked& c) {
  return (c.opt.flags & ATTNMERGE_BLOCK_NVFP4) ? ATTNMERGE_FLOAT8_E4M3 : out.t->dtype;
}

// out_lse is the very LSE of an input it merges (read by every thread of a row, written by one).
bool lse_in_place(const View& out_lse, const View& lse_a, const View& lse_b) {
  if (!out_lse.present() || out_lse.empty) return false;
  return (lse_a.present() && !lse_a.empty && same_view(out_lse, lse_a)) || (!lse_b.empty && same_view(out_lse, lse_b));
}

// `tokens`: the output's first axis (a variable-length merge's rows), the launch's capacity; the
// live count read from options.num_tokens where given.
MergeShape merge_shape(int64_t tokens, const Sizes& n, const Checked& c) {
  MergeShape shape{tokens, n.heads, n.head_size, inputs_base2(c.opt.flags)};
  if (c.num_tokens >= 0) {
    const View& live = c.views[c.num_tokens];
    shape.live_tokens = live.t->data;
    shape.live_wide = live.t->dtype == ATTNMERGE_INT64;
  }
  return shape;
}

// The two-way and in-place merges' common end: a = (o_a, lse_a), b = (o_b, lse_b).
// `scales`: the group scales and `sink` the sink (absent: none; the in-place merge has neither);
// `sum_a`, `sum_b`: the LSEs' softmax sums and `valid` the states holding keys, `a_count` a_tokens
// read on the device (absent: none).
template <typename Real>
attnmerge_status run_pair(Checked& c, const View& out, const View& out_lse, const View& o_a, const View& lse_a,
                          const View& o_b, const View& lse_b, const View& scales, const View& sink, const View* mask,
                          const View& sum_a, const View& sum_b, const View& valid, const View& a_count, void* stream) {
  BasicPairSource<Real> src{state_of<Real>(o_a, lse_a), state_of<Real>(o_b, lse_b), c.sizes.a_tokens, nullptr, 0};
  if (a_count.present()) {
    src.a_tokens_at = a_count.t->data;
    src.a_tokens_wide = a_count.t->dtype == ATTNMERGE_INT64;
  }
  src.b_scale = base_change<Real>(lse_base2(c.opt.flags, ATTNMERGE_LSE_B_BASE2, ATTNMERGE_LSE_B_BASE_E),
                                  inputs_base2(c.opt.flags));
  src.extras = extras_of<Real>(sum_a, sum_b, valid);
  if (mask != nullptr && mask->present() && !mask->empty) {
    src.mask = static_cast<const uint8_t*>(mask->t->data);
    src.mask_stride = mask->strides[0];
  }
  BasicOutView<Real> dst = out_view<Real>(out, out_lse, scales, c);
  dst.lse_in_place = lse_in_place(out_lse, lse_a, lse_b);
  // An LSE argument that holds maxima (its sums given) is no place for the merged LSE.
  for (const auto& [lse, sum] : {std::pair<const View*, const View*>{&lse_a, &sum_a}, {&lse_b, &sum_b}})
    if (dst.lse_in_place && sum->present() && same_view(out_lse, *lse))
      return fail(ATTNMERGE_ERROR_VALUE,
                  "%s: expected memory apart from %s, which holds softmax maxima (their sums in %s) the merged LSE "
                  "would overwrite, got the very same view",
                  out_lse.name(), lse->name(), sum->name());
  const MergeShape shape = merge_shape(c.sizes.tokens, c.sizes, c);
  const BasicSinkView<Real> sinks = sink_view<Real>(&sink);
  if (sinks.lse != nullptr) {
    // A merge into an input's LSE runs in place (its rows' threads meet before the LSE is
    // written), and the in-place kernels take no sink.
    if (dst.lse_in_place)
      return fail(ATTNMERGE_ERROR_VALUE,
                  "%s: expected none where %s is %s (a merge in place takes no sink), got a tensor", sink.name(),
                  out_lse.name(), same_view(out_lse, lse_a) ? lse_a.name() : lse_b.name());
    return run(c.all(), shape, BasicSinkPairSource<Real>{src, sinks}, dst, o_a.t->dtype, kernel_out_dtype(out, c),
               stream, c.opt.flags);
  }
  return run(c.all(), shape, src, dst, o_a.t->dtype, kernel_out_dtype(out, c), stream, c.opt.flags);
}

}  // namespace
}  // namespace detail
}  // namespace attnmerge

using namespace attnmerge;
using namespace attnmerge::detail;

extern "C" {

attnmerge_status attnmerge_merge(const attnmerge_tensor* out, const attnmerge_tensor* out_lse,
                                 const attnmerge_tensor* o_a, const attnmerge_tensor* lse_a,
                                 const attnmerge_tensor* o_b, const attnmerge_tensor* lse_b,
                                 const attnmerge_options* options, void* stream) {
  begin_call();
  Checked c;
  const attnmerge_tensor* const args[] = {out, out_lse, o_a, lse_a, o_b, lse_b, sink_of(options),
                                          group_scales_of(options), sum_a_of(options), sum_b_of(options),
                                          valid_of(options), num_tokens_of(options), a_tokens_of(options)};
  if (attnmerge_status s = validate(kMerge, args, options, c)) return s;
  using A = MergeArg;
  const View* v = c.views;
  return dispatch_real(c.precision, [&](auto real) {
    return run_pair<decltype(real)>(c, v[A::kOut], v[A::kOutLse], v[A::kOA], v[A::kLseA], v[A::kOB], v[A::kLseB],
                                    v[A::kGroupScales], v[A::kSink], nullptr, v[A::kSumA], v[A::kSumB],
                                    v[A::kValid], v[A::kACount], stream);
  });
}

attnmerge_status attnmerge_merge_inplace(const attnmerge_tensor* o, const attnmerge_tensor* lse,
                                         const attnmerge_tensor* o_other, const attnmerge_tensor* lse_other,
                                         const attnmerge_tensor* mask, const attnmerge_options* options, void* stream) {
  begin_call();
  Checked c;
  const attnmerge_tensor* const args[] = {o, lse, o_other, lse_other, mask, sum_b_of(options), valid_of(options),
                                          num_tokens_of(options)};
  if (attnmerge_status s = validate(kInplace, args, options, c)) return s;
  using A = InplaceArg;
  const View* v = c.views;
  const View none;  // no group scales, no sink, no sums of lse (the merged LSE goes there)
  // (o, lse) is both a and the output.
  return dispatch_real(c.precision, [&](auto real) {
    return run_pair<decltype(real)>(c, v[A::kO], v[A::kLse], v[A::kO], v[A::kLse], v[A::kOOther], v[A::kLseOther],
                                    none, none, &v[A::kMask], none, v[A::kSumB], v[A::kValid], none, stream);
  });
}

attnmerge_status attnmerge_merge_states(const attnmerge_tensor* out, const attnmerge_tensor* out_lse,
                                        const attnmerge_tensor* o, const attnmerge_tensor* lse,
                                        const attnmerge_options* options, void* stream) {
  begin_call();
  Checked c;
  const attnmerge_tensor* const args[] = {out, out_lse, o, lse, sink_of(options), group_scales_of(options),
                                          sum_a_of(options), valid_of(options), num_tokens_of(options)};
  if (attnmerge_status s = validate(kStates, args, options, c)) return s;
  using A = StatesArg;
  const View &vo = c.views[A::kO], &vl = c.views[A::kLse];
  const Sizes& n = c.sizes;
  const MergeShape shape = merge_shape(n.tokens, n, c);
  const int out_dtype = kernel_out_dtype(c.views[A::kOut], c);
  return dispatch_real(c.precision, [&](auto real) {
    using Real = decltype(real);
    const BasicOutView<Real> dst = out_view<Real>(c.views[A::kOut], c.views[A::kOutLse], c.views[A::kGroupScales], c);
    BasicStackSource<Real> src = stack_of<Real>(vo, vl, n.states, &c.views[A::kSink]);
    src.extras = extras_of<Real>(c.views[A::kSumA], View{}, c.views[A::kValid]);
    if (n.states == 2) {  // the two-way merge's kernels
      const BasicPairSource<Real> pair = pair_of(src, o->dtype, vo.empty, vl.empty, n.tokens);
      if (src.sink.lse != nullptr)
        return run(c.all(), shape, BasicSinkPairSource<Real>{pair, src.sink}, dst, o->dtype, out_dtype, stream,
                   c.opt.flags);
      return run(c.all(), shape, pair, dst, o->dtype, out_dtype, stream, c.opt.flags);
    }
    return run(c.all(), shape, src, dst, o->dtype, out_dtype, stream, c.opt.flags);
  });
}

attnmerge_status attnmerge_merge_varlen(const attnmerge_tensor* out, const attnmerge_tensor* out_lse,
                                        const attnmerge_tensor* o, const attnmerge_tensor* lse,
                                        const attnmerge_tensor* indptr, const attnmerge_options* options,
                                        void* stream) {
  begin_call();
  Checked c;
  const attnmerge_tensor* const args[] = {out, out_lse, o, lse, indptr, sink_of(options), group_scales_of(options),
                                          sum_a_of(options), valid_of(options), num_tokens_of(options)};
  attnmerge_status s;
  if ((s = validate(kVarlen, args, options, c))) return s;
  using A = VarlenArg;
  const View &vo = c.views[A::kO], &vi = c.views[A::kIndptr];
  const Sizes& n = c.sizes;
  if ((s = check_indptr(vi, vo, out, n.rows))) return s;
  return dispatch_real(c.precision, [&](auto real) {
    using Real = decltype(real);
    BasicRangeSource<Real> src = range_of<Real>(vo, c.views[A::kLse], vi, n.total, &c.views[A::kSink]);
    src.extras = extras_of<Real>(c.views[A::kSumA], View{}, c.views[A::kValid]);
    return run(c.all(), merge_shape(n.rows, n, c), src,
               out_view<Real>(c.views[A::kOut], c.views[A::kOutLse], c.views[A::kGroupScales], c), o->dtype,
               kernel_out_dtype(c.views[A::kOut], c), stream, c.opt.flags);
  });
}

attnmerge_status attnmerge_merge_share(const attnmerge_tensor* out, const attnmerge_tensor* out_lse,
                                       const attnmerge_tensor* o, const attnmerge_tensor* lse, int64_t index,
                                       const attnmerge_options* options, void* stream) {
  begin_call();
  Checked c;
  const attnmerge_tensor* const args[] = {out, out_lse, o, lse, sink_of(options), group_scales_of(options),
                                          sum_a_of(options), valid_of(options), num_tokens_of(options)};
  if (attnmerge_status s = validate(kShare, args, options, c)) return s;
  using A = ShareArg;
  const View& vl = c.views[A::kLse];
  const Sizes& n = c.sizes;
  if (index < 0 || index >= n.states)
    return fail(ATTNMERGE_ERROR_VALUE, "%s: expected 0 <= index < %" PRId64 " (the states of %s), got %" PRId64,
                c.names.of("index"), n.states, vl.name(), index);
  return dispatch_real(c.precision, [&](auto real) {
    using Real = decltype(real);
    BasicShareSource<Real> src = share_of<Real>(c.views[A::kO], vl, n.states, index, &c.views[A::kSink]);
    src.extras = extras_of<Real>(c.views[A::kSumA], View{}, c.views[A::kValid]);
    return run(c.all(), merge_shape(n.tokens, n, c), src,
               out_view<Real>(c.views[A::kOut], c.views[A::kOutLse], c.views[A::kGroupScales], c), o->dtype,
               kernel_out_dtype(c.views[A::kOut], c), stream, c.opt.flags);
  });
}

int64_t attnmerge_exchange_pad_bytes(int32_t world_size) {
  if (world_size < 1 || world_size > ATTNMERGE_EXCHANGE_MAX_WORLD) return 0;
  return exchange::pad_words(world_size) * static_cast<int64_t>(sizeof(uint64_t));
}

attnmerge_status attnmerge_exchange_publish(const attnmerge_exchange* exchange, int64_t epoch, void* stream) {
  begin_call();
  const ArgNames names;
  int device;
  attnmerge_status s;
  if ((s = pads_call(exchange, names, device)) || (s = check_epoch_arg(epoch, names))) return s;
  const exchange::Sync sync = sync_of(*exchange, epoch);
  return device == ATTNMERGE_HOST ? cpu_exchange_publish(sync) : gpu_exchange_publish(sync, device, stream);
}

attnmerge_status attnmerge_merge_exchange(const attnmerge_tensor* out, const attnmerge_tensor* out_lse,
                                          const attnmerge_exchange* exchange, int32_t slice, int64_t slice_begin,
                                          int64_t epoch, const attnmerge_options* options, void* stream) {
  begin_call();
  Checked c;
  attnmerge_status s;
  if ((s = read_layout(options, c.opt, c.names)) || (s = check_exchange(exchange, ExchangeUse::kStates, c.names)) ||
      (s = check_exchange_pointers(exchange, ExchangeUse::kStates, c.names)))
    return s;
  // The ranks' layouts at this rank's own pointers: validated as any op's O and LSE.
  attnmerge_tensor o = exchange->o_layout, lse = exchange->lse_layout;
  o.data = const_cast<void*>(exchange->o[exchange->rank]);
  lse.data = const_cast<void*>(exchange->lse[exchange->rank]);
  const attnmerge_tensor* const args[] = {out, out_lse, &o, &lse, sink_of(options), valid_of(options)};
  // The ranks' states come from GPU engines: float64, the CPU path's alone, has no exchange (asked
  // first: a float64 layout over the ranks' buffers would be taken for an overlap).
  const char* const arg_names[] = {"out", "out_lse", "o", "lse"};
  for (int i = 0; i < 4; ++i)
    if (args[i] != nullptr && args[i]->dtype == ATTNMERGE_FLOAT64)
      return fail(ATTNMERGE_ERROR_TYPE, "%s: expected a dtype other than float64 (the exchange merges the 16- and "
                  "32-bit states of GPU engines), got float64", c.names.of(arg_names[i]));
  c.sizes.states = exchange->world_size;  // valid's second axis (exchange_sizes leaves it)
  if ((s = validate(kExchange, args, options, c))) return s;
  using A = ExchangeArg;
  const View* v = c.views;
  if ((s = check_slice(slice, slice_begin, v[A::kOut], c.sizes)) ||
      (s = check_apart_from_ranks(exchange, c.all(), v[A::kO], v[A::kLse])) || (s = check_epoch_arg(epoch, c.names)))
    return s;
  const Sizes& n = c.sizes;
  const MergeShape shape{n.slice_tokens, n.slice_heads, n.head_size, inputs_base2(c.opt.flags)};
  const ExchangeSource src = exchange_of(*exchange, v[A::kO], v[A::kLse], slice, slice_begin, &v[A::kSink], v[A::kValid]);
  const OutView dst = out_view<float>(v[A::kOut], v[A::kOutLse], View{}, c);
  return run_exchange(c.all(), shape, src, dst, sync_of(*exchange, epoch), exchange, o.dtype, out->dtype, stream,
                      c.opt.flags);
}

attnmerge_status attnmerge_exchange_status(const attnmerge_exchange* exchange, void* stream) {
  begin_call();
  const ArgNames names;
  int device;
  if (attnmerge_status s = pads_call(exchange, names, device)) return s;
  return exchange_status(sync_of(*exchange, 0), device, stream);
}

attnmerge_status attnmerge_merge_backward(const attnmerge_tensor* grad_o_a, const attnmerge_tensor* grad_lse_a,
                                          const attnmerge_tensor* grad_o_b, const attnmerge_tensor* grad_lse_b,
                                          const attnmerge_tensor* grad_out, const attnmerge_tensor* grad_out_lse,
                                          const attnmerge_tensor* out, const attnmerge_tensor* out_lse,
                                          const attnmerge_tensor* o_a, const attnmerge_tensor* lse_a,
                                          const attnmerge_tensor* o_b, const attnmerge_tensor* lse_b,
                                          const attnmerge_options* options, void* stream) {
  begin_call();
  Checked c;
  const attnmerge_tensor* const args[] = {grad_o_a, grad_lse_a, grad_o_b, grad_lse_b, grad_out, grad_out_lse,
                                          out,      out_lse,    o_a,      lse_a,      o_b,      lse_b};
  if (attnmerge_status s = validate(kMergeBackward, args, options, c)) return s;
  using A = MergeBackwardArg;
  const View* v = c.views;
  const View &vga = v[A::kGradOA], &vgla = v[A::kGradLseA], &vgb = v[A::kGradOB], &vglb = v[A::kGradLseB];
  const int64_t a_tokens = c.sizes.a_tokens;
  return dispatch_real(c.precision, [&](auto real) {
    using Real = decltype(real);
    const BasicPairSource<Real> in{state_of<Real>(v[A::kOA], v[A::kLseA]), state_of<Real>(v[A::kOB], v[A::kLseB]),
                                   a_tokens, nullptr, 0};
    const BasicPairSource<Real> grad{state_of<Real>(vga, vgla), state_of<Real>(vgb, vglb), a_tokens, nullptr, 0};
    const BackwardArgs<BasicPairBackward<Real>> back{
        BasicPairBackward<Real>{in, grad}, state_of<Real>(v[A::kOut], v[A::kOutLse]),
        state_of<Real>(v[A::kGradOut], v[A::kGradOutLse]), vga.present() || vgb.present(),
        vgla.present() || vglb.present()};
    return run_backward(c.all(), merge_shape(c.sizes.tokens, c.sizes, c), back, 2, o_a->dtype, grad_out->dtype,
                        stream, c.opt.flags);
  });
}

attnmerge_status attnmerge_merge_states_backward(const attnmerge_tensor* grad_o, const attnmerge_tensor* grad_lse,
                                                 const attnmerge_tensor* grad_out, const attnmerge_tensor* grad_out_lse,
                                                 const attnmerge_tensor* out, const attnmerge_tensor* out_lse,
                                                 const attnmerge_tensor* o, const attnmerge_tensor* lse,
                                                 const attnmerge_options* options, void* stream) {
  begin_call();
  Checked c;
  const attnmerge_tensor* const args[] = {grad_o, grad_lse, grad_out, grad_out_lse, out, out_lse, o, lse};
  if (attnmerge_status s = validate(kStatesBackward, args, options, c)) return s;
  using A = StatesBackwardArg;
  const View* v = c.views;
  const View &vg = v[A::kGradO], &vgl = v[A::kGradLse], &vo = v[A::kO], &vl = v[A::kLse];
  const Sizes& n = c.sizes;
  const MergeShape shape = merge_shape(n.tokens, n, c);
  return dispatch_real(c.precision, [&](auto real) {
    using Real = decltype(real);
    const BasicStackSource<Real> in = stack_of<Real>(vo, vl, n.states), grad = stack_of<Real>(vg, vgl, n.states);
    const BasicStateView<Real> fwd = state_of<Real>(v[A::kOut], v[A::kOutLse]),
                               incoming = state_of<Real>(v[A::kGradOut], v[A::kGradOutLse]);
    if (n.states == 2) {  // the two-way merge's kernel, as in the forward: 64 registers against 108
      const BackwardArgs<BasicPairBackward<Real>> back{
          BasicPairBackward<Real>{pair_of(in, o->dtype, vo.empty, vl.empty, n.tokens),
                                  pair_of(grad, o->dtype, vg.empty, vgl.empty, n.tokens)},
          fwd, incoming, vg.present(), vgl.present()};
      return run_backward(c.all(), shape, back, n.states, o->dtype, grad_out->dtype, stream, c.opt.flags);
    }
    const BackwardArgs<BasicStackBackward<Real>> back{BasicStackBackward<Real>{in, grad}, fwd, incoming, vg.present(),
                                                      vgl.present()};
    return run_backward(c.all(), shape, back, n.states, o->dtype, grad_out->dtype, stream, c.opt.flags);
  });
}

attnmerge_status attnmerge_merge_varlen_backward(const attnmerge_tensor* grad_o, const attnmerge_tensor* grad_lse,
                                                 const attnmerge_tensor* grad_out, const attnmerge_tensor* grad_out_lse,
                                                 const attnmerge_tensor* out, const attnmerge_tensor* out_lse,
                                                 const attnmerge_tensor* o, const attnmerge_tensor* lse,
                                                 const attnmerge_tensor* indptr, const attnmerge_options* options,
                                                 void* stream) {
  begin_call();
  Checked c;
  const attnmerge_tensor* const args[] = {grad_o, grad_lse, grad_out, grad_out_lse, out, out_lse, o, lse, indptr};
  attnmerge_status s;
  if ((s = validate(kVarlenBackward, args, options, c))) return s;
  using A = VarlenBackwardArg;
  const View* v = c.views;
  const View &vg = v[A::kGradO], &vgl = v[A::kGradLse], &vo = v[A::kO], &vl = v[A::kLse], &vi = v[A::kIndptr];
  const Sizes& n = c.sizes;
  if ((s = check_indptr(vi, vo, grad_out, n.rows))) return s;
  // With no rows, one row over every state writes their zeros (RangeBackward).
  const MergeShape shape = merge_shape(n.rows > 0 ? n.rows : n.total > 0 ? 1 : 0, n, c);
  const int64_t states = n.rows > 0 ? (n.total + n.rows - 1) / n.rows : n.total;
  return dispatch_real(c.precision, [&](auto real) {
    using Real = decltype(real);
    const BackwardArgs<BasicRangeBackward<Real>> back{
        BasicRangeBackward<Real>{range_of<Real>(vo, vl, vi, n.total), range_of<Real>(vg, vgl, vi, n.total), n.rows},
        state_of<Real>(v[A::kOut], v[A::kOutLse]), state_of<Real>(v[A::kGradOut], v[A::kGradOutLse]), vg.present(),
        vgl.present()};
    return run_backward(c.all(), shape, back, states, o->dtype, grad_out->dtype, stream, c.opt.flags);
  });
}

}  // extern "C"
