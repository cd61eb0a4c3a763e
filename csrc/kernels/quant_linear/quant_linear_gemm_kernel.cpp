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
class KernelQuantLinearGemm : LinearIo<T> {
  static constexpr bool kFloat = std::is_same<T, float>::value;
  using Io = LinearIo<T>;
  using Io::t_, Io::ep_, Io::streams_, Io::pipe_, Io::xGm_;

 public:
  void Init(GM_ADDR x, const LinearSegment* ls, const QuantSegment* qs, GM_ADDR residual,
            const QuantLinearTilingData& t) {
    Io::InitIo(x, ls, residual, t.base);
    q_ = qs;
    kPad_ = t.kPad;
    for (int st = 0; st < streams_; ++st) {
      pipe_.InitBuffer(bBuf_[st], t_.kTile * t_.nTile * sizeof(float));
      pipe_.InitBuffer(cBuf_[st], t_.mPass * t_.nTile * sizeof(float));
    }
    pipe_.InitBuffer(rowBuf_, t_.kTile * sizeof(float));
    pipe_.InitBuffer(scaleBuf_, t.kChunks * sizeof(float));
    pipe_.InitBuffer(minBuf_, t.kChunks * sizeof(float));
    if (!kFloat) pipe_.InitBuffer(aBuf_, t_.mTile * t_.kTile * sizeof(float));
  }

  void Process() {
    int64_t units = t_.nTiles * t_.mPasses;
    int64_t first = GetBlockIdx() * t_.blockFactor;
    int64_t last = std::min(units, first + t_.blockFactor);
    for (int64_t u = first; u < last; ++u) ProcessUnit(u / t_.mPasses, u % t_.mPasses);
  }

 private:
  void ProcessUnit(int64_t tile, int64_t pass) {
    // Row tile -> (segment, first row, rows): tiles never cross a segment boundary.
    int s = 0;
    int64_t row = tile * t_.nTile;
    if (ep_ != LINEAR_SWIGLU) {
      while (row >= AlignUp(t_.segRows[s], t_.nTile)) {
        row -= AlignUp(t_.segRows[s], t_.nTile);
        ++s;
      }
    }
    int64_t nt = std::min(t_.nTile, t_.segRows[s] - row);
    int64_t m0 = pass * t_.mPass, mp = std::min(t_.mPass, t_.m - m0);
    for (int64_t k0 = 0; k0 < kPad_; k0 += t_.kTile) {
      int64_t kl = std::min(t_.kTile, kPad_ - k0);
      int64_t kv = std::min(kl, t_.k - k0);  // columns that exist in x (the rest is padding)
      for (int st = 0; st < streams_; ++st) PackWeight(st, st == 1 ? 1 : s, row, nt, k0, kl, kv);
      for (int64_t mt0 = 0; mt0 < mp; mt0 += t_.mTile) Compute(m0 + mt0, mt0, std::min(t_.mTile, mp - mt0), nt, k0, kv);
    }
    for (int64_t mt0 = 0; mt0 < mp; mt0 += t_.mTile) {
      int64_t mt = std::min(t_.mTile, mp - mt0);
      if (ep_ == LINEAR_RESIDUAL) Io::CopyInResidual(row, m0 + mt0, mt, nt);
      float* gate = cBuf_[0].Get<float>().GetPhyAddr(mt0 * t_.nTile);
      float* up = streams_ == 2 ? cBuf_[1].Get<float>().GetPhyAddr(mt0 * t_.nTile) : nullptr;
      Io::Epilogue(s, row, gate, up, t_.nTile, mt, nt);
      Io::CopyOut(s, row, m0 + mt0, mt, nt);
    }
  }

  // B operand: packed[k][n] = dequant(W[row + n][k0 + k]), n < nt, k < kv.
  void PackWeight(int st, int seg, int64_t row, int64_t nt, int64_t k0, int64_t kl, int64_t kv) {
    float* b = bBuf_[st].Get<float>().GetPhyAddr();
    float* r = rowBuf_.Get<float>().GetPhyAddr();
    int64_t ld = t_.nTile;
    for (int64_t n = 0; n < nt; ++n) {
      DequantRow(q_[seg], kPad_, row + n, k0, kl, r, scaleBuf_.Get<float>().GetPhyAddr(),
                 minBuf_.Get<float>().GetPhyAddr());
      for (int64_t k = 0; k < kv; ++k) b[k * ld + n] = r[k];
    }
  }

  // C[mt0 : mt0 + mt, :nt] (+)= x[m : m + mt, k0 : k0 + kv] . packed, per stream.
  void Compute(int64_t m, int64_t mt0, int64_t mt, int64_t nt, int64_t k0, int64_t kv) {
    const float* a;
    int64_t lda;
    if constexpr (kFloat) {
      a = xGm_.GetPhyAddr(m * t_.k + k0);  // fp32 x is the A operand where it lies
      lda = t_.k;
    } else {
      float* ub = aBuf_.Get<float>().GetPhyAddr();
      for (int64_t r = 0; r < mt; ++r) CastRaw<float, T>(ub + r * t_.kTile, xGm_.GetPhyAddr((m + r) * t_.k + k0), kv);
      a = ub;
      lda = t_.kTile;
    }
    MmadParams p{mt, nt, kv, lda, t_.nTile, t_.nTile, k0 > 0};
    for (int st = 0; st < streams_; ++st)
      MmadNN(cBuf_[st].Get<float>().GetPhyAddr(mt0 * t_.nTile), a, bBuf_[st].Get<float>().GetPhyAddr(), p);
  }

  const QuantSegment* q_ = nullptr;
  int64_t kPad_ = 0;
  TBuf<TPosition::VECCALC> aBuf_, bBuf_[2], cBuf_[2], rowBuf_, scaleBuf_, minBuf_;
};

}  // namespace

void QuantLinearGemm(const void* x, const QuantSegment* segs, const void* residual, const QuantLinearTilingData& t,
                     const SocInfo& soc) {
  LaunchQuantKernel<KernelQuantLinearGemm>(x, segs, residual, t, soc);
}

}  // namespace atb
