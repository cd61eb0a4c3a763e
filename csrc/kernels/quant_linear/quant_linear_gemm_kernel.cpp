// Prefill-shaped quantized linear (the GEMM kernel): y = x dequant(W)^T (+ bias) for
// M >= kLinearGemmMinRows, with the same fused epilogues as the STREAM kernel.
//
// As the float GEMM (linear_gemm_kernel.cpp): work units are (row tile of one
// segment, M pass); for each K chunk a unit dequantizes its weight tile
// W[rows, k0 : k0 + kTile] into UB, transposed, as the cube's fp32 B operand
// (one row at a time through the quantized SIMD table, then a transposed
// store), and every mTile rows of x of the pass run through the 6x16
// register-blocked cube tile (MmadNN) into fp32 accumulators kept across K
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
  void Init(GM_ADDR x, const LinearSegment* ls, const QuantSegment* qs, GM_ADDR residual,
            const QuantLinearTilingData& t) {
    Gemm::InitGemm(x, ls, residual, t.base, t.kPad, true);
    q_ = qs;
    kPad_ = t.kPad;
    pipe_.InitBuffer(rowBuf_, t_.kTile * sizeof(float));
    pipe_.InitBuffer(scaleBuf_, t.kChunks * sizeof(float));
    pipe_.InitBuffer(minBuf_, t.kChunks * sizeof(float));
    Gemm::InitWidenedX(true);
  }

 private:
  void ProcessUnit(const GemmUnit& u) { Gemm::ProcessPackedUnit(u); }

  // B operand: packed[k][n] = dequant(W[row + n][k0 + k]), n < nt, k < kv.
  void PackWeight(int st, int seg, int64_t row, int64_t nt, int64_t k0, int64_t kl, int64_t kv) {
    float* b = bBuf_[st].template Get<float>().GetPhyAddr();
    float* r = rowBuf_.Get<float>().GetPhyAddr();
    int64_t ld = t_.nTile;
    for (int64_t n = 0; n < nt; ++n) {
      DequantRow(q_[seg], kPad_, row + n, k0, kl, r, scaleBuf_.Get<float>().GetPhyAddr(),
                 minBuf_.Get<float>().GetPhyAddr());
      for (int64_t k = 0; k < kv; ++k) b[k * ld + n] = r[k];
    }
  }

  const QuantSegment* q_ = nullptr;
  int64_t kPad_ = 0;
  TBuf<TPosition::VECCALC> rowBuf_, scaleBuf_, minBuf_;
};

}  // namespace

void QuantLinearGemm(const void* x, const QuantSegment* segs, const void* residual, const QuantLinearTilingData& t,
                     const SocInfo& soc) {
  LaunchQuantKernel<KernelQuantLinearGemm>(x, segs, residual, t, soc);
}

}  // namespace atb
