#pragma once
#include <algorithm>
#include <cstdint>

#include "ascendc/dtype.h"
#include "ascendc/soc.h"
#include "kernels/linear/linear_tiling.h"

namespace atb {

// Weight-only quantized linear (ATB's anti-quant linear: W8A16 / W4A16):
// y = x dequant(W)^T (+ bias), x fp32/fp16/bf16, fp32 accumulation, y in x's
// dtype, with the float linear's fused epilogues (multi-segment q/k/v,
// RESIDUAL, SWIGLU; see linear_tiling.h) and its two kernels:
//   STREAM (M < kLinearGemmMinRows, decode): each core streams its weight rows
//     once for all M rows, dequantizing in registers (quant_simd.h) or, from a
//     few rows on, into L1 once per panel of rows (QuantLanesMinRows);
//   GEMM (prefill): a weight tile is dequantized into UB as the fp32 B operand
//     and reused by up to mPass rows through the cube tile (MmadNN).
//
// A segment's weight, [N, K] logically, is stored as rows of kPad = K rounded
// up to 32 values (padding q = 0; x is zero-padded in UB so padding adds 0):
//   bits 8: int8 q, w = scale[g] * q                       (symmetric)
//   bits 4: 16 bytes per 32 values (quant_simd.h), w = scale[g] * q + min[g],  q in [0, 15]
// with g = k / group over ceil(K / group) groups per row (the last one may be
// short: K = 576 with group 128 has 4.5 groups), group 0 meaning one group of
// the whole row (per output channel). Groups are 32, 64 or 128 values; W8 also
// takes 16 (GGUF's Q6_K), two groups per chunk. scale/min: [N, groups] in scaleType
// (fp32, fp16 or bf16), widened to fp32 in UB per tile.
constexpr int64_t kQuantChunk = 32;  // values per SIMD chunk; kPad and every group but W8's 16 are multiples of it
// A row of int16 x (the gemv_*_i16 routes) is padded to this many values: whole loads of the widest W4 GEMV's
// layouts (quant_simd.h: InterleaveXInt16ForW4).
constexpr int64_t kQuantXInt16Align = 4 * kQuantChunk;
// Weight rows the GEMM kernel dequantizes before one transposed store into its packed B tile (an 8 x 8
// SIMD transpose block).
constexpr int64_t kQuantPackRows = 8;
// The STREAM kernel's two routes for a segment, chosen per segment from (its bits, x's width, M) alone
// so its sums never depend on the other segments of its launch:
//   GEMV     every weight unpacked in registers once per block of x rows (quant_simd.h);
//   DEQUANT LANES  a panel of the tile's rows dequantized to fp32 in L1 once, then the float STREAM's
//            lanes Mmad over every x row (QuantLanesPanelRows).
// On the table with the int16 routes (AVX2), the lanes route from QuantLanesMinRows rows on. With 16-bit x
// the int16 GEMV (4 x rows per block) is ahead of the lanes route for W4 up to 8 rows and for W8 at every M
// the STREAM kernel takes. Zen 3, 2 threads, bf16 x, SmolLM2's 960x576, 3072x576, 576x1536 and 49152x576
// (weights in cache), time against bf16 weights in the same rounds, medians of 7 interleaved rounds:
//   W4 g32  M=3  GEMV 0.90-0.97  lanes 1.48-1.59 | M=4  1.21-1.28 / 1.42-1.61 | M=8  1.22-1.29 / 1.27-1.41
//           M=12 1.19-1.30 / 1.07-1.26 | M=16 1.21-1.33 / 1.04-1.27
//   W8      M=12 GEMV 0.85-1.04  lanes (all rows at 16) 0.89-1.38 | M=16 0.93-1.04 / 1.03-1.29
// SmolLM2 decode graph step, old thresholds (W4 3, W8 16) against these, in-process A/B over 6 rounds: W4A16
// batch 3 0.670, 4 0.791, 8 0.872, 16 0.977; W8A16 batch 4 0.897, 8 0.979, 16 0.864. (Measured earlier the
// other way round, before the int16 GEMV's prefetch and folded scales: W4 M=8 GEMV 379-423 us, lanes 194-216.)
//   fp32 x  M=4  W8 196-204 / 141-171, W4 242-275 / 140-178 (us);  M=2 the GEMV is ahead
// Other tables keep the GEMV (their W4 routes, e.g. AVX512-BF16's vdpbf16ps, were not measured against it).
inline int64_t QuantLanesMinRows(int64_t bits, int64_t xBytes) {
  if (xBytes == 4) return 4;
  return bits == 4 ? 10 : kLinearGemmMinRows;  // W8: never below the GEMM kernel's rows
}
// Weight rows the lanes route dequantizes at a time: a multiple of the lanes Mmad's 3-row blocks whose fp32
// values (kTile each) fit in 24 KiB of L1.
inline int64_t QuantLanesPanelRows(int64_t kTile) { return std::max<int64_t>(3, 24576 / (kTile * 4) / 3 * 3); }

struct QuantSegment {
  const void* data = nullptr;   // [n, kPad] int8 or [n, kPad / 2] packed int4
  const void* scale = nullptr;  // [n, groups]
  const void* min = nullptr;    // [n, groups] (bits 4) or null
  const void* bias = nullptr;   // [n] in x's dtype, or null
  void* out = nullptr;          // [M, n] (SWIGLU's up segment: unused)
  int64_t n = 0;
  int64_t bits = 8;
  int64_t group = 0;            // 0: per output channel
  AscendC::DataType scaleType = AscendC::DataType::FLOAT32;
};

struct QuantLinearTilingData {
  // m, k, rows, segments, blockDim, blockFactor, mTile/nTile/kTile, GEMM fields and the
  // tiling key exactly as the float linear's (kTile counts padded values here).
  LinearTilingData base;
  int64_t kPad = 0;
  int64_t kChunks = 0;    // kTile / 32: xsum entries per x row
  int64_t kGroups = 0;    // scale (and min) entries per weight row of a tile, at most: kChunks, or twice that when
                          // a W8 segment has groups of 16 (kQuantHalfChunkGroup)
  // STREAM: per segment, the dequantized-lanes route (else the GEMV).
  bool lanes[kLinearMaxSegments] = {false, false, false};
  // STREAM: some segment of that many bits takes the GEMV (with 16-bit x on the AVX2 table, the int16 GEMVs,
  // whose x orders differ: a launch with both keeps x twice).
  bool gemvW4 = false, gemvW8 = false;

  bool AnyLanes() const { return std::any_of(lanes, lanes + base.numSegments, [](bool l) { return l; }); }
  bool AnyGemv() const { return gemvW4 || gemvW8; }
};

// Pure host function of (shapes, formats, dtype, epilogue, SoC).
QuantLinearTilingData QuantLinearTiling(int64_t m, int64_t k, const QuantSegment* segs, int64_t numSegments,
                                        LinearEpilogue ep, AscendC::DataType dtype, const AscendC::SocInfo& soc);

// Host entry: tiles (STREAM or GEMM by M) and launches. Pointers are trusted (validated by the caller).
void QuantLinear(const void* x, int64_t m, int64_t k, const QuantSegment* segs, int64_t numSegments,
                 const void* residual, LinearEpilogue ep, AscendC::DataType dtype, const AscendC::SocInfo& soc);
void QuantLinearGemm(const void* x, const QuantSegment* segs, const void* residual, const QuantLinearTilingData& t,
                     const AscendC::SocInfo& soc);

// Rows idx[0..count) of one quantized weight, dequantized into out [count, k] of dtype
// (the embedding lookup; with idx = 0..N-1, the whole dequantization).
void QuantDequantRows(const QuantSegment& w, int64_t k, const int32_t* idx, int64_t count, void* out,
                      AscendC::DataType dtype, const AscendC::SocInfo& soc);

// A weight as a graph holds it: data == nullptr means a float weight (the LinearSegment's own
// pointer); otherwise the quantized storage of QuantSegment.
struct QuantRef {
  const void* data = nullptr;
  const void* scale = nullptr;
  const void* min = nullptr;
  int64_t bits = 0;
  int64_t group = 0;
  AscendC::DataType scaleType = AscendC::DataType::FLOAT32;
};

// The linear entry for weights that may be quantized: segs as for Linear, quant[s] the storage of
// segment s (null or data == nullptr: float). All float -> Linear; all quantized -> QuantLinear;
// a PLAIN launch mixing both runs each segment on its own (SWIGLU/RESIDUAL must not mix).
void LinearOrQuant(const void* x, int64_t m, int64_t k, const LinearSegment* segs, const QuantRef* const* quant,
                   int64_t numSegments, const void* residual, LinearEpilogue ep, AscendC::DataType dtype,
                   const AscendC::SocInfo& soc);

}  // namespace atb
