// The launch plan (attnmerge/plan.h, host-only C++) as a command-line probe for the tests: each
// line of standard input names a call, each line of output is its plan.  No GPU or CUDA needed.
//
//   in:  op tokens heads head_size states vec sms [flags]
//        op: pair | inplace | stack | range (states: the range's total over `tokens` rows);
//        flags: any of m (masked), a (a_tokens < tokens), t (LSEs [heads, tokens]), p (PDL),
//        g (a gap between tokens: O's token stride one head longer than its heads), w (the output's
//        heads twice head_size apart: dense, but its rows step unlike the inputs'), s (a small call:
//        1 MB moved), x (each vector access is 16 bytes), q (per-group FP8 outputs, groups of
//        8 vectors); then, optionally, the MB the call moves
//        (else 2^40 bytes, or 1 MB with s)
//   out: strategy chunk groups launches plain fused_lse index32  grid.x grid.y grid.z  block.x block.y block.z  smem
//        flat lane_lse vec stream
#include <attnmerge/plan.h>

#include <algorithm>
#include <cstdio>
#include <iostream>
#include <sstream>
#include <string>

using namespace attnmerge;

namespace {

template <typename Source>
void print(const MergeShape& shape, const Source& src, const OutView& out, const CallFacts& facts, int sms) {
  const LaunchPlan p = plan_merge(shape, src, out, facts, DeviceInfo{sms, 9});
  const Variant v = p.variant;
  const bool plain = v == Variant::kRowsPlain || v == Variant::kRowsPlainFlat || v == Variant::kInPlacePlainFlat;
  const bool fused = v == Variant::kInPlaceWarp || v == Variant::kInPlaceBlock || v == Variant::kInPlacePlainFlat;
  const bool flat = v == Variant::kRowsPlainFlat || v == Variant::kInPlacePlainFlat;
  const bool lanes = v == Variant::kInPlaceWarp || v == Variant::kInPlacePlainFlat;
  std::printf("%s %d %d %d %d %d %d  %u %u %u  %u %u %u  %u  %d %d %d %d\n",
              p.strategy() == Strategy::kStates ? "states" : "rows", p.chunk, p.groups, p.launches(), plain, fused,
              p.index32, p.main.grid[0], p.main.grid[1], p.main.grid[2], p.main.block[0], p.main.block[1],
              p.main.block[2], p.main.smem, flat, lanes, p.vec, p.shape.evict_first);
}

}  // namespace

int main() {
  std::string line;
  static const uint8_t mask_byte = 1;
  static float lse = 0.0f;
  while (std::getline(std::cin, line)) {
    std::istringstream in(line);
    std::string op, flags;
    int64_t tokens, heads, head_size, states;
    int vec, sms;
    if (!(in >> op >> tokens >> heads >> head_size >> states >> vec >> sms)) continue;
    in >> flags;
    CallFacts facts;
    facts.in = facts.out = Dtype::kBFloat16;  // the probe's calls: bfloat16 in and out
    facts.vec = vec;
    facts.access_bytes = flags.find('x') != std::string::npos ? 16 : 0;
    // large: evict-first by the sources' own rules only; s (small): a call of 1 MB
    facts.bytes = flags.find('s') != std::string::npos ? int64_t{1} << 20 : int64_t{1} << 40;
    double mb = 0;
    if (in >> mb) facts.bytes = static_cast<int64_t>(mb * (1 << 20));
    facts.max_offset = (op == "range" ? states : tokens * std::max<int64_t>(states, 1)) * heads * head_size;
    facts.lse_tokens_inner = flags.find('t') != std::string::npos;
    facts.pdl = flags.find('p') != std::string::npos;
    const MergeShape shape{tokens, heads, head_size, false};
    // [tokens, heads, head_size] O and [tokens, heads] LSEs (or [heads, tokens]: t), dense unless g.
    const bool tokens_inner = facts.lse_tokens_inner, gap = flags.find('g') != std::string::npos;
    const int64_t o_st = (heads + (gap ? 1 : 0)) * head_size;
    const int64_t lse_st = tokens_inner ? 1 : heads, lse_sh = tokens_inner ? tokens : 1;
    const int64_t out_sh = (flags.find('w') != std::string::npos ? 2 : 1) * head_size;
    OutView out{&lse, o_st / head_size * out_sh, out_sh, &lse, lse_st, lse_sh, 1.0f, nullptr, op == "inplace"};
    if (flags.find('q') != std::string::npos) out.group_scales = &lse, out.group = 8 * vec;
    const StateView view{&lse, o_st, head_size, &lse, lse_st, lse_sh};
    if (op == "pair" || op == "inplace") {
      PairSource src{view, view, flags.find('a') != std::string::npos ? tokens - 1 : tokens, nullptr, 0};
      if (flags.find('m') != std::string::npos) src.mask = &mask_byte;
      print(shape, src, out, facts, sms);
    } else if (op == "stack") {
      print(shape, StackSource{&lse, 0, 0, 0, &lse, 0, 0, 0, states, SinkView{}}, out, facts, sms);
    } else if (op == "range") {
      print(shape, RangeSource{&lse, 0, 0, &lse, 0, 0, &lse, 0, false, states, SinkView{}}, out, facts, sms);
    } else {
      std::printf("unknown op %s\n", op.c_str());
      return 2;
    }
  }
  return 0;
}
