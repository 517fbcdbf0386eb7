// The launch plan (attnmerge/plan.h, host-only C++) as a command-line probe for the tests: each
// line of standard input names a call, each line of output is its plan.  No GPU or CUDA needed.
//
//   in:  op in out tokens heads head_size states vec sms flags [mb]
//        op: pair | inplace | stack | range | share (states: S, or the range's total over `tokens`
//        rows); in, out: the O dtypes (float32, float16, bfloat16; out also float8_e4m3); vec:
//        elements per vector access that the call's pointers and strides allow; flags, or - for
//        none: m (masked), a (a_tokens < tokens), t (LSEs [heads, tokens]), p (PDL), g (a gap
//        between tokens: O's token stride one head longer than its heads), w (the output's heads
//        twice head_size apart: dense, but its rows step unlike the inputs'), s (a small call: 1
//        MB moved), q (per-group FP8 outputs, groups of 8 vectors), f (offsets past 32 bits), k (a
//        sink), b (batch invariant); then, optionally, the MB the call moves (else 2^40 bytes, or 1 MB with s)
//   out: variant strategy chunk groups launches index32 vec evict_first tile_shift compiled
//        access bound  grid.x grid.y grid.z  block.x block.y block.z  smem
//        lse.grid.x lse.grid.y lse.grid.z  lse.block.x lse.block.y lse.block.z
//        compiled: may_plan holds for the plan (launch_merge has its kernel); access: bytes per
//        thread of the wider O dtype; bound: the most threads per block its kernel is compiled for.
#include <attnmerge/plan.h>

#include <algorithm>
#include <cstdio>
#include <iostream>
#include <sstream>
#include <string>

using namespace attnmerge;

namespace {

Dtype dtype_named(const std::string& name) {
  if (name == "float32") return Dtype::kFloat32;
  if (name == "float16") return Dtype::kFloat16;
  if (name == "bfloat16") return Dtype::kBFloat16;
  if (name == "float8_e4m3") return Dtype::kFloat8E4M3;
  return Dtype::kUnknown;
}

int size_of(Dtype d) { return d == Dtype::kFloat32 ? 4 : d == Dtype::kFloat8E4M3 ? 1 : 2; }

template <typename Source>
void print(const MergeShape& shape, const Source& src, const OutView& out, const CallFacts& facts, int sms,
           bool masked) {
  const LaunchPlan p = plan_merge(shape, src, out, facts, DeviceInfo{sms, 9});
  const int access = p.vec * std::max(size_of(facts.in), size_of(facts.out));
  const Cache cache = p.shape.evict_first ? Cache::kEvictFirst : Cache::kDefault;
  const bool compiled = may_plan<Source>(p.variant, facts.in, facts.out, access, cache,
                                         masked ? Mask::kByToken : Mask::kNone);
  const int bound = p.variant == Variant::kStates              ? kStateBlockThreads
                    : Source::Traits::kMaxStates == 2          ? kPairMaxBlockThreads
                                                               : kBlockThreads;
  std::printf("%s %s %d %d %d %d %d %d %d %d %d %d  %u %u %u  %u %u %u  %u  %u %u %u  %u %u %u\n",
              variant_name(p.variant), p.strategy() == Strategy::kStates ? "states" : "rows", p.chunk, p.groups,
              p.launches(), p.index32, p.vec, p.shape.evict_first, p.shape.tile_shift, compiled, access, bound,
              p.main.grid[0], p.main.grid[1], p.main.grid[2], p.main.block[0], p.main.block[1], p.main.block[2],
              p.main.smem, p.lse.grid[0], p.lse.grid[1], p.lse.grid[2], p.lse.block[0], p.lse.block[1],
              p.lse.block[2]);
}

}  // namespace

int main() {
  std::string line;
  static const uint8_t mask_byte = 1;
  static float lse = 0.0f;
  while (std::getline(std::cin, line)) {
    std::istringstream in(line);
    std::string op, in_dtype, out_dtype, flags;
    int64_t tokens, heads, head_size, states;
    int vec, sms;
    if (!(in >> op >> in_dtype >> out_dtype >> tokens >> heads >> head_size >> states >> vec >> sms >> flags)) {
      std::printf("unreadable: %s\n", line.c_str());
      return 2;
    }
    const auto has = [&](char f) { return flags.find(f) != std::string::npos; };
    CallFacts facts;
    facts.in = dtype_named(in_dtype);
    facts.out = dtype_named(out_dtype);
    facts.vec = vec;
    facts.access_bytes = vec * std::max(size_of(facts.in), size_of(facts.out));
    facts.bytes = has('s') ? int64_t{1} << 20 : int64_t{1} << 40;
    double mb = 0;
    if (in >> mb) facts.bytes = static_cast<int64_t>(mb * (1 << 20));
    facts.max_offset = (op == "range" ? states : tokens * std::max<int64_t>(states, 1)) * heads * head_size;
    if (has('f')) facts.max_offset = std::max<int64_t>(facts.max_offset, int64_t{1} << 31);
    facts.lse_tokens_inner = has('t');
    facts.pdl = has('p');
    facts.batch_invariant = has('b');
    const MergeShape shape{tokens, heads, head_size, false};
    // [tokens, heads, head_size] O and [tokens, heads] LSEs (or [heads, tokens]: t), dense unless g.
    const bool tokens_inner = facts.lse_tokens_inner;
    const int64_t o_st = (heads + (has('g') ? 1 : 0)) * head_size;
    const int64_t lse_st = tokens_inner ? 1 : heads, lse_sh = tokens_inner ? tokens : 1;
    const int64_t out_sh = (has('w') ? 2 : 1) * head_size;
    OutView out{&lse, o_st / head_size * out_sh, out_sh, &lse, lse_st, lse_sh, 1.0f, nullptr, op == "inplace"};
    if (has('q')) out.group_scales = &lse, out.group = 8 * vec;
    const StateView view{&lse, o_st, head_size, &lse, lse_st, lse_sh};
    const SinkView sink{has('k') ? &lse : nullptr, 1};
    if (op == "pair" || op == "inplace") {
      PairSource src{view, view, has('a') ? tokens - 1 : tokens, nullptr, 0};
      if (has('m')) src.mask = &mask_byte;
      if (has('k')) {
        print(shape, SinkPairSource{src, sink}, out, facts, sms, false);
      } else {
        print(shape, src, out, facts, sms, has('m'));
      }
    } else if (op == "stack") {
      print(shape, StackSource{&lse, 0, 0, 0, &lse, 0, 0, 0, states, sink}, out, facts, sms, false);
    } else if (op == "range") {
      print(shape, RangeSource{&lse, 0, 0, &lse, 0, 0, &lse, 0, false, states, sink}, out, facts, sms, false);
    } else if (op == "share") {
      print(shape, ShareSource{{&lse, 0, 0, 0, &lse, 0, 0, 0, states, sink}, 0}, out, facts, sms, false);
    } else {
      std::printf("unknown op %s\n", op.c_str());
      return 2;
    }
  }
  return 0;
}
