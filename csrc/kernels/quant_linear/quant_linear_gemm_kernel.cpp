// Prefill-shaped quantized linear (the GEMM kernel): y = x dequant(W)^T (+ bias) for
// M >= kLinearGemmMinRows, with the same fused epilogues as the STREAM kernel.
//
// As the float GEMM (linear_gemm_kernel.cpp): work units are (row tile of one
// segment, M pass); for each K chunk a unit dequantizes its weight tile
// W[rows, k0 : k0 + kTile] into UB, transposed, as the cube's fp32 B operand
// (kQuantPackRows rows at a time through the quantized SIMD table, then one
// SIMD transpose of the block), and every mTile rows of x of the pass (PackedX's blocks) run through the
// 6x16 register-blocked cube tile (MmadTN) into fp32 accumulators kept across K
// chunks. A weight is thus dequantized once per M pass (up to 384 rows of x),
// so prefill runs at the fp32 cube's speed whatever the weight format.
#include <algorithm>
#include <type_traits>

#include "quant_linear_io.h"

using namespace AscendC;

namespace atb {
namespace {

template <typename T>
class KernelQuantLinearGemm : public LinearGemmIo<T, KernelQuantLinearGemm<T>> {
  using Gemm = LinearGemmIo<T, KernelQuantLinearGemm<T>>;
  friend Gemm;
  using typename Gemm::GemmUnit;
  using Gemm::t_, Gemm::pipe_, Gemm::bBuf_;

 public:
  void Init(GM_ADDR x, const float* xPacked, const LinearSegment* ls, const QuantSegment* qs, GM_ADDR residual,
            const QuantLinearTilingData& t) {
    Gemm::InitGemm(x, xPacked, ls, residual, t.base, t.kPad, true);
    q_ = qs;
    kPad_ = t.kPad;
    pipe_.InitBuffer(rowBuf_, kQuantPackRows * t_.kTile * sizeof(float));
    pipe_.InitBuffer(scaleBuf_, t.kChunks * sizeof(float));
    pipe_.InitBuffer(minBuf_, t.kChunks * sizeof(float));
  }

 private:
  void ProcessUnit(const GemmUnit& u) { Gemm::ProcessPackedUnit(u); }

  // B operand: packed[k][n] = dequant(W[row + n][k0 + k]), n < nt, k < kv.
  void PackWeight(int st, int seg, int64_t row, int64_t nt, int64_t k0, int64_t kl, int64_t kv) {
    float* b = bBuf_[st].template Get<float>().GetPhyAddr();
    float* r = rowBuf_.Get<float>().GetPhyAddr();
    for (int64_t n0 = 0; n0 < nt; n0 += kQuantPackRows) {
      int64_t nb = std::min(kQuantPackRows, nt - n0);
      for (int64_t j = 0; j < nb; ++j)
        DequantRow(q_[seg], kPad_, row + n0 + j, k0, kl, r + j * t_.kTile, scaleBuf_.Get<float>().GetPhyAddr(),
                   minBuf_.Get<float>().GetPhyAddr());
      Simd().transpose_f32(b + n0, t_.nTile, r, t_.kTile, nb, kv);
    }
  }

  const QuantSegment* q_ = nullptr;
  int64_t kPad_ = 0;
  TBuf<TPosition::VECCALC> rowBuf_, scaleBuf_, minBuf_;
};

}  // namespace

void QuantLinearGemm(const void* x, const QuantSegment* segs, const void* residual, const QuantLinearTilingData& t,
                     const SocInfo& soc) {
  const float* xPacked = PackedX(x, t.base.m, t.base.k, DataType(t.base.tilingKey / 10 % 10), soc);
  LaunchQuantKernel<KernelQuantLinearGemm>(x, segs, residual, t, soc, xPacked);
}

}  // namespace atb
