#include "quant_linear_tiling.h"

#include <algorithm>

#include "ascendc/error.h"
#include "kernels/common/tiling_utils.h"
#include "quant_simd.h"

namespace atb {

using AscendC::AlignUp;
using AscendC::CeilDiv;

namespace {

// K chunks below all of kPad are multiples of the largest group (128), so no group straddles two chunks.
constexpr int64_t kQuantKAlign = 128;

// UB of one STREAM tile:
//   x          fp32 [mTile, kTile]     (zero-padded past K)
//   xsum       fp32 [mTile, kTile/32]  (x summed per 32-value chunk: the W4 min term)
//   x bf16     bf16 [mTile, kTile]     (bf16 x only: the AVX512-BF16 W4 route reads x as it came)
//   scale, min fp32 [nTile, kTile/32]  per stream (this tile's group scales, widened)
//   sums       fp32 [mTile, nTile]     per stream
//   out queue  BUFFER_NUM x T [mTile, nTile]; residual queue the same (RESIDUAL)
int64_t StreamUb(int64_t mt, int64_t nt, int64_t kt, int64_t elt, LinearEpilogue ep, bool bf16) {
  int64_t streams = ep == LINEAR_SWIGLU ? 2 : 1, chunks = kt / kQuantChunk;
  int64_t ub = UbSlot(mt * kt * 4) + UbSlot(mt * chunks * 4) +
               streams * (2 * UbSlot(nt * chunks * 4) + UbSlot(mt * nt * 4)) + AscendC::BUFFER_NUM * UbSlot(mt * nt * elt);
  if (ep == LINEAR_RESIDUAL) ub += AscendC::BUFFER_NUM * UbSlot(mt * nt * elt);
  if (bf16) ub += UbSlot(mt * kt * 2);
  return ub;
}

// UB of one GEMM work unit:
//   packed W   fp32 [kTile, nTile]  per stream (the dequantized B operand)
//   C          fp32 [mPass, nTile]  per stream (accumulators across K chunks)
//   row        fp32 [kTile]         (one weight row dequantized before its transposed store)
//   scale, min fp32 [kTile/32]      (that row's group scales)
//   x          fp32 [mTile, kTile]  (fp16/bf16 only: fp32 x is read in place)
//   out queue  BUFFER_NUM x T [mTile, nTile]; residual queue the same (RESIDUAL)
int64_t GemmUb(int64_t mPass, int64_t mt, int64_t nt, int64_t kt, int64_t elt, LinearEpilogue ep) {
  int64_t streams = ep == LINEAR_SWIGLU ? 2 : 1;
  int64_t ub = streams * (UbSlot(kt * nt * 4) + UbSlot(mPass * nt * 4)) + UbSlot(kt * 4) +
               2 * UbSlot(kt / kQuantChunk * 4) + AscendC::BUFFER_NUM * UbSlot(mt * nt * elt);
  if (elt != 4) ub += UbSlot(mt * kt * 4);
  if (ep == LINEAR_RESIDUAL) ub += AscendC::BUFFER_NUM * UbSlot(mt * nt * elt);
  return ub;
}

int64_t HalveK(int64_t kt) { return std::max(kQuantKAlign, AlignUp(CeilDiv(kt, 2), kQuantKAlign)); }

constexpr int64_t kGemmMTile = 48;  // rows of x per cube pass: a multiple of the micro-kernel's 6 rows

void GemmTiling(LinearTilingData& t, int64_t kPad, int64_t elt, LinearEpilogue ep, const AscendC::SocInfo& soc) {
  int64_t minRows = t.segRows[0];
  for (int64_t s = 1; s < t.numSegments; ++s) minRows = std::min(minRows, t.segRows[s]);
  t.nTile = minRows >= 32 ? 32 : AlignUp(minRows, 8);
  t.kTile = kPad <= 256 ? kPad : 256;
  t.mTile = std::min(t.m, kGemmMTile);
  // A dequantized tile is reused by mPass rows: the more, the cheaper its dequantization.
  t.mPass = std::min<int64_t>(AlignUp(t.m, t.mTile), 8 * kGemmMTile);
  while (GemmUb(t.mPass, t.mTile, t.nTile, t.kTile, elt, ep) > soc.ub_size) {
    if (t.mPass > 2 * t.mTile) {
      t.mPass = AlignUp(t.mPass / 2, t.mTile);
    } else if (t.kTile > kQuantKAlign) {
      t.kTile = HalveK(t.kTile);
    } else if (t.nTile > 8) {
      t.nTile /= 2;
    } else if (t.mTile > 6) {
      t.mTile = AlignUp(t.mTile / 2, 6);
      t.mPass = t.mTile;
    } else {
      AscendC::ThrowError("quant_linear tiling: UB of ", soc.ub_size, " bytes is too small");
    }
  }
  t.nTiles = 0;
  int64_t segs = ep == LINEAR_SWIGLU ? 1 : t.numSegments;
  for (int64_t s = 0; s < segs; ++s) t.nTiles += CeilDiv(t.segRows[s], t.nTile);
  t.mPasses = CeilDiv(t.m, t.mPass);
  int64_t units = t.nTiles * t.mPasses;
  int64_t cores = std::max<int64_t>(1, std::min(soc.cube_core_num, units));
  t.blockFactor = CeilDiv(units, cores);
  t.blockDim = CeilDiv(units, t.blockFactor);
  t.ubBytes = GemmUb(t.mPass, t.mTile, t.nTile, t.kTile, elt, ep);
}

// As the float linear: a host core must stream this much weight to be worth waking.
constexpr int64_t kHostMinBytesPerCore = 256 * 1024;

}  // namespace

QuantLinearTilingData QuantLinearTiling(int64_t m, int64_t k, const QuantSegment* segs, int64_t numSegments,
                                        LinearEpilogue ep, AscendC::DataType dtype, const AscendC::SocInfo& soc) {
  ATB_CHECK(m >= 1 && k >= 1, "quant_linear tiling: M and K must be >= 1, got M=", m, " K=", k);
  ATB_CHECK(numSegments >= 1 && numSegments <= kLinearMaxSegments, "quant_linear tiling: 1..", kLinearMaxSegments,
            " weight segments, got ", numSegments);
  ATB_CHECK(ep != LINEAR_SWIGLU || (numSegments == 2 && segs[0].n == segs[1].n),
            "quant_linear tiling: swiglu needs two segments (gate, up) of equal N");
  ATB_CHECK(ep != LINEAR_RESIDUAL || numSegments == 1, "quant_linear tiling: the residual epilogue takes one segment");
  ATB_CHECK(dtype != AscendC::DataType::BFLOAT16 || soc.supports_bf16, "quant_linear: bfloat16 is not supported on ",
            soc.name, " (no bf16 cube unit); use float16 or float32");
  QuantLinearTilingData q;
  LinearTilingData& t = q.base;
  q.kPad = AlignUp(k, kQuantChunk);
  t.m = m;
  t.k = k;
  t.numSegments = numSegments;
  for (int64_t s = 0; s < numSegments; ++s) {
    const QuantSegment& g = segs[s];
    ATB_CHECK(g.n >= 1, "quant_linear tiling: segment ", s, " has N=", g.n, ", must be >= 1");
    ATB_CHECK(g.bits == 4 || g.bits == 8, "quant_linear tiling: segment ", s, " has ", g.bits, " bits, expected 4 or 8");
    ATB_CHECK(g.group == 0 || g.group == 32 || g.group == 64 || g.group == 128, "quant_linear tiling: segment ", s,
              " has group ", g.group, ", expected 0 (per channel), 32, 64 or 128");
    ATB_CHECK(g.bits == 8 || g.group != 0, "quant_linear tiling: 4-bit segment ", s, " needs a group size");
    t.segRows[s] = g.n;
    t.rows += g.n;
  }
  if (ep == LINEAR_SWIGLU) t.rows = segs[0].n;
  int64_t elt = AscendC::DataTypeSize(dtype);
  bool bf16 = dtype == AscendC::DataType::BFLOAT16;
  if (m >= kLinearGemmMinRows) {
    GemmTiling(t, q.kPad, elt, ep, soc);
    q.kChunks = t.kTile / kQuantChunk;
    t.tilingKey = LINEAR_GEMM * 100 + int64_t(dtype) * 10 + ep;
    return q;
  }
  int64_t cores = std::max<int64_t>(1, soc.cube_core_num);
  // A quantized row costs its unpacking, which scales with its values, not its bytes: count a core's
  // work in bf16 bytes (2 per value), so a layer splits over the cores as its bf16 form would.
  int64_t work = 0;
  for (int64_t s = 0; s < numSegments; ++s) work += segs[s].n * q.kPad * 2;
  if (soc.is_host) cores = std::min(cores, std::max<int64_t>(1, work / kHostMinBytesPerCore));
  // Rows per core in blocks of 4 (the widest micro-kernel row block), every core gets rows.
  t.blockFactor = AlignUp(CeilDiv(t.rows, std::min(cores, t.rows)), 4);
  t.blockDim = CeilDiv(t.rows, t.blockFactor);
  // Decode: all M rows in one pass and all of K in UB; shrink K first (x is re-widened per
  // chunk, cheap), then the row tile, then M (each extra M pass re-streams the weights).
  t.mTile = std::min<int64_t>(m, 32);
  t.nTile = std::min<int64_t>(t.blockFactor, 64);
  t.kTile = q.kPad;
  // The W4 micro-kernel keeps the group sums of up to 4 x rows on its stack.
  while (std::min<int64_t>(t.mTile, 4) * (t.kTile / kQuantChunk) > kQuantMaxGroupSums) t.kTile = HalveK(t.kTile);
  while (StreamUb(t.mTile, t.nTile, t.kTile, elt, ep, bf16) > soc.ub_size) {
    if (t.kTile > 4 * kQuantKAlign) {
      t.kTile = HalveK(t.kTile);
    } else if (t.nTile > 8) {
      t.nTile = AlignUp(t.nTile / 2, 4);
    } else if (t.mTile > 1) {
      t.mTile = CeilDiv(t.mTile, 2);
    } else if (t.kTile > kQuantKAlign) {
      t.kTile = HalveK(t.kTile);
    } else {
      AscendC::ThrowError("quant_linear tiling: UB of ", soc.ub_size, " bytes is too small");
    }
  }
  q.kChunks = t.kTile / kQuantChunk;
  t.ubBytes = StreamUb(t.mTile, t.nTile, t.kTile, elt, ep, bf16);
  t.tilingKey = LINEAR_STREAM * 100 + int64_t(dtype) * 10 + ep;
  return q;
}

}  // namespace atb
