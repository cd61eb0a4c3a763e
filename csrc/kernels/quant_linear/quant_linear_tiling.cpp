#include "quant_linear_tiling.h"

#include <algorithm>

#include "ascendc/error.h"
#include "kernels/common/tiling_utils.h"
#include "ascendc/simd.h"
#include "kernels/linear/linear_tiling_steps.h"
#include "quant_simd.h"

namespace atb {

using AscendC::AlignUp;
using AscendC::CeilDiv;

namespace {

// UB of one STREAM tile:
//   x          fp32 [mTile, kTile]     (zero-padded past K)
//   xsum       fp32 [mTile, kTile/32]  (x summed per 32-value chunk: the W4 min term)
//   x bf16     bf16 [mTile, kTile]     (bf16 x only: the AVX512-BF16 W4 route reads x as it came)
//   x int16    int16 [mTile, kTile rounded up to kQuantXInt16Align] and its fp32 scales [mTile, kTile/32] (fp16/bf16 x: the
//              gemv_*_i16 routes), in gemv_w8_i16's order or gemv_w4_i16's interleave; twice when both run
//   scale, min fp32 [nTile, kTile/32 x groupsPerChunk]  per stream (this tile's group scales, widened)
//   sums       fp32 [mTile, nTile]     per stream
//   and the NPU's output (and residual) staging, LinearIoUb
//   lanes      (a segment on the dequantized-lanes route) one panel of dequantized W rows fp32
//              [QuantLanesPanelRows, kTile] and per stream the lanes fp32 [mTile, nTile, 8]
//   xsum and the bf16/int16 x only when some segment takes the GEMV
int64_t StreamUb(int64_t mt, int64_t nt, int64_t kt, int64_t elt, LinearEpilogue ep, bool bf16, bool lanes,
                 int64_t gemvFormats, int64_t groupsPerChunk) {
  int64_t streams = ep == LINEAR_SWIGLU ? 2 : 1, chunks = kt / kQuantChunk;
  int64_t ub = UbSlot(mt * kt * 4) + streams * (2 * UbSlot(nt * chunks * groupsPerChunk * 4) + UbSlot(mt * nt * 4)) +
               LinearIoUb(mt, nt, elt, ep);
  if (lanes) {
    int64_t panel = QuantLanesPanelRows(kt);
    ub += UbSlot(std::max(panel * kt, mt * panel) * 4) + streams * UbSlot(mt * nt * 8 * 4);
  }
  if (gemvFormats == 0) return ub;
  ub += UbSlot(mt * chunks * 4);
  if (bf16) ub += UbSlot(mt * kt * 2);
  if (elt == 2) ub += gemvFormats * UbSlot(mt * AlignUp(kt, kQuantXInt16Align) * 2) + UbSlot(mt * chunks * 4);
  return ub;
}

// UB of one GEMM work unit:
//   packed W   fp32 [kTile, nTile]  per stream (the dequantized B operand)
//   C          fp32 [mPass, nTile]  per stream (accumulators across K chunks)
//   rows       fp32 [kQuantPackRows, kTile]  (weight rows dequantized before their transposed store)
//   scale, min fp32 [kTile/32 x groupsPerChunk]  (that row's group scales)
//   and the NPU's output (and residual) staging, LinearIoUb (x is the A operand as fp32 in GM: PackedX)
// kDpPacked instead: packed W bf16 pairs [AlignUp(nTile, 16), kTile] per stream (dequantized) in place of the
// fp32 B operand and the rows
int64_t GemmUb(int64_t mPass, int64_t mt, int64_t nt, int64_t kt, int64_t elt, LinearEpilogue ep, bool dp,
               int64_t groupsPerChunk) {
  int64_t streams = ep == LINEAR_SWIGLU ? 2 : 1;
  int64_t packed = dp ? UbSlot(AlignUp(nt, 16) * kt * 2) : UbSlot(kt * nt * 4);
  int64_t groups = kt / kQuantChunk * groupsPerChunk;
  int64_t rows = dp ? 0 : UbSlot(kQuantPackRows * kt * 4);
  // scale, min: one row's (dp: the tile's, [nTile, kTile/32]).
  return streams * (packed + UbSlot(mPass * nt * 4)) + rows + 2 * UbSlot((dp ? nt : 1) * groups * 4) +
         LinearIoUb(mt, nt, elt, ep);
}

// kDpPacked: 64 weight rows per tile, mmad_dp_bf16_packed's group of 4 panels.
constexpr int64_t kQuantDpNTile = 64;
// bf16 x on a vdpbf16ps table: the dp GEMM from this many rows on (a launch with any W8 segment takes
// W8's). It unpacks and packs every weight tile it reads, which the W4 stream GEMV's unpacking costs as much as
// from 6 rows on, and W8's int16 stream GEMV (cheaper per value) not before 16. Zen 4, 2 threads, 5632 x 2048
// from DRAM, us, stream against dp, two runs: W4 G32 M = 6 2457 / 2365 against 1787 / 1955, M = 12 4879 / 4617
// against 2192 / 2187; W8 M = 8 1436 / 1520 against 2643 / 1933, M = 12 2658 / 2283 against 2746 / 2202.
// SmolLM2 engine decode, tok/s: W4 G32 batch 8 265-272 -> 304-316, batch 12 280-301 -> 337-403; W8 at batch
// 12 from 12 rows measured 282 / 343 against 425 / 339, so W8 keeps 16.
constexpr int64_t kQuantDpMinRowsW4 = 6;
constexpr int64_t kQuantDpMinRowsW8 = 16;
// On the AMX tables the dp GEMM (weights dequantized to bf16, then tiles) takes W8 from 8 rows. AMX Xeon,
// 2 threads, bf16 x, us, int16 stream GEMV against dp: M = 6 1536x576 78 / 76, 5632x2048 727 / 972; M = 8
// 94 / 74, 1014 / 991; M = 12 139 / 79, 1505 / 994; M = 16 179 / 75, the 49152x576 LM head 5509 / 2599.
constexpr int64_t kQuantDpMinRowsW8Amx = 8;

// K chunks below all of kPad are multiples of the largest group (128), so no group straddles two chunks.
constexpr KHalving kQuantKHalving{128, 128};

}  // namespace

QuantLinearTilingData QuantLinearTiling(int64_t m, int64_t k, const QuantSegment* segs, int64_t numSegments,
                                        LinearEpilogue ep, AscendC::DataType dtype, const AscendC::SocInfo& soc) {
  int64_t rows[kLinearMaxSegments] = {0, 0, 0};
  for (int64_t s = 0; s < numSegments && s < kLinearMaxSegments; ++s) rows[s] = segs[s].n;
  QuantLinearTilingData q;
  LinearTilingData& t = q.base;
  t = LinearShapeTiling("quant_linear", m, k, rows, numSegments, ep, dtype, soc);
  for (int64_t s = 0; s < numSegments; ++s) {
    const QuantSegment& g = segs[s];
    ATB_CHECK(g.bits == 4 || g.bits == 8, "quant_linear tiling: segment ", s, " has ", g.bits,
              " bits, expected 4 or 8");
    ATB_CHECK(g.group == 0 || g.group == 32 || g.group == 64 || g.group == 128 ||
                  (g.group == kQuantHalfChunkGroup && g.bits == 8),
              "quant_linear tiling: segment ", s, " has group ", g.group, ", expected 0 (per channel), 32, 64 or 128",
              g.bits == 8 ? " (or 16 for 8 bits)" : "");
    ATB_CHECK(g.bits == 8 || g.group != 0, "quant_linear tiling: 4-bit segment ", s, " needs a group size");
  }
  q.kPad = AlignUp(k, kQuantChunk);
  int64_t elt = AscendC::DataTypeSize(dtype);
  bool bf16 = dtype == AscendC::DataType::BFLOAT16;
  bool lanesTable = QuantSimd().gemv_w4_i16 != nullptr;  // the AVX2 table (see QuantLanesMinRows)
  // Groups of 16 (W8) double the scale entries per chunk.
  const bool halfChunkGroups = std::any_of(segs, segs + numSegments,
                                           [](const QuantSegment& g) { return g.group == kQuantHalfChunkGroup; });
  const int64_t groupsPerChunk = halfChunkGroups ? 2 : 1;
  // bf16 x on a table with vdpbf16ps: the k-pair-packed dp GEMM (the running CPU's, whatever SoC is modelled),
  // from kQuantDpMinRowsW4 / W8 rows on (see there).
  bool dp = bf16 && AscendC::Simd().pack_q4_pairs_dequant != nullptr;
  const bool amx = AscendC::Simd().amx_tiles;
  int64_t dpMin = kQuantDpMinRowsW4;
  for (int64_t s = 0; s < numSegments; ++s)
    if (segs[s].bits == 8) dpMin = amx ? kQuantDpMinRowsW8Amx : kQuantDpMinRowsW8;
  if (m >= kLinearGemmMinRows || (dp && m >= dpMin)) {
    GemmPackedTile(t, q.kPad);
    if (dp) {
      t.form = kDpPacked;
      t.nTile = std::min(kQuantDpNTile, MinSegmentRows(t));
      t.kTile = q.kPad;
    }
    GemmShrinkAndSplit(t, kQuantKHalving, ep, "quant_linear", soc, [&](const LinearTilingData& c) {
      return GemmUb(c.mPass, c.mTile, c.nTile, c.kTile, elt, ep, dp, groupsPerChunk);
    });
    q.kChunks = t.kTile / kQuantChunk;
    q.kGroups = q.kChunks * groupsPerChunk;
    t.tilingKey = LINEAR_GEMM * 100 + int64_t(dtype) * 10 + ep;
    return q;
  }
  // A quantized row costs its unpacking, which scales with its values, not its bytes: count a core's
  // work in bf16 bytes (2 per value), so a layer splits over the cores as its bf16 form would.
  int64_t work = 0;
  for (int64_t s = 0; s < numSegments; ++s) work += segs[s].n * q.kPad * 2;
  StreamRowSplit(t, work, q.kPad, soc);
  // The W4 micro-kernel keeps the group sums of up to 4 x rows on its stack.
  while (std::min<int64_t>(t.mTile, 4) * (t.kTile / kQuantChunk) > kQuantMaxGroupSums)
    t.kTile = kQuantKHalving.Halve(t.kTile);
  for (int64_t s = 0; s < numSegments; ++s) {
    q.lanes[s] = lanesTable && m >= QuantLanesMinRows(segs[s].bits, elt);
    (segs[s].bits == 4 ? q.gemvW4 : q.gemvW8) |= !q.lanes[s];
  }
  StreamShrink(t, kQuantKHalving, "quant_linear", soc, [&](const LinearTilingData& c) {
    return StreamUb(c.mTile, c.nTile, c.kTile, elt, ep, bf16, q.AnyLanes(), int64_t(q.gemvW4) + q.gemvW8,
                    groupsPerChunk);
  });
  q.kChunks = t.kTile / kQuantChunk;
  q.kGroups = q.kChunks * groupsPerChunk;
  t.tilingKey = LINEAR_STREAM * 100 + int64_t(dtype) * 10 + ep;
  return q;
}

}  // namespace atb
