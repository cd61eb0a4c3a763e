// Prefill-shaped linear (the GEMM kernel): y = x W^T (+ bias) for M >= kLinearGemmMinRows (any M when the
// caller asks for row invariance),
// with the same fused epilogues as the STREAM kernel.
//
// Work units are (row tile of one segment, M pass). For each K chunk a unit packs
// its weight tile W[rows, k0 : k0 + kTile] transposed and widened to fp32 into UB
// (the cube's B operand in L0B), then every mTile rows of x of the pass (PackedX's blocks) run through
// the 6x16 register-blocked cube tile (MmadTN) into fp32 accumulators that stay in
// UB across the K chunks (L0C). A weight element is thus converted once per M pass
// and used by up to mPass rows, which is what makes bf16/fp16 weights as fast as fp32.
// Every output element is one fma chain over k in order, so the result does not
// depend on the tiling: every SoC gives the same bits.
//
// bf16 with the dot-product micro-kernel (tiling form kDpRows/kDpPacked, AVX512-BF16): nothing is
// packed; each mTile rows of x and the unit's weight rows go to mmad_nt_dp_bf16
// where they lie, all of K in one call (its per-element contract then makes the
// result independent of the tiling as well). That call, a [rows, weight rows]
// tile of bf16 x . W^T into fp32, is the micro-kernel's entry for other GEMMs.
// From kLinearDpPackedMinRows rows on (and under row invariance) the dp tiling is kDpPacked: per K chunk a
// unit packs its weight tile in k pairs (pack_bf16_pairs, bf16 into UB, once per M pass) and every mTile
// rows of x run mmad_dp_bf16_packed against it, accumulating in UB across chunks (a K split at an even k
// changes no bit), which is what prefill's row counts pay the packing for.
#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "ascendc/kernel_operator.h"
#include "linear_io.h"
#include "linear_rows4.h"
#include "linear_tiling.h"

using namespace AscendC;

namespace atb {
namespace {

// The packed-x GEMMs' x operand: floats per `rows` rows of x (whole panels of 16), and the packing of x's rows
// into them: bf16, pack_bf16_pairs' k-pair panels; fp32, k-major panels (Xt[p][k][r], rows past `rows` zero).
template <typename T>
int64_t XPanelFloats(int64_t rows, int64_t k) {
  return CeilDiv(rows, 16) * 16 * (std::is_same<T, float>::value ? k : (k + 1) / 2);
}
template <typename T>
void PackXPanels(float* dst, const T* x, int64_t rows, int64_t k) {
  if constexpr (std::is_same<T, float>::value) {
    for (int64_t p = 0; p * 16 < rows; ++p) {
      float* panel = dst + p * 16 * k;
      const int64_t n = std::min<int64_t>(16, rows - p * 16);
      if (n < 16) std::fill(panel, panel + 16 * k, 0.0f);
      Simd().transpose_f32(panel, 16, x + p * 16 * k, k, n, k);
    }
  } else {
    Simd().pack_bf16_pairs(reinterpret_cast<uint16_t*>(dst), StorageBits(x), k, rows, k);
  }
}

template <typename T>
class KernelLinearGemm : public LinearGemmIo<T, KernelLinearGemm<T>> {
  using Gemm = LinearGemmIo<T, KernelLinearGemm<T>>;
  friend Gemm;
  using typename Gemm::GemmUnit;
  using Gemm::t_, Gemm::ep_, Gemm::streams_, Gemm::xGm_, Gemm::wGm_, Gemm::bBuf_, Gemm::cBuf_;

 public:
  void Init(GM_ADDR x, const float* xPacked, const LinearSegment* segs, GM_ADDR residual, const LinearTilingData& t) {
    form_ = t.form;
    Gemm::InitGemm(x, xPacked, segs, residual, t, t.k, form_ == kF32Tiles);
    if (form_ == kPackedX && Rows4PackedX(DataTypeOf<T>::value, t.k))
      for (int64_t s = 0; s < t.numSegments; ++s) {
        pieces_[s] = segs[s].rows4Pieces;
        numPieces_[s] = segs[s].numRows4Pieces;
      }
    if (form_ == kDpPacked) Gemm::InitDpPacked();
  }

 private:
  void ProcessUnit(const GemmUnit& u) {
    if (form_ == kDpPacked) return Gemm::ProcessDpPackedUnit(u);
    if (form_ == kPackedX) return ProcessUnitPackedX(u);
    if (form_ == kDpRows) return ProcessUnitDp(u);
    Gemm::ProcessPackedUnit(u);
  }

  // dp: per mTile rows, every stream's [mt, nt] sums in one call each (the weight tile, nt x K, stays in
  // L2 across the pass's row tiles), then the epilogue.
  void ProcessUnitDp(const GemmUnit& u) {
    if constexpr (std::is_same<T, bfloat16_t>::value) {
      const auto dp = Simd().mmad_nt_dp_bf16;
      for (int64_t mt0 = 0; mt0 < u.mp; mt0 += t_.mTile) {
        int64_t mt = std::min(t_.mTile, u.mp - mt0);
        const uint16_t* a = StorageBits(xGm_.GetPhyAddr((u.m0 + mt0) * t_.k));
        for (int st = 0; st < streams_; ++st) {
          const uint16_t* w = StorageBits(wGm_[st == 1 ? 1 : u.s].GetPhyAddr(u.row * t_.k));
          dp(cBuf_[st].template Get<float>().GetPhyAddr(mt0 * t_.nTile), t_.nTile, a, t_.k, w, t_.k, mt, u.nt, t_.k,
             false);
        }
        Gemm::OutputRows(u, mt0, mt);
      }
    }
  }

  // kPackedX (bf16: mmad_dp_bf16_packed_x; fp32: mmad_packed_x_f32): the pass's rows of x in panels of 16,
  // packed by each block for itself at its first unit of the pass (PackXPanels into the thread's own buffer),
  // then every stream's weight rows read once into all of the pass's sums, and the epilogue per mTile rows.
  // Each core packs all of the pass's x (a few dozen KiB, read-only input) rather than the caller packing one
  // shared copy before the launch: that serial copy ran 3x slower than on one thread, every store invalidating
  // the line the other core had read in the previous call, and the helper then pulled all of it from the
  // caller's cache in its first block. Zen 4, 2 threads, bf16, M = 16, 576 x 1536 hot, per call: the shared
  // pack took 9 us of 107 (one thread alone: 2.7 us of 183); per call this is 74-76 us against 80-111. SmolLM2
  // batch-16 decode graph, in-process interleaved rounds, shared / per-core step time: bf16 median 1.06 (40
  // rounds), fp32 1.01 (12), the same tokens.
  void ProcessUnitPackedX(const GemmUnit& u) {
    if constexpr (!std::is_same<T, half>::value) {
      thread_local std::vector<float> own;
      if (u.m0 != packedM0_) {
        own.resize(size_t(XPanelFloats<T>(u.mp, t_.k)));
        PackXPanels<T>(own.data(), xGm_.GetPhyAddr(u.m0 * t_.k), u.mp, t_.k);
        packedM0_ = u.m0;
      }
      const float* xp = own.data();
      for (int st = 0; st < streams_; ++st) {
        const int seg = st == 1 ? 1 : u.s;
        float* c = cBuf_[st].template Get<float>().GetPhyAddr();
        // The unit's rows run by run: each run that lies in a rows4 piece from there, the rest as they lie.
        for (int64_t row = u.row, end = u.row + u.nt; row < end;) {
          int64_t n = end - row;
          const T* group = Rows4Run(seg, row, n);
          if (group) {
            if constexpr (std::is_same<T, float>::value)
              Simd().mmad_packed_x_rows4_f32(c + (row - u.row), t_.nTile, xp, group, Rows4Ld(t_.k), u.mp, n, t_.k);
            else
              Simd().mmad_dp_bf16_packed_x_rows4(c + (row - u.row), t_.nTile, reinterpret_cast<const uint16_t*>(xp),
                                                 StorageBits(group), Rows4Ld(t_.k), u.mp, n, t_.k);
          } else {
            const T* w = wGm_[seg].GetPhyAddr(row * t_.k);
            if constexpr (std::is_same<T, float>::value)
              Simd().mmad_packed_x_f32(c + (row - u.row), t_.nTile, xp, w, t_.k, u.mp, n, t_.k, false);
            else
              Simd().mmad_dp_bf16_packed_x(c + (row - u.row), t_.nTile, reinterpret_cast<const uint16_t*>(xp),
                                           StorageBits(w), t_.k, u.mp, n, t_.k, false);
          }
          row += n;
        }
      }
      for (int64_t mt0 = 0; mt0 < u.mp; mt0 += t_.mTile) Gemm::OutputRows(u, mt0, std::min(t_.mTile, u.mp - mt0));
    }
  }

  // The rows4 group of row `row` of segment seg where a piece holds it at a group's start; n shrinks to the
  // rows from there that the piece holds. Otherwise null, and n shrinks to the rows before the next piece.
  const T* Rows4Run(int seg, int64_t row, int64_t& n) const {
    int64_t next = row + n;
    for (int64_t i = 0; i < numPieces_[seg]; ++i) {
      const Rows4Piece& p = pieces_[seg][i];
      if (row >= p.row && row < p.row + p.rows && (row - p.row) % kRows4GroupRows == 0) {
        n = std::min(n, p.row + p.rows - row);
        return static_cast<const T*>(p.data) + (row - p.row) / kRows4GroupRows * Rows4Ld(t_.k);
      }
      if (p.row > row) next = std::min(next, p.row);
    }
    n = next - row;
    return nullptr;
  }

  // kDpPacked's B operand: the weight rows as they lie, packed in k pairs.
  void PackPairs(int /*st*/, int seg, int64_t row, int64_t nt, int64_t k0, int64_t kv, uint16_t* dst) {
    Simd().pack_bf16_pairs(dst, StorageBits(wGm_[seg].GetPhyAddr(row * t_.k + k0)), t_.k, nt, kv);
  }
  void DpMmad(int /*st*/, int64_t /*m0*/, int64_t /*k0*/, float* c, int64_t ldc, const uint16_t* a, int64_t lda, const uint16_t* bp, int64_t mt,
              int64_t nt, int64_t kv, bool acc) {
    Simd().mmad_dp_bf16_packed(c, ldc, a, lda, bp, mt, nt, kv, acc);
  }

  // B operand: packed[k][n] = fp32(W[row + n][k0 + k]), n < nt, k < kl (columns nt..nTile unused; float
  // weights have no padding: kv = kl).
  void PackWeight(int st, int seg, int64_t row, int64_t nt, int64_t k0, int64_t kl, int64_t /*kv*/) {
    float* b = bBuf_[st].template Get<float>().GetPhyAddr();
    const T* w = wGm_[seg].GetPhyAddr(row * t_.k + k0);
    if constexpr (std::is_same<T, float>::value) Simd().transpose_f32(b, t_.nTile, w, t_.k, nt, kl);
    else if constexpr (std::is_same<T, half>::value) Simd().transpose_f16(b, t_.nTile, StorageBits(w), t_.k, nt, kl);
    else Simd().transpose_bf16(b, t_.nTile, StorageBits(w), t_.k, nt, kl);
  }

  int64_t form_ = kF32Tiles;
  // kPackedX: per segment, its rows4 pieces (none: the weights as they lie).
  const Rows4Piece* pieces_[kLinearMaxSegments] = {nullptr, nullptr, nullptr};
  int64_t numPieces_[kLinearMaxSegments] = {0, 0, 0};
  int64_t packedM0_ = -1;  // kPackedX: the first x row of the pass this block's panels hold (-1: none yet)
};

// PackedX blocks [first, last) of x into dst: this core's share.
template <typename T>
void PackBlocks(float* dst, const void* x, int64_t m, int64_t k) {
  int64_t blocks = CeilDiv(m, kPackedXRows), per = CeilDiv(blocks, GetBlockNum());
  int64_t first = GetBlockIdx() * per, last = std::min(blocks, first + per);
  for (int64_t b = first; b < last; ++b) {
    float* block = dst + b * kPackedXRows * k;
    int64_t rows = std::min(kPackedXRows, m - b * kPackedXRows);
    if (rows < kPackedXRows) std::fill(block, block + kPackedXRows * k, 0.0f);
    const T* src = static_cast<const T*>(x) + b * kPackedXRows * k;
    if constexpr (std::is_same<T, float>::value) Simd().transpose_f32(block, kPackedXRows, src, k, rows, k);
    else if constexpr (std::is_same<T, half>::value) Simd().transpose_f16(block, kPackedXRows, StorageBits(src), k, rows, k);
    else Simd().transpose_bf16(block, kPackedXRows, StorageBits(src), k, rows, k);
  }
}

}  // namespace

const float* PackedX(const void* x, int64_t m, int64_t k, DataType dtype, const SocInfo& soc) {
  thread_local std::vector<float> workspace;
  int64_t blocks = CeilDiv(m, kPackedXRows);
  size_t need = size_t(blocks * kPackedXRows * k);
  if (workspace.capacity() * sizeof(float) > size_t(kWidenKeepBytes) && need * sizeof(float) <= size_t(kWidenKeepBytes))
    std::vector<float>().swap(workspace);
  if (workspace.size() < need) workspace.resize(need);
  float* dst = workspace.data();
  // Blocks of at least 16 rows' worth per core (a core's share pays for its dispatch).
  int64_t cores = std::max<int64_t>(1, std::min(soc.vector_core_num, CeilDiv(m, 16)));
  KernelLaunch(cores, soc.ub_size, [&]() {
    switch (dtype) {
      case DataType::FLOAT32: return PackBlocks<float>(dst, x, m, k);
      case DataType::FLOAT16: return PackBlocks<half>(dst, x, m, k);
      case DataType::BFLOAT16: return PackBlocks<bfloat16_t>(dst, x, m, k);
    }
  });
  return dst;
}

void LinearGemm(const void* x, const LinearSegment* segs, const void* residual, const LinearTilingData& t,
                const SocInfo& soc) {
  const float* xPacked = t.form != kF32Tiles ? nullptr : PackedX(x, t.m, t.k, DataType(t.tilingKey / 10 % 10), soc);
  LaunchLinearKernel<KernelLinearGemm>(t, soc, GmAddr(x), xPacked, segs, GmAddr(residual), t);
}

}  // namespace atb
