// RMSNorm with LlamaRMSNorm numerics, and its PRENORM form (x + residual first).
//   h = x (+ residual), rounded to T       -> residualOut (PRENORM only)
//   y = T( w * T( h * rsqrt(mean(h^2) + eps) ) )   (fp32 arithmetic)
// The double rounding mirrors HF: it normalizes in fp32, casts back to the
// input dtype, then multiplies by the weight in that dtype.
#include <algorithm>
#include <cmath>
#include <type_traits>

#include "ascendc/kernel_operator.h"
#include "rms_norm_tiling.h"
#include "kernels/common/tiling_key.h"

using namespace AscendC;

namespace atb {
namespace {

template <typename T>
class KernelRmsNorm {
 public:
  void Init(GM_ADDR x, GM_ADDR residual, GM_ADDR weight, GM_ADDR y, GM_ADDR residualOut, const RmsNormTilingData& t) {
    t_ = t;
    int64_t first = GetBlockIdx() * t.blockFactor;
    rowCount_ = std::max<int64_t>(0, std::min(t.blockFactor, t.rows - first));
    int64_t off = first * t.cols;
    xGm_.SetGlobalBuffer(reinterpret_cast<T*>(x) + off);
    yGm_.SetGlobalBuffer(reinterpret_cast<T*>(y) + off);
    wGm_.SetGlobalBuffer(reinterpret_cast<T*>(weight));
    if (t.hasResidual) {
      rGm_.SetGlobalBuffer(reinterpret_cast<T*>(residual) + off);
      hGm_.SetGlobalBuffer(reinterpret_cast<T*>(residualOut) + off);
    }
    int64_t tileElems = t.rowsPerLoop * t.colTile;
    pipe_.InitBuffer(inX_, BUFFER_NUM, tileElems * sizeof(T));
    pipe_.InitBuffer(outY_, BUFFER_NUM, tileElems * sizeof(T));
    if (t.hasResidual) {
      pipe_.InitBuffer(inR_, BUFFER_NUM, tileElems * sizeof(T));
      pipe_.InitBuffer(outH_, BUFFER_NUM, tileElems * sizeof(T));
    }
    pipe_.InitBuffer(work_, tileElems * sizeof(float));
    pipe_.InitBuffer(weight_, t.colTile * sizeof(float));
  }

  void Process() {
    if (rowCount_ == 0) return;
    if (TilingKeyVariant(t_.tilingKey) == RMS_NORM_ROWS) {
      LoadWeight(0, t_.cols);
      for (int64_t r = 0; r < rowCount_; r += t_.rowsPerLoop) {
        int64_t n = std::min(t_.rowsPerLoop, rowCount_ - r);
        ComputeRows(r * t_.cols, n * t_.cols);
      }
    } else {
      for (int64_t r = 0; r < rowCount_; ++r) ProcessSplitRow(r);
    }
  }

 private:
  void LoadWeight(int64_t col, int64_t n) {
    // Weight goes through the work buffer once per tile of columns, kept in fp32.
    LocalTensor<float> w = weight_.Get<float>();
    CastRaw<float, T>(w.GetPhyAddr(), wGm_.GetPhyAddr(col), n);
  }

  void CopyIn(int64_t off, int64_t n) {
    LocalTensor<T> x = inX_.AllocTensor<T>();
    DataCopy(x, xGm_[off], n);
    inX_.EnQue(x);
    if (t_.hasResidual) {
      LocalTensor<T> r = inR_.AllocTensor<T>();
      DataCopy(r, rGm_[off], n);
      inR_.EnQue(r);
    }
  }

  // Loads the queued tile into the fp32 work buffer, adding the residual.
  LocalTensor<float> Widen(int64_t n, LocalTensor<T>* hOut) {
    LocalTensor<float> w = work_.Get<float>();
    LocalTensor<T> x = inX_.DeQue<T>();
    Cast(w, x, RoundMode::CAST_NONE, n);
    inX_.FreeTensor(x);
    if (t_.hasResidual) {
      LocalTensor<T> r = inR_.DeQue<T>();
      AddStorage(w.GetPhyAddr(), r.GetPhyAddr(), n);
      inR_.FreeTensor(r);
      // The sum is rounded to T (as HF's `x + residual` in T is) before it is normalized.
      *hOut = outH_.AllocTensor<T>();
      Cast(*hOut, w, RoundMode::CAST_RINT, n);
      if (!std::is_same<T, float>::value) Cast(w, *hOut, RoundMode::CAST_NONE, n);
    }
    return w;
  }

  // w += float(r), in chunks through a small stack buffer (fp32 only needs Add).
  static void AddStorage(float* w, const T* r, int64_t n) {
    if constexpr (std::is_same<T, float>::value) {
      Simd().add(w, w, r, n);
    } else {
      alignas(64) float buf[256];
      for (int64_t i = 0; i < n; i += 256) {
        int64_t m = std::min<int64_t>(256, n - i);
        CastRaw<float, T>(buf, r + i, m);
        Simd().add(w + i, w + i, buf, m);
      }
    }
  }

  // The whole rows [off, off + n) of this core's share, read where they lie into the fp32 work buffer (plus
  // the residual: their sum, rounded to T, written straight to residualOut and read back), normalized and
  // written straight to y. Every element is read before any is written, so y or residualOut may alias x or
  // the residual. An NPU's vector unit would stage the rows in UB queues (the tiling keeps that UB); on the
  // CPU that staging was a copy in and a copy out of every element: AMX Xeon, 2048 x 576 bf16, three
  // alternating runs, us: rms_norm 283-288 -> 216-232, add_rms_norm 538-547 -> 388-471.
  void ComputeRows(int64_t off, int64_t n) {
    int64_t cols = t_.cols;
    int64_t rows = n / cols;
    float* w = work_.Get<float>().GetPhyAddr();
    CastRaw<float, T>(w, xGm_.GetPhyAddr(off), n);
    if (t_.hasResidual) {
      T* h = hGm_.GetPhyAddr(off);
      AddStorage(w, rGm_.GetPhyAddr(off), n);
      CastRaw<T, float>(h, w, n);
      if (!std::is_same<T, float>::value) CastRaw<float, T>(w, h, n);
    }
    const float* wt = weight_.Get<float>().GetPhyAddr();
    for (int64_t r = 0; r < rows; ++r) {
      float* row = w + r * cols;
      float rstd = 1.0f / std::sqrt(Simd().sum_squares(row, cols) / float(cols) + t_.eps);
      // y = T(w * T(row * rstd)): HF casts the normalized value back to T before the weight multiplies it.
      RmsScaleOutRaw(yGm_.GetPhyAddr(off + r * cols), row, wt, rstd, cols);
    }
  }

  // Split-D: pass 1 accumulates sum(h^2) tile by tile (and writes h for
  // PRENORM); pass 2 re-reads each tile and normalizes it.
  void ProcessSplitRow(int64_t r) {
    int64_t cols = t_.cols, tile = t_.colTile, base = r * cols;
    float ss = 0.0f;
    for (int64_t c = 0; c < cols; c += tile) {
      int64_t n = std::min(tile, cols - c);
      CopyIn(base + c, n);
      LocalTensor<T> h;
      LocalTensor<float> w = Widen(n, &h);
      ss += Simd().sum_squares(w.GetPhyAddr(), n);
      if (t_.hasResidual) {
        outH_.EnQue(h);
        LocalTensor<T> ho = outH_.DeQue<T>();
        DataCopy(hGm_[base + c], ho, n);
        outH_.FreeTensor(ho);
      }
    }
    float rstd = 1.0f / std::sqrt(ss / float(cols) + t_.eps);
    // PRENORM's pass 2 reads the rounded sum it just wrote instead of x + residual.
    GlobalTensor<T> src = t_.hasResidual ? hGm_ : xGm_;
    for (int64_t c = 0; c < cols; c += tile) {
      int64_t n = std::min(tile, cols - c);
      LoadWeight(c, n);
      LocalTensor<T> x = inX_.AllocTensor<T>();
      DataCopy(x, src[base + c], n);
      inX_.EnQue(x);
      x = inX_.DeQue<T>();
      LocalTensor<float> w = work_.Get<float>();
      Cast(w, x, RoundMode::CAST_NONE, n);
      inX_.FreeTensor(x);
      LocalTensor<T> y = outY_.AllocTensor<T>();
      RmsScaleOutRaw(y.GetPhyAddr(), w.GetPhyAddr(), weight_.Get<float>().GetPhyAddr(), rstd, n);
      outY_.EnQue(y);
      y = outY_.DeQue<T>();
      DataCopy(yGm_[base + c], y, n);
      outY_.FreeTensor(y);
    }
  }

  RmsNormTilingData t_;
  int64_t rowCount_ = 0;
  TPipe pipe_;
  TQue<QuePosition::VECIN, BUFFER_NUM> inX_, inR_;
  TQue<QuePosition::VECOUT, BUFFER_NUM> outY_, outH_;
  TBuf<TPosition::VECCALC> work_, weight_;
  GlobalTensor<T> xGm_, rGm_, wGm_, yGm_, hGm_;
};

template <typename T>
void RunRmsNorm(GM_ADDR x, GM_ADDR residual, GM_ADDR weight, GM_ADDR y, GM_ADDR residualOut,
                const RmsNormTilingData& t) {
  KernelRmsNorm<T> op;
  op.Init(x, residual, weight, y, residualOut, t);
  op.Process();
}

}  // namespace

void RmsNorm(void* y, void* residualOut, const void* x, const void* residual, const void* weight, int64_t rows,
             int64_t cols, DataType dtype, float eps, const SocInfo& soc) {
  RmsNormTilingData t = RmsNormTiling(rows, cols, dtype, eps, residual != nullptr, soc);
  auto kernel = [&]() {
    DispatchDtype(TilingKeyDtype(t.tilingKey), [&](auto tag) {
      RunRmsNorm<decltype(tag)>(GmAddr(x), GmAddr(residual), GmAddr(weight), GmAddr(y), GmAddr(residualOut), t);
    });
  };
  KernelLaunch(t.blockDim, soc.ub_size, kernel);
}

}  // namespace atb
