// SwiGLU: out = silu(gate) * up with HF numerics (`act_fn(gate) * up` in the
// dtype: silu(gate) rounded to T, then the product rounded to T). swiglu(x)
// is the same kernel with gate and up the two halves of each row of x.
// Per tile: CopyIn the gate and up rows (any row stride) into UB, Compute one
// fused SIMD pass per row (widen, silu, round, multiply, narrow), CopyOut.
#include <algorithm>

#include "ascendc/kernel_operator.h"
#include "swiglu_tiling.h"
#include "kernels/common/tiling_key.h"

using namespace AscendC;

namespace atb {
namespace {

template <typename T>
class KernelSiluMul {
 public:
  void Init(GM_ADDR out, GM_ADDR gate, int64_t gateStride, GM_ADDR up, int64_t upStride, const SwiGluTilingData& t) {
    t_ = t;
    gateStride_ = gateStride;
    upStride_ = upStride;
    first_ = GetBlockIdx() * t.blockFactor;
    count_ = std::max<int64_t>(0, std::min(t.blockFactor, t.units - first_));
    outGm_.SetGlobalBuffer(reinterpret_cast<T*>(out));
    gGm_.SetGlobalBuffer(reinterpret_cast<T*>(gate));
    uGm_.SetGlobalBuffer(reinterpret_cast<T*>(up));
    int64_t tileBytes = t.rowsPerLoop * AlignUp(t.colTile * int64_t(sizeof(T)), ONE_BLK_SIZE);
    pipe_.InitBuffer(inG_, BUFFER_NUM, tileBytes);
    pipe_.InitBuffer(inU_, BUFFER_NUM, tileBytes);
    pipe_.InitBuffer(out_, BUFFER_NUM, tileBytes);
  }

  void Process() {
    for (int64_t i = 0; i < count_;) {
      int64_t row, col, n, len;
      if (t_.colChunks == 1) {  // whole rows, several per tile
        row = first_ + i;
        col = 0;
        n = std::min(t_.rowsPerLoop, count_ - i);
        len = t_.cols;
        i += n;
      } else {  // one column tile of one row
        row = (first_ + i) / t_.colChunks;
        col = (first_ + i) % t_.colChunks * t_.colTile;
        n = 1;
        len = std::min(t_.colTile, t_.cols - col);
        ++i;
      }
      CopyIn(row, col, n, len);
      Compute(n, len);
      CopyOut(row, col, n, len);
    }
  }

 private:
  static int64_t Pitch(int64_t len) { return AlignUp(len * int64_t(sizeof(T)), ONE_BLK_SIZE) / int64_t(sizeof(T)); }

  void CopyIn(int64_t row, int64_t col, int64_t n, int64_t len) {
    int64_t elt = sizeof(T);
    LocalTensor<T> g = inG_.AllocTensor<T>();
    DataCopyPad(g, gGm_[row * gateStride_ + col], DataCopyParams{n, len * elt, (gateStride_ - len) * elt, 0});
    inG_.EnQue(g);
    LocalTensor<T> u = inU_.AllocTensor<T>();
    DataCopyPad(u, uGm_[row * upStride_ + col], DataCopyParams{n, len * elt, (upStride_ - len) * elt, 0});
    inU_.EnQue(u);
  }

  void Compute(int64_t n, int64_t len) {
    LocalTensor<T> g = inG_.DeQue<T>();
    LocalTensor<T> u = inU_.DeQue<T>();
    LocalTensor<T> y = out_.AllocTensor<T>();
    int64_t pitch = Pitch(len);
    // Row by row, so an element's SIMD lane position (and rounding) never depends on the tiling.
    for (int64_t r = 0; r < n; ++r) SiluMulRaw(y.GetPhyAddr(r * pitch), g.GetPhyAddr(r * pitch), u.GetPhyAddr(r * pitch), len);
    out_.EnQue(y);
    inG_.FreeTensor(g);
    inU_.FreeTensor(u);
  }

  void CopyOut(int64_t row, int64_t col, int64_t n, int64_t len) {
    int64_t elt = sizeof(T);
    LocalTensor<T> y = out_.DeQue<T>();
    DataCopyPad(outGm_[row * t_.cols + col], y, DataCopyParams{n, len * elt, 0, (t_.cols - len) * elt});
    out_.FreeTensor(y);
  }

  SwiGluTilingData t_;
  int64_t gateStride_ = 0, upStride_ = 0, first_ = 0, count_ = 0;
  TPipe pipe_;
  TQue<QuePosition::VECIN, BUFFER_NUM> inG_, inU_;
  TQue<QuePosition::VECOUT, BUFFER_NUM> out_;
  GlobalTensor<T> outGm_, gGm_, uGm_;
};

template <typename T>
void RunSiluMul(GM_ADDR out, GM_ADDR gate, int64_t gs, GM_ADDR up, int64_t us, const SwiGluTilingData& t) {
  KernelSiluMul<T> op;
  op.Init(out, gate, gs, up, us, t);
  op.Process();
}

}  // namespace

void SiluMul(void* out, const void* gate, int64_t gateRowStride, const void* up, int64_t upRowStride, int64_t rows,
             int64_t cols, DataType dtype, const SocInfo& soc) {
  SwiGluTilingData t = SwiGluTiling(rows, cols, dtype, soc);
  auto kernel = [&]() {
    DispatchDtype(TilingKeyDtype(t.tilingKey), [&](auto tag) {
      RunSiluMul<decltype(tag)>(GmAddr(out), GmAddr(gate), gateRowStride, GmAddr(up), upRowStride, t);
    });
  };
  KernelLaunch(t.blockDim, soc.ub_size, kernel);
}

}  // namespace atb
