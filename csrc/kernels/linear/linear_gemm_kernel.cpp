// Prefill-shaped linear (the GEMM kernel): y = x W^T (+ bias) for M >= kLinearGemmMinRows (any M when the
// caller asks for row invariance),
// with the same fused epilogues as the STREAM kernel.
//
// Work units are (row tile of one segment, M pass). For each K chunk a unit packs
// its weight tile W[rows, k0 : k0 + kTile] transposed and widened to fp32 into UB
// (the cube's B operand in L0B), then every mTile rows of x of the pass run through
// the 6x16 register-blocked cube tile (MmadNN) into fp32 accumulators that stay in
// UB across the K chunks (L0C). A weight element is thus converted once per M pass
// and used by up to mPass rows, which is what makes bf16/fp16 weights as fast as fp32.
// Every output element is one fma chain over k in order, so the result does not
// depend on the tiling: every SoC gives the same bits.
//
// bf16 with the dot-product micro-kernel (tiling dpBf16, AVX512-BF16): nothing is
// packed; each mTile rows of x and the unit's weight rows go to mmad_nt_dp_bf16
// where they lie, all of K in one call (its per-element contract then makes the
// result independent of the tiling as well). That call, a [rows, weight rows]
// tile of bf16 x . W^T into fp32, is the micro-kernel's entry for other GEMMs.
#include <algorithm>
#include <type_traits>

#include "ascendc/kernel_operator.h"
#include "linear_io.h"
#include "linear_tiling.h"

using namespace AscendC;

namespace atb {
namespace {

template <typename T>
class KernelLinearGemm : LinearIo<T> {
  static constexpr bool kFloat = std::is_same<T, float>::value;
  using Io = LinearIo<T>;
  using Io::t_, Io::ep_, Io::streams_, Io::pipe_, Io::xGm_, Io::wGm_;

 public:
  void Init(GM_ADDR x, const LinearSegment* segs, GM_ADDR residual, const LinearTilingData& t) {
    Io::InitIo(x, segs, residual, t);
    dp_ = t.dpBf16 != 0;
    for (int st = 0; st < streams_; ++st) {
      if (!dp_) pipe_.InitBuffer(bBuf_[st], t.kTile * t.nTile * sizeof(float));
      pipe_.InitBuffer(cBuf_[st], t.mPass * t.nTile * sizeof(float));
    }
    if (!kFloat && !dp_) pipe_.InitBuffer(aBuf_, t.mTile * t.kTile * sizeof(float));
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
    if (dp_) return ProcessUnitDp(s, row, nt, m0, mp);
    for (int64_t k0 = 0; k0 < t_.k; k0 += t_.kTile) {
      int64_t kl = std::min(t_.kTile, t_.k - k0);
      for (int st = 0; st < streams_; ++st) PackWeight(st, st == 1 ? 1 : s, row, nt, k0, kl);
      for (int64_t mt0 = 0; mt0 < mp; mt0 += t_.mTile) {
        int64_t mt = std::min(t_.mTile, mp - mt0);
        Compute(m0 + mt0, mt0, mt, nt, k0, kl);
      }
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

  // dp: per mTile rows, every stream's [mt, nt] sums in one call each (the weight tile, nt x K, stays in
  // L2 across the pass's row tiles), then the epilogue.
  void ProcessUnitDp(int s, int64_t row, int64_t nt, int64_t m0, int64_t mp) {
    if constexpr (std::is_same<T, bfloat16_t>::value) {
      const auto dp = Simd().mmad_nt_dp_bf16;
      for (int64_t mt0 = 0; mt0 < mp; mt0 += t_.mTile) {
        int64_t mt = std::min(t_.mTile, mp - mt0);
        const uint16_t* a = StorageBits(xGm_.GetPhyAddr((m0 + mt0) * t_.k));
        for (int st = 0; st < streams_; ++st) {
          const uint16_t* w = StorageBits(wGm_[st == 1 ? 1 : s].GetPhyAddr(row * t_.k));
          dp(cBuf_[st].Get<float>().GetPhyAddr(mt0 * t_.nTile), t_.nTile, a, t_.k, w, t_.k, mt, nt, t_.k, false);
        }
        if (ep_ == LINEAR_RESIDUAL) Io::CopyInResidual(row, m0 + mt0, mt, nt);
        float* gate = cBuf_[0].Get<float>().GetPhyAddr(mt0 * t_.nTile);
        float* up = streams_ == 2 ? cBuf_[1].Get<float>().GetPhyAddr(mt0 * t_.nTile) : nullptr;
        Io::Epilogue(s, row, gate, up, t_.nTile, mt, nt);
        Io::CopyOut(s, row, m0 + mt0, mt, nt);
      }
    }
  }

  // B operand: packed[k][n] = fp32(W[row + n][k0 + k]), n < nt, k < kl (columns nt..nTile unused).
  void PackWeight(int st, int seg, int64_t row, int64_t nt, int64_t k0, int64_t kl) {
    float* b = bBuf_[st].Get<float>().GetPhyAddr();
    int64_t ld = t_.nTile;
    for (int64_t n = 0; n < nt; ++n) {
      const T* w = wGm_[seg].GetPhyAddr((row + n) * t_.k + k0);
      for (int64_t k = 0; k < kl; ++k) b[k * ld + n] = ToFloat(w[k]);
    }
  }

  // C[mt0 : mt0 + mt, :nt] (+)= x[m : m + mt, k0 : k0 + kl] . packed, per stream.
  void Compute(int64_t m, int64_t mt0, int64_t mt, int64_t nt, int64_t k0, int64_t kl) {
    const float* a;
    int64_t lda;
    if constexpr (kFloat) {
      a = xGm_.GetPhyAddr(m * t_.k + k0);  // fp32 x is the A operand where it lies
      lda = t_.k;
    } else {
      float* ub = aBuf_.Get<float>().GetPhyAddr();
      for (int64_t r = 0; r < mt; ++r) CastRaw<float, T>(ub + r * t_.kTile, xGm_.GetPhyAddr((m + r) * t_.k + k0), kl);
      a = ub;
      lda = t_.kTile;
    }
    MmadParams p{mt, nt, kl, lda, t_.nTile, t_.nTile, k0 > 0};
    for (int st = 0; st < streams_; ++st)
      MmadNN(cBuf_[st].Get<float>().GetPhyAddr(mt0 * t_.nTile), a, bBuf_[st].Get<float>().GetPhyAddr(), p);
  }

  TBuf<TPosition::VECCALC> aBuf_, bBuf_[2], cBuf_[2];
  bool dp_ = false;
};

}  // namespace

void LinearGemm(const void* x, const LinearSegment* segs, const void* residual, const LinearTilingData& t,
                const SocInfo& soc) {
  LaunchLinearKernel<KernelLinearGemm>(x, segs, residual, t, soc);
}

}  // namespace atb
