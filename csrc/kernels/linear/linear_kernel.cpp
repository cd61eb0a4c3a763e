// Decode-shaped linear (the STREAM kernel; linear_gemm_kernel.cpp has the prefill one): y = x W^T (+ bias) with fused epilogues.
// Each core owns blockFactor consecutive weight rows (across the segments'
// concatenation) and streams them from GM once per pass over x: the cube's B
// operand is read where it lies (on the CPU the L1/L0B copy is the cache),
// while x sits widened to fp32 in UB. Sums are kept per SIMD lane in UB (the
// L0C accumulator) so the result does not depend on how K was tiled: every
// SoC gives the same bits.
#include <algorithm>
#include <type_traits>

#include "ascendc/kernel_operator.h"
#include "linear_io.h"
#include "linear_rows4.h"
#include "linear_tiling.h"

using namespace AscendC;

namespace atb {
namespace {

template <typename T>
class KernelLinear : public LinearStreamIo<T, KernelLinear<T>> {
  using Stream = LinearStreamIo<T, KernelLinear<T>>;
  friend Stream;
  using Stream::t_, Stream::streams_, Stream::pipe_, Stream::xGm_, Stream::wGm_, Stream::sums_;

 public:
  void Init(GM_ADDR x, const LinearSegment* segs, GM_ADDR residual, const LinearTilingData& t) {
    Stream::InitStream(x, segs, residual, t, t.k);
    if (t.m <= Rows4MaxRows(DataTypeOf<T>::value) && Rows4Supported(DataTypeOf<T>::value))
      for (int64_t s = 0; s < t.numSegments; ++s) {
        pieces_[s] = segs[s].rows4Pieces;
        numPieces_[s] = segs[s].numRows4Pieces;
      }
    int64_t mt = t.mTile, nt = t.nTile;
    pipe_.InitBuffer(xBuf_, mt * t.kTile * sizeof(float));
    for (int s = 0; s < streams_; ++s) {
      pipe_.InitBuffer(lanes_[s], mt * nt * 8 * sizeof(float));
      pipe_.InitBuffer(sums_[s], mt * nt * sizeof(float));
    }
  }

 private:
  // One [mt, nt] output tile of segment s, rows [row, row + nt).
  void ProcessTile(int s, int64_t row, int64_t m0, int64_t mt, int64_t nt, bool xResident) {
    int64_t k8 = t_.k / 8 * 8;
    for (int64_t k0 = 0; k0 < t_.k; k0 += t_.kTile) {
      int64_t kl = std::min(t_.kTile, t_.k - k0);
      if (!xResident) CopyInX(m0, mt, k0, kl);
      Compute(s, row, mt, nt, k0, std::max<int64_t>(0, std::min(k0 + kl, k8) - k0));
    }
    // The last K chunk (k0 below) is still in UB: finish with the scalar tail.
    int64_t kLast = (t_.k - 1) / t_.kTile * t_.kTile;
    for (int st = 0; st < streams_; ++st) Finish(st, st == 1 ? 1 : s, row, mt, nt, kLast, k8);
    Stream::OutputSums(s, row, m0, mt, nt);
  }

  void CopyInX(int64_t m0, int64_t mt, int64_t k0, int64_t kl) {
    LocalTensor<float> x = xBuf_.Get<float>();
    for (int64_t m = 0; m < mt; ++m) CastRaw<float, T>(x.GetPhyAddr(m * t_.kTile), xGm_.GetPhyAddr((m0 + m) * t_.k + k0), kl);
  }

  // Cube step: lanes (+)= x[:, k0 : k0 + k8len] . W[row : row + nt, same]^T, per stream.
  void Compute(int s, int64_t row, int64_t mt, int64_t nt, int64_t k0, int64_t k8len) {
    const float* x = xBuf_.Get<float>().GetPhyAddr();
    for (int st = 0; st < streams_; ++st) {
      const int seg = st == 1 ? 1 : s;
      float* lanes = lanes_[st].Get<float>().GetPhyAddr();
      if (const T* group = Rows4Group(seg, row, nt)) {
        MmadRows4Lanes(lanes, x, t_.kTile, group + k0 * kRows4GroupRows, Rows4Ld(t_.k), mt, nt, k8len, k0 > 0);
      } else {
        MmadTableLanes(lanes, x, t_.kTile, wGm_[seg].GetPhyAddr(row * t_.k + k0), t_.k, mt, nt, k8len, k0 > 0);
      }
    }
  }

  // The rows4 group of the tile's first row, where the tile [row, row + nt) lies in one of segment seg's rows4
  // pieces (each grouped from its own first row); else null (the weight is read as it lies).
  const T* Rows4Group(int seg, int64_t row, int64_t nt) const {
    const int64_t ldg = Rows4Ld(t_.k);
    for (int64_t i = 0; i < numPieces_[seg]; ++i) {
      const Rows4Piece& p = pieces_[seg][i];
      if (row >= p.row && row + nt <= p.row + p.rows && (row - p.row) % kRows4GroupRows == 0)
        return static_cast<const T*>(p.data) + (row - p.row) / kRows4GroupRows * ldg;
    }
    return nullptr;
  }

  // The same lanes over the rows4 copy (b: the group of the tile's first row, at k0's chunk).
  static void MmadRows4Lanes(float* lanes, const float* a, int64_t lda, const T* b, int64_t ldg, int64_t m, int64_t n,
                             int64_t k, bool acc) {
    if constexpr (std::is_same<T, float>::value)
      Simd().mmad_nt_lanes_rows4_f32(lanes, a, lda, b, ldg, m, n, k, acc);
    else if constexpr (std::is_same<T, bfloat16_t>::value)  // fp16 has no rows4 kernel (Rows4Supported)
      Simd().mmad_nt_lanes_rows4_bf16(lanes, a, lda, StorageBits(b), ldg, m, n, k, acc);
  }

  static void MmadTableLanes(float* lanes, const float* a, int64_t lda, const T* b, int64_t ldb, int64_t m, int64_t n,
                             int64_t k, bool acc) {
    if constexpr (std::is_same<T, float>::value) {
      Simd().mmad_nt_lanes_f32(lanes, a, lda, b, ldb, m, n, k, acc);
    } else if constexpr (std::is_same<T, half>::value) {
      Simd().mmad_nt_lanes_f16(lanes, a, lda, StorageBits(b), ldb, m, n, k, acc);
    } else {
      Simd().mmad_nt_lanes_bf16(lanes, a, lda, StorageBits(b), ldb, m, n, k, acc);
    }
  }

  // sums[m][n] = lanes reduced + the K % 8 tail (from the last x chunk); the epilogue adds the bias.
  void Finish(int st, int seg, int64_t row, int64_t mt, int64_t nt, int64_t kLast, int64_t k8) {
    const float* l = lanes_[st].Get<float>().GetPhyAddr();
    float* sums = Stream::Sums(st);
    const float* x = xBuf_.Get<float>().GetPhyAddr();
    const T* w = wGm_[seg].GetPhyAddr(row * t_.k);
    // One vector pass over all mt x nt lane groups (a scalar 7-add tree per output was ~20% of a batch-16 decode GEMM).
    Simd().sum_lanes8(sums, l, mt * nt);
    if (k8 < t_.k)
      for (int64_t m = 0; m < mt; ++m)
        for (int64_t n = 0; n < nt; ++n) {
          float v = sums[m * nt + n];
          for (int64_t k = k8; k < t_.k; ++k) v += x[m * t_.kTile + (k - kLast)] * ToFloat(w[n * t_.k + k]);
          sums[m * nt + n] = v;
        }
  }

  TBuf<TPosition::VECCALC> xBuf_, lanes_[2];
  // Per segment: its rows4 pieces where this launch reads them (bf16 / fp32, few rows of x), else none.
  const Rows4Piece* pieces_[kLinearMaxSegments] = {nullptr, nullptr, nullptr};
  int64_t numPieces_[kLinearMaxSegments] = {0, 0, 0};
};

}  // namespace

void Linear(const void* x, int64_t m, int64_t k, const LinearSegment* segs, int64_t numSegments, const void* residual,
            LinearEpilogue ep, DataType dtype, const SocInfo& soc, bool rowInvariant) {
  int64_t rows[kLinearMaxSegments] = {0, 0, 0};
  bool rows4Copies = numSegments >= 1;
  for (int64_t s = 0; s < numSegments && s < kLinearMaxSegments; ++s) {
    rows[s] = segs[s].n;
    rows4Copies = rows4Copies && segs[s].numRows4Pieces > 0;
  }
  LinearTilingData t = LinearTiling(m, k, rows, numSegments, ep, dtype, soc, rowInvariant, rows4Copies);
  if (t.tilingKey / 100 == LINEAR_GEMM) return LinearGemm(x, segs, residual, t, soc);
  LaunchLinearKernel<KernelLinear>(t, soc, GmAddr(x), segs, GmAddr(residual), t);
}

}  // namespace atb
