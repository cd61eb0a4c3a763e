// What the two linear kernels (STREAM: linear_kernel.cpp, GEMM: linear_gemm_kernel.cpp)
// share: the GM operands of a launch, the residual tile read, the fused epilogue on
// the fp32 sums, the output write, and the launch itself.
#pragma once
#include <cstdint>

#include "ascendc/kernel_operator.h"
#include "linear_tiling.h"

namespace atb {

template <typename T>
class LinearIo {
 protected:
  // GM operands and the output (and residual) queues of [mTile, nTile] tiles.
  void InitIo(AscendC::GM_ADDR x, const LinearSegment* segs, AscendC::GM_ADDR residual, const LinearTilingData& t) {
    using namespace AscendC;
    t_ = t;
    ep_ = LinearEpilogue(t.tilingKey % 10);
    streams_ = ep_ == LINEAR_SWIGLU ? 2 : 1;
    xGm_.SetGlobalBuffer(reinterpret_cast<T*>(x));
    for (int64_t s = 0; s < t.numSegments; ++s) {
      wGm_[s].SetGlobalBuffer(reinterpret_cast<T*>(const_cast<void*>(segs[s].weight)));
      bias_[s] = reinterpret_cast<const T*>(segs[s].bias);
      yGm_[s].SetGlobalBuffer(reinterpret_cast<T*>(segs[s].out));
    }
    if (ep_ == LINEAR_RESIDUAL) rGm_.SetGlobalBuffer(reinterpret_cast<T*>(residual));
    pipe_.InitBuffer(outQue_, BUFFER_NUM, t.mTile * t.nTile * sizeof(T));
    if (ep_ == LINEAR_RESIDUAL) pipe_.InitBuffer(resQue_, BUFFER_NUM, t.mTile * t.nTile * sizeof(T));
  }

  // Residual rows [m, m + mt), columns [row, row + nt) (RESIDUAL has one segment).
  void CopyInResidual(int64_t row, int64_t m, int64_t mt, int64_t nt) {
    AscendC::LocalTensor<T> r = resQue_.template AllocTensor<T>();
    int64_t n = t_.segRows[0];
    for (int64_t i = 0; i < mt; ++i) AscendC::DataCopy(r[i * nt], rGm_[(m + i) * n + row], nt);
    resQue_.EnQue(r);
  }

  // sums [mt, nt] of segment s (leading dim ld; up: SWIGLU's second stream, segment 1) -> + their
  // biases, then the roundings HF performs between its separate ops (see linear_tiling.h), then T
  // into the output queue.
  void Epilogue(int s, int64_t row, float* sums, float* up, int64_t ld, int64_t mt, int64_t nt) {
    using namespace AscendC;
    LocalTensor<T> r;
    if (ep_ == LINEAR_RESIDUAL) r = resQue_.template DeQue<T>();
    LocalTensor<T> y = outQue_.template AllocTensor<T>();
    for (int64_t i = 0; i < mt; ++i) {
      float* a = sums + i * ld;
      AddBias(a, bias_[s], row, nt);
      if (ep_ == LINEAR_SWIGLU) {
        float* u = up + i * ld;
        AddBias(u, bias_[1], row, nt);
        for (int64_t n = 0; n < nt; ++n) a[n] = RoundTo<T>(a[n]);  // HF: gate = T(linear)
        Simd().silu(a, a, nt);
        for (int64_t n = 0; n < nt; ++n) a[n] = RoundTo<T>(a[n]) * RoundTo<T>(u[n]);
      } else if (ep_ == LINEAR_RESIDUAL) {
        for (int64_t n = 0; n < nt; ++n) a[n] = RoundTo<T>(a[n]) + ToFloat(r.GetValue(i * nt + n));
      }
      CastRaw<T, float>(y.GetPhyAddr(i * nt), a, nt);
    }
    if (ep_ == LINEAR_RESIDUAL) resQue_.FreeTensor(r);
    outQue_.EnQue(y);
  }

  static void AddBias(float* a, const T* bias, int64_t row, int64_t nt) {
    if (bias)
      for (int64_t n = 0; n < nt; ++n) a[n] += AscendC::ToFloat(bias[row + n]);
  }

  void CopyOut(int s, int64_t row, int64_t m, int64_t mt, int64_t nt) {
    AscendC::LocalTensor<T> y = outQue_.template DeQue<T>();
    int64_t n = t_.segRows[s];
    for (int64_t i = 0; i < mt; ++i) AscendC::DataCopy(yGm_[s][(m + i) * n + row], y[i * nt], nt);
    outQue_.FreeTensor(y);
  }

  LinearTilingData t_;
  LinearEpilogue ep_ = LINEAR_PLAIN;
  int streams_ = 1;
  AscendC::TPipe pipe_;
  AscendC::TQue<AscendC::QuePosition::VECOUT, AscendC::BUFFER_NUM> outQue_;
  AscendC::TQue<AscendC::QuePosition::VECIN, AscendC::BUFFER_NUM> resQue_;
  AscendC::GlobalTensor<T> xGm_, rGm_, wGm_[kLinearMaxSegments], yGm_[kLinearMaxSegments];
  const T* bias_[kLinearMaxSegments] = {nullptr, nullptr, nullptr};
};

// KernelLaunch of Kernel<T> (Init + Process) for the tiling's dtype.
template <template <typename> class Kernel>
void LaunchLinearKernel(const void* x, const LinearSegment* segs, const void* residual, const LinearTilingData& t,
                        const AscendC::SocInfo& soc) {
  using AscendC::DataType;
  auto gm = [](const void* p) { return reinterpret_cast<AscendC::GM_ADDR>(const_cast<void*>(p)); };
  auto run = [&](auto tag) {
    Kernel<decltype(tag)> op;
    op.Init(gm(x), segs, gm(residual), t);
    op.Process();
  };
  auto kernel = [&]() {
    switch (DataType(t.tilingKey / 10 % 10)) {
      case DataType::FLOAT32: return run(float{});
      case DataType::FLOAT16: return run(AscendC::half{});
      case DataType::BFLOAT16: return run(AscendC::bfloat16_t{});
    }
  };
  AscendC::KernelLaunch(t.blockDim, soc.ub_size, kernel);
}

}  // namespace atb
