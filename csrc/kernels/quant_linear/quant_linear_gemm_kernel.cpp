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
//
// bf16 x where the SIMD table has vdpbf16ps (tiling kDpPacked): the weight tile
// dequantized to the bf16 weights it stands for and packed in k pairs, in one
// pass from the stored bytes (pack_q4_pairs_dequant / pack_q8_pairs_dequant),
// then the bf16 GEMM on x's rows as they lie (mmad_dp_bf16_packed, AMX where
// present): the weights rounded to bf16 as a bf16 model's are.
#include <algorithm>
#include <type_traits>
#include <vector>

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
    dp_ = t.base.form == kDpPacked;
    Gemm::InitGemm(x, xPacked, ls, residual, t.base, t.kPad, !dp_);
    q_ = qs;
    kPad_ = t.kPad;
    kGroups_ = t.kGroups;
    if (dp_) Gemm::InitDpPacked();
    else pipe_.InitBuffer(rowBuf_, kQuantPackRows * t_.kTile * sizeof(float));  // PackWeight's rows
    // A row's scales, or (dp) a tile's.
    pipe_.InitBuffer(scaleBuf_, (dp_ ? t_.nTile : 1) * t.kGroups * sizeof(float));
    pipe_.InitBuffer(minBuf_, (dp_ ? t_.nTile : 1) * t.kGroups * sizeof(float));
  }

 private:
  void ProcessUnit(const GemmUnit& u) {
    if (dp_) return Gemm::ProcessDpPackedUnit(u);
    Gemm::ProcessPackedUnit(u);
  }

  // kDpPacked's B operand: the tile's dequantized bf16 weights, packed in k pairs.
  void PackPairs(int /*st*/, int seg, int64_t row, int64_t nt, int64_t k0, int64_t kv, uint16_t* dst) {
    const QuantSegment& q = q_[seg];
    const int64_t kl = std::min(t_.kTile, kPad_ - k0);
    TileScales s = LoadScales(q, kPad_, row, nt, k0, kl, scaleBuf_.Get<float>().GetPhyAddr(),
                              minBuf_.Get<float>().GetPhyAddr(), kGroups_);
    if (q.bits == 4)
      Simd().pack_q4_pairs_dequant(dst, static_cast<const uint8_t*>(q.data) + row * (kPad_ / 2) + k0 / 2, kPad_ / 2,
                                   nt, kv, s.scale, s.min, s.lds, s.group);
    else
      Simd().pack_q8_pairs_dequant(dst, static_cast<const int8_t*>(q.data) + row * kPad_ + k0, kPad_, nt, kv,
                                   s.scale, s.lds, s.group);
  }

  // x . w^T of the packed tile, x = x[m0 :, k0 :].
  void DpMmad(int /*st*/, int64_t /*m0*/, int64_t /*k0*/, float* c, int64_t ldc, const uint16_t* a, int64_t lda,
              const uint16_t* bp, int64_t mt, int64_t nt, int64_t kv, bool acc) {
    Simd().mmad_dp_bf16_packed(c, ldc, a, lda, bp, mt, nt, kv, acc);
  }

  // B operand: packed[k][n] = dequant(W[row + n][k0 + k]), n < nt, k < kv.
  void PackWeight(int st, int seg, int64_t row, int64_t nt, int64_t k0, int64_t kl, int64_t kv) {
    float* b = bBuf_[st].template Get<float>().GetPhyAddr();
    float* r = rowBuf_.Get<float>().GetPhyAddr();
    const QuantSegment& q = q_[seg];
    for (int64_t n0 = 0; n0 < nt; n0 += kQuantPackRows) {
      int64_t nb = std::min(kQuantPackRows, nt - n0);
      PrefetchRowBlock(q, kPad_, row + n0, nb, k0, kl);
      for (int64_t j = 0; j < nb; ++j)
        DequantRow(q, kPad_, row + n0 + j, k0, kl, r + j * t_.kTile, scaleBuf_.Get<float>().GetPhyAddr(),
                   minBuf_.Get<float>().GetPhyAddr());
      Simd().transpose_f32(b + n0, t_.nTile, r, t_.kTile, nb, kv);
    }
  }

  const QuantSegment* q_ = nullptr;
  int64_t kPad_ = 0, kGroups_ = 0;
  bool dp_ = false;
  TBuf<TPosition::VECCALC> rowBuf_, scaleBuf_, minBuf_;
};

}  // namespace

void QuantLinearGemm(const void* x, const QuantSegment* segs, const void* residual, const QuantLinearTilingData& t,
                     const SocInfo& soc) {
  const bool dp = t.base.form == kDpPacked;
  const float* xPacked = dp ? nullptr : PackedX(x, t.base.m, t.base.k, DataType(t.base.tilingKey / 10 % 10), soc);
  LaunchQuantKernel<KernelQuantLinearGemm>(x, segs, residual, t, soc, xPacked);
}

}  // namespace atb
