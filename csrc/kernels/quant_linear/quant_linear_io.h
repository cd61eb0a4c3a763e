// What the quantized STREAM and GEMM kernels add to the float linear's LinearIo:
// the quantized segments, their group scales widened to fp32 in UB, and the launch.
#pragma once
#include <algorithm>
#include <cstdint>

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

// Group scales (and mins) of weight rows [row, row + nt) for the K chunk [k0, k0 + kl) of segment q,
// widened into scale/min [nt, ld]. Returns the group length the micro-kernel uses: the segment's
// group, or kl for a per-channel segment (one group per chunk, holding the row's scale).
inline int64_t LoadScales(const QuantSegment& q, int64_t kPad, int64_t row, int64_t nt, int64_t k0, int64_t kl,
                          float* scale, float* min, int64_t ld) {
  if (q.group == 0) {
    for (int64_t n = 0; n < nt; ++n) scale[n * ld] = ScaleAt(q.scale, q.scaleType, row + n);
    return kl;
  }
  int64_t perRow = AscendC::CeilDiv(kPad, q.group), g0 = k0 / q.group, ng = AscendC::CeilDiv(kl, q.group);
  for (int64_t n = 0; n < nt; ++n)
    for (int64_t g = 0; g < ng; ++g) {
      int64_t i = (row + n) * perRow + g0 + g;
      scale[n * ld + g] = ScaleAt(q.scale, q.scaleType, i);
      if (q.bits == 4) min[n * ld + g] = ScaleAt(q.min, q.scaleType, i);
    }
  return q.group;
}

// Dequantized row `row` of segment q over [k0, k0 + kl) into dst (fp32); scale/min: kl/32 floats of scratch.
inline void DequantRow(const QuantSegment& q, int64_t kPad, int64_t row, int64_t k0, int64_t kl, float* dst,
                       float* scale, float* min) {
  int64_t g = LoadScales(q, kPad, row, 1, k0, kl, scale, min, 0);
  if (q.bits == 4)
    QuantSimd().dequant_w4(dst, static_cast<const uint8_t*>(q.data) + row * (kPad / 2) + k0 / 2, scale, min, kl, g);
  else
    QuantSimd().dequant_w8(dst, static_cast<const int8_t*>(q.data) + row * kPad + k0, scale, kl, g);
}

// KernelLaunch of Kernel<T> (Init + Process) for the tiling's activation dtype.
template <template <typename> class Kernel>
void LaunchQuantKernel(const void* x, const QuantSegment* segs, const void* residual, const QuantLinearTilingData& t,
                       const AscendC::SocInfo& soc) {
  using AscendC::DataType;
  // The float linear's epilogue, bias and output plumbing sees the segments as LinearSegments.
  LinearSegment ls[kLinearMaxSegments];
  for (int64_t s = 0; s < t.base.numSegments; ++s) ls[s] = {segs[s].data, segs[s].bias, segs[s].out, segs[s].n};
  auto gm = [](const void* p) { return reinterpret_cast<AscendC::GM_ADDR>(const_cast<void*>(p)); };
  auto run = [&](auto tag) {
    Kernel<decltype(tag)> op;
    op.Init(gm(x), ls, segs, gm(residual), t);
    op.Process();
  };
  auto kernel = [&]() {
    switch (DataType(t.base.tilingKey / 10 % 10)) {
      case DataType::FLOAT32: return run(float{});
      case DataType::FLOAT16: return run(AscendC::half{});
      case DataType::BFLOAT16: return run(AscendC::bfloat16_t{});
    }
  };
  AscendC::KernelLaunch(t.base.blockDim, soc.ub_size, kernel);
}

}  // namespace atb
