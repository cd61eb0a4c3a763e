#include "linear_tiling.h"

#include <algorithm>

#include "ascendc/error.h"
#include "ascendc/simd.h"
#include "kernels/common/tiling_utils.h"
#include "linear_rows4.h"
#include "linear_tiling_steps.h"

namespace atb {

using AscendC::AlignUp;
using AscendC::CeilDiv;

namespace {

// UB of one tile:
//   x          fp32 [mTile, kTile]            (widened once per pass)
//   lanes      fp32 [mTile, nTile, 8] per stream (SWIGLU: gate and up)
//   sums       fp32 [mTile, nTile]    per stream
//   and the NPU's output (and residual) staging, LinearIoUb
int64_t TileUb(int64_t mt, int64_t nt, int64_t kt, int64_t elt, LinearEpilogue ep) {
  int64_t streams = ep == LINEAR_SWIGLU ? 2 : 1;
  return UbSlot(mt * kt * 4) + streams * (UbSlot(mt * nt * 32) + UbSlot(mt * nt * 4)) + LinearIoUb(mt, nt, elt, ep);
}

// A host core must stream at least this much weight to be worth waking: a
// hand-off costs ~2-5 us, 256 KiB of weight is ~10 us at one core's bandwidth.
constexpr int64_t kHostMinBytesPerCore = 256 * 1024;

// UB of one GEMM work unit:
//   packed W   fp32 [kTile, nTile]  per stream        (the cube's B operand)
//   C          fp32 [mPass, nTile]  per stream        (the accumulator, kept across K chunks)
//   and the NPU's output (and residual) staging, LinearIoUb (x is the A operand as fp32 in GM: PackedX)
// The dot-product and packed-x forms have no packed W (kDpPacked: one packed in k pairs, bf16).
int64_t GemmUb(int64_t mPass, int64_t mt, int64_t nt, int64_t kt, int64_t elt, LinearEpilogue ep, int64_t form) {
  int64_t streams = ep == LINEAR_SWIGLU ? 2 : 1;
  int64_t b = form == kDpPacked ? UbSlot(AlignUp(nt, 16) * AlignUp(kt, 2) * 2) : form != kF32Tiles ? 0 : UbSlot(kt * nt * 4);
  return streams * (b + UbSlot(mPass * nt * 4)) + LinearIoUb(mt, nt, elt, ep);
}

// dp: weight rows per tile, a multiple of the micro-kernel's 3-row panel (its 16-row blocks of 48 keep the
// tile's weights, 48 x K, in L2 while x's rows pass over them).
constexpr int64_t kGemmDpNTile = 48;
// k-pair-packed dp: 64 weight rows, the micro-kernel's 4 panels of 16.
constexpr int64_t kGemmDpPackedNTile = 64;

void GemmTiling(LinearTilingData& t, int64_t elt, LinearEpilogue ep, const AscendC::SocInfo& soc, int64_t form) {
  t.form = form;
  if (form == kDpPacked) {
    t.nTile = std::min(kGemmDpPackedNTile, MinSegmentRows(t));
    t.kTile = t.k;
  } else if (form != kF32Tiles) {
    t.nTile = std::min(kGemmDpNTile, MinSegmentRows(t));
    t.kTile = t.k;
  } else {
    GemmPackedTile(t, t.k);
  }
  // Packed K chunks halve to multiples of 8, k-pair-packed ones to multiples of 32; dp never splits K.
  KHalving halving = form == kDpPacked ? KHalving{256, 32} : form != kF32Tiles ? kKeepKWhole : KHalving{64, 8};
  GemmShrinkAndSplit(t, halving, ep, "linear", soc, [&](const LinearTilingData& c) {
    return GemmUb(c.mPass, c.mTile, c.nTile, c.kTile, elt, ep, form);
  });
}

}  // namespace

LinearTilingData LinearShapeTiling(const char* op, int64_t m, int64_t k, const int64_t* segRows, int64_t numSegments,
                                   LinearEpilogue ep, AscendC::DataType dtype, const AscendC::SocInfo& soc) {
  ATB_CHECK(m >= 1 && k >= 1, op, " tiling: M and K must be >= 1, got M=", m, " K=", k);
  ATB_CHECK(numSegments >= 1 && numSegments <= kLinearMaxSegments, op, " tiling: 1..", kLinearMaxSegments,
            " weight segments, got ", numSegments);
  ATB_CHECK(ep != LINEAR_SWIGLU || (numSegments == 2 && segRows[0] == segRows[1]), op,
            " tiling: swiglu needs two segments (gate, up) of equal N");
  ATB_CHECK(ep != LINEAR_RESIDUAL || numSegments == 1, op, " tiling: the residual epilogue takes one segment");
  CheckDtypeOnSoc(op, dtype, soc, "cube");
  LinearTilingData t;
  t.m = m;
  t.k = k;
  t.numSegments = numSegments;
  for (int64_t s = 0; s < numSegments; ++s) {
    ATB_CHECK(segRows[s] >= 1, op, " tiling: segment ", s, " has N=", segRows[s], ", must be >= 1");
    t.segRows[s] = segRows[s];
    t.rows += segRows[s];
  }
  if (ep == LINEAR_SWIGLU) t.rows = segRows[0];
  return t;
}

void StreamRowSplit(LinearTilingData& t, int64_t weightBytes, int64_t kCols, const AscendC::SocInfo& soc) {
  // A matmul runs on the cube cores; the host uses as many threads as the weight bytes pay for.
  int64_t cores = std::max<int64_t>(1, soc.cube_core_num);
  if (soc.is_host) cores = std::min(cores, std::max<int64_t>(1, weightBytes / kHostMinBytesPerCore));
  // Re-derive blockDim so every core gets rows.
  t.blockFactor = AlignUp(CeilDiv(t.rows, std::min(cores, t.rows)), 4);
  t.blockDim = CeilDiv(t.rows, t.blockFactor);
  t.mTile = std::min<int64_t>(t.m, 32);
  t.nTile = std::min<int64_t>(t.blockFactor, 64);
  t.kTile = kCols;
}

int64_t MinSegmentRows(const LinearTilingData& t) {
  int64_t minRows = t.segRows[0];
  for (int64_t s = 1; s < t.numSegments; ++s) minRows = std::min(minRows, t.segRows[s]);
  return minRows;
}

void GemmPackedTile(LinearTilingData& t, int64_t kCols) {
  int64_t minRows = MinSegmentRows(t);
  t.nTile = minRows >= 64 ? 64 : minRows >= 32 ? 32 : AlignUp(minRows, 8);
  t.kTile = std::min<int64_t>(kCols, 256);
}

namespace {

// The units' split at row tile nTile: units (tile, M pass) in order, blockFactor consecutive units per core.
// Returns the busiest core's work in weight rows x x rows.
int64_t SplitUnits(LinearTilingData& t, int64_t nTile, int64_t segs, const AscendC::SocInfo& soc) {
  t.nTile = nTile;
  t.nTiles = 0;
  for (int64_t s = 0; s < segs; ++s) t.nTiles += CeilDiv(t.segRows[s], t.nTile);
  t.mPasses = CeilDiv(t.m, t.mPass);
  int64_t units = t.nTiles * t.mPasses;
  int64_t cores = std::max<int64_t>(1, std::min(soc.cube_core_num, units));
  t.blockFactor = CeilDiv(units, cores);
  t.blockDim = CeilDiv(units, t.blockFactor);
  int64_t busiest = 0, work = 0, u = 0;
  for (int64_t s = 0; s < segs; ++s)
    for (int64_t row = 0; row < t.segRows[s]; row += nTile)
      for (int64_t p = 0; p < t.mPasses; ++p, ++u) {
        if (u % t.blockFactor == 0) work = 0;
        work += std::min(nTile, t.segRows[s] - row) * std::min(t.mPass, t.m - p * t.mPass);
        busiest = std::max(busiest, work);
      }
  return busiest;
}

}  // namespace

void GemmUnitSplit(LinearTilingData& t, LinearEpilogue ep, const AscendC::SocInfo& soc) {
  const int64_t segs = ep == LINEAR_SWIGLU ? 1 : t.numSegments;
  // A 64-row tile that leaves the cores uneven gives way to 32 rows when that cuts the busiest core's work by
  // more than 5%: SmolLM2's 576 rows are 9 tiles of 64 (5 on one of 2 cores, 4 on the other), 18 of 32. The
  // packing per weight is the same at any row tile and the bits do not depend on it (one fma chain per
  // element over k in order); a 32-row tile's fp32 B operand (32 KiB at kTile 256) also stays in L1. Zen 3,
  // 2 threads, bf16, in-process interleaved medians, 32 against 64 rows: M = 128 576x576 0.91, 576x1536 0.93,
  // the fused 960x576 q/k/v 0.94; M = 512 0.95-1.04; 48 rows measured 0.99-1.10 and is not used. Where 64
  // rows already split evenly (M = 2048: 576x1536 1.07 at 32 rows) they stay. The packed fp32 tiling only:
  // the dp micro-kernels have their own panel multiples.
  const int64_t busiest = SplitUnits(t, t.nTile, segs, soc);
  if (t.form != kF32Tiles || t.nTile != 64) return;
  LinearTilingData halved = t;
  if (SplitUnits(halved, 32, segs, soc) * 20 < busiest * 19) t = halved;
}

LinearTilingData LinearTiling(int64_t m, int64_t k, const int64_t* segRows, int64_t numSegments, LinearEpilogue ep,
                              AscendC::DataType dtype, const AscendC::SocInfo& soc, bool rowInvariant,
                              bool rows4Copies) {
  LinearTilingData t = LinearShapeTiling("linear", m, k, segRows, numSegments, ep, dtype, soc);
  int64_t elt = AscendC::DataTypeSize(dtype);
  // The dot-product micro-kernel is the running CPU's (the SIMD table in use), whatever SoC is modelled.
  bool dp = dtype == AscendC::DataType::BFLOAT16 && AscendC::Simd().mmad_nt_dp_bf16 != nullptr;
  int64_t form = !dp ? kF32Tiles : (rowInvariant || m >= kLinearDpPackedMinRows) ? kDpPacked : kDpRows;
  const auto& simd = AscendC::Simd();
  // Rows that alias in L1 do not where the packed-x form reads their rows4 copy instead (4 runs, not 16 rows).
  const bool readsCopy = rows4Copies && Rows4PackedX(dtype, k);
  const bool aliasing = (k * elt) % kPackedXAliasBytes == 0 && !readsCopy;
  if (form == kDpRows && simd.mmad_dp_bf16_packed_x &&
      (simd.amx_tiles || (m >= kLinearDpPackedXMinRows && !aliasing)))
    form = kPackedX;
  // fp32 on x packed k-major: its elements are the packed GEMM kernel's MmadTN chains (the same bits), so the
  // form serves row-invariant calls (engine prefill) as well.
  const bool f32PackedX = dtype == AscendC::DataType::FLOAT32 && simd.mmad_packed_x_f32 && !aliasing &&
                          m >= kLinearPackedXMinRows && m < kLinearPackedXF32MaxRows;
  if (f32PackedX) form = kPackedX;
  if (rowInvariant || m >= kLinearGemmMinRows || (dp && m >= kLinearDpMinRows) || f32PackedX) {
    GemmTiling(t, elt, ep, soc, form);
    t.tilingKey = LINEAR_GEMM * 100 + int64_t(dtype) * 10 + ep;
    return t;
  }
  // Decode: all M rows in one pass, all of K in UB, 64 weight rows per tile (up to kLinearRunsTileRows for
  // a few rows, below); K chunks halve to multiples of 64.
  StreamRowSplit(t, t.rows * k * elt * (ep == LINEAR_SWIGLU ? 2 : 1), k, soc);
  // Up to kLinearRunsMaxRows rows of x, the lanes micro-kernel reads a call's weight rows as 4 runs front to
  // back (simd_avx512.cpp, MmadNTLanes), which the hardware prefetcher follows the longer they are: a core's
  // rows of a segment in one tile where the UB holds them (StreamShrink halves it where it does not).
  if (m <= kLinearRunsMaxRows) t.nTile = std::min(t.blockFactor, kLinearRunsTileRows);
  StreamShrink(t, KHalving{64, 64}, "linear", soc,
               [&](const LinearTilingData& c) { return TileUb(c.mTile, c.nTile, c.kTile, elt, ep); });
  t.tilingKey = LINEAR_STREAM * 100 + int64_t(dtype) * 10 + ep;
  return t;
}

}  // namespace atb
