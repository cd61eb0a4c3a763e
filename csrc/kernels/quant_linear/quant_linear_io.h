// What the quantized STREAM and GEMM kernels add to the float linear's LinearIo:
// the quantized segments, their group scales widened to fp32 in UB, and the launch.
#pragma once
#include <algorithm>
#include <cstdint>

#include "ascendc/block_prefetch.h"
#include "ascendc/kernel_operator.h"
#include "kernels/linear/linear_io.h"
#include "quant_linear_tiling.h"
#include "quant_simd.h"

namespace atb {

inline float ScaleAt(const void* p, AscendC::DataType type, int64_t i) {
  switch (type) {
    case AscendC::DataType::FLOAT16: return AscendC::ToFloat(static_cast<const AscendC::half*>(p)[i]);
    case AscendC::DataType::BFLOAT16: return AscendC::ToFloat(static_cast<const AscendC::bfloat16_t*>(p)[i]);
    default: return static_cast<const float*>(p)[i];
  }
}

// n scales from element i of p, widened to fp32 by the vector unit (at group 32 a scalar
// fp16 conversion per scale and min cost more than the GEMV's FMAs).
inline void WidenScales(float* dst, const void* p, AscendC::DataType type, int64_t i, int64_t n) {
  switch (type) {
    case AscendC::DataType::FLOAT16:
      return AscendC::CastRaw<float, AscendC::half>(dst, static_cast<const AscendC::half*>(p) + i, n);
    case AscendC::DataType::BFLOAT16:
      return AscendC::CastRaw<float, AscendC::bfloat16_t>(dst, static_cast<const AscendC::bfloat16_t*>(p) + i, n);
    default: std::copy_n(static_cast<const float*>(p) + i, n, dst);
  }
}

// Group scales (and mins) of weight rows [row, row + nt) for the K chunk [k0, k0 + kl) of segment q, as
// the micro-kernels take them: fp32 rows of stride lds. fp32 scales are used where they lie in GM
// (copying them would stream their bytes twice); fp16/bf16 ones are widened into the UB buffers
// scaleUb/minUb ([nt, ldUb]). group: the segment's group, or kl for a per-channel segment (one group
// per chunk, holding the row's scale).
struct TileScales {
  const float* scale;
  const float* min;
  int64_t lds;
  int64_t group;
};

// Rows [row, row + nb) of segment q over the K chunk [k0, k0 + kl): their weight runs and, for a grouped
// segment, their scales' (and mins') runs, requested together. A prefill GEMM calls it before unpacking a row
// block: a W4 row's 256-value chunk is two cache lines, and unpacking one row filled the out-of-order window
// before the next row's loads issued, so the block waited on memory a row at a time (a W4 G32 5632x2048 GEMM
// at M = 128 on Zen 3: 12% of its samples in the unpacking, 3% with this).
ATB_PREFETCH_INLINE void PrefetchRowBlock(const QuantSegment& q, int64_t kPad, int64_t row, int64_t nb, int64_t k0, int64_t kl) {
  const int64_t rowBytes = kPad * q.bits / 8;
  AscendC::PrefetchRowRuns(static_cast<const char*>(q.data) + row * rowBytes + k0 * q.bits / 8, rowBytes, nb,
                           kl * q.bits / 8);
  if (q.group == 0) return;  // per channel: one scale per row, read with the tile's
  const int64_t size = AscendC::DataTypeSize(q.scaleType), perRow = AscendC::CeilDiv(kPad, q.group) * size;
  const int64_t at = row * perRow + k0 / q.group * size, bytes = AscendC::CeilDiv(kl, q.group) * size;
  AscendC::PrefetchRowRuns(static_cast<const char*>(q.scale) + at, perRow, nb, bytes);
  if (q.min) AscendC::PrefetchRowRuns(static_cast<const char*>(q.min) + at, perRow, nb, bytes);
}

inline TileScales LoadScales(const QuantSegment& q, int64_t kPad, int64_t row, int64_t nt, int64_t k0, int64_t kl,
                             float* scaleUb, float* minUb, int64_t ldUb) {
  bool f32 = q.scaleType == AscendC::DataType::FLOAT32;
  if (q.group == 0) {
    if (f32) return {static_cast<const float*>(q.scale) + row, nullptr, 1, kl};
    for (int64_t n = 0; n < nt; ++n) scaleUb[n * ldUb] = ScaleAt(q.scale, q.scaleType, row + n);
    return {scaleUb, nullptr, ldUb, kl};
  }
  int64_t perRow = AscendC::CeilDiv(kPad, q.group), g0 = k0 / q.group, ng = AscendC::CeilDiv(kl, q.group);
  if (f32) {
    int64_t off = row * perRow + g0;
    const float* mn = q.bits == 4 ? static_cast<const float*>(q.min) + off : nullptr;
    return {static_cast<const float*>(q.scale) + off, mn, perRow, q.group};
  }
  if (ng == perRow) {
    // The chunk spans whole rows (decode keeps all of K in one chunk): the tile's scales are one
    // contiguous run, widened in one call (per-row calls of ~18 values cost more than the conversion).
    WidenScales(scaleUb, q.scale, q.scaleType, row * perRow, nt * perRow);
    if (q.bits == 4) WidenScales(minUb, q.min, q.scaleType, row * perRow, nt * perRow);
    return {scaleUb, minUb, perRow, q.group};
  }
  for (int64_t n = 0; n < nt; ++n) {
    int64_t i = (row + n) * perRow + g0;
    WidenScales(scaleUb + n * ldUb, q.scale, q.scaleType, i, ng);
    if (q.bits == 4) WidenScales(minUb + n * ldUb, q.min, q.scaleType, i, ng);
  }
  return {scaleUb, minUb, ldUb, q.group};
}

// The int16 GEMV routes' scales (QuantScaleRows): grouped fp16/bf16 scales over whole rows as they lie
// in GM, for the GEMV to widen a row block ahead into scaleUb/minUb ([nt, perRow] fp32 each); any other
// case as LoadScales gives them (fp32 rows).
inline QuantScaleRows StoredScales(const QuantSegment& q, int64_t kPad, int64_t row, int64_t nt, int64_t k0,
                                   int64_t kl, float* scaleUb, float* minUb, int64_t ldUb) {
  if (q.group != 0 && q.scaleType != AscendC::DataType::FLOAT32 && kl == kPad) {
    const int64_t perRow = AscendC::CeilDiv(kPad, q.group), size = AscendC::DataTypeSize(q.scaleType);
    const char* mn = q.bits == 4 ? static_cast<const char*>(q.min) + row * perRow * size : nullptr;
    return {static_cast<const char*>(q.scale) + row * perRow * size, mn, perRow, q.scaleType, scaleUb, minUb};
  }
  TileScales t = LoadScales(q, kPad, row, nt, k0, kl, scaleUb, minUb, ldUb);
  return {t.scale, t.min, t.lds, AscendC::DataType::FLOAT32, nullptr, nullptr};
}

// Dequantized row `row` of segment q over [k0, k0 + kl) into dst (fp32), with that row's scales (and
// mins) already in fp32: scale/min point at its first group in the chunk.
inline void DequantRowScaled(const QuantSegment& q, int64_t kPad, int64_t row, int64_t k0, int64_t kl, float* dst,
                             const float* scale, const float* min, int64_t group) {
  if (q.bits == 4)
    QuantSimd().dequant_w4(dst, static_cast<const uint8_t*>(q.data) + row * (kPad / 2) + k0 / 2, scale, min, kl,
                           group);
  else
    QuantSimd().dequant_w8(dst, static_cast<const int8_t*>(q.data) + row * kPad + k0, scale, kl, group);
}

// As DequantRowScaled, loading the row's scales first; scale/min: kl/32 floats of scratch.
inline void DequantRow(const QuantSegment& q, int64_t kPad, int64_t row, int64_t k0, int64_t kl, float* dst,
                       float* scale, float* min) {
  TileScales s = LoadScales(q, kPad, row, 1, k0, kl, scale, min, 0);
  DequantRowScaled(q, kPad, row, k0, kl, dst, s.scale, s.min, s.group);
}

// LaunchLinearKernel of Kernel<T> with Init(x, xOperands..., segments as LinearSegments, segments, residual, t):
// the float linear's epilogue, bias and output plumbing (LinearIo) sees the quantized segments as
// LinearSegments. xOperands: what else the kernel reads x as (the GEMM: its fp32 A operand).
template <template <typename> class Kernel, class... XOperands>
void LaunchQuantKernel(const void* x, const QuantSegment* segs, const void* residual, const QuantLinearTilingData& t,
                       const AscendC::SocInfo& soc, const XOperands&... xOperands) {
  LinearSegment ls[kLinearMaxSegments];
  for (int64_t s = 0; s < t.base.numSegments; ++s) ls[s] = {segs[s].data, segs[s].bias, segs[s].out, segs[s].n};
  const LinearSegment* linearSegs = ls;
  LaunchLinearKernel<Kernel>(t.base, soc, GmAddr(x), xOperands..., linearSegs, segs, GmAddr(residual), t);
}

}  // namespace atb
