// Flash attention on the AscendC-style CPU core.
//
// A unit is `rows` = positions x heads query rows of one sequence that share
// one kv head. The host first copies every K/V tile's rows together, widened
// to fp32, once per call for all units (PrepareKVTilesF32, a GM workspace): a
// unit reads its tiles from there as the cube reads L1, never copying one.
// Per unit:
//   ComputeQ   Q rows, read where they lie, scaled by `scale` in fp32 and stored
//              transposed (qT [D][rows]): the cube's B operand, loaded once with
//              its transpose as LoadData does into L0B, then reused by every K tile.
//   per K/V tile of blockKv keys (tiles nobody in the unit can see are skipped):
//     Scores     S^T [keys][rows] = K . Q^T          (Mmad, K as the A operand)
//     Softmax    masked entries = -inf; running max m, sum l in fp32:
//                m' = max(m, max_k S), P = exp(S - m'), l = l e^(m-m') + sum_k P
//                Keys run down S^T's rows and query rows along them, so every
//                reduction over keys is a vertical SIMD op over `rows` lanes.
//     PV         acc = acc e^(m-m') + P . V           (Mmad TN: P^T as stored)
//   CopyOut    out = acc / l, cast to T straight into the output rows.
// Only the tiles are ever in memory: UB use is O(rows x (D + blockKv)).
//
// bf16 where the SIMD table has the AVX512-BF16 entries (tiling dpBf16; vdpbf16ps, on AMX tables the same
// entries on tiles), both products are bf16 GEMMs over packed operands, summing in fp32, over 128-key tiles
// the host prepares once per call for all units (PrepareKVTiles, a GM workspace): each tile's K rows copied
// together and its V transposed (transpose_b16). Nothing per tile is copied, widened or transposed:
//   Scores  S^T = K . Q^T: the tile's K rows as the A operand, Q packed in k pairs once per unit
//           (pack_bf16_pairs) as B; unscaled where SoftmaxDp folds the scale into its exp.
//   Softmax the column max, then one pass (exp_pack_pairs_bf16) that computes P, sums it into l and packs it,
//           rounded to bf16 as SDPA's CPU flash attention does for its second GEMM, in k pairs as PV's B;
//           the reference max moves only past ln 256 (SoftmaxDp), so the rescale almost never runs.
//   PV      acc^T [D][rows] += V^T . P, A the tile's V^T [D][keys].
// The accumulator is therefore acc^T: the rescale by alpha runs along its rows, and CopyOut transposes it
// back, divides by l and rounds in one pass (store_t_scaled_bf16). Twice the multiply-adds per instruction of
// the fp32 cube on vdpbf16ps, ~8x on AMX.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>

#include "ascendc/kernel_operator.h"
#include "flash_attention_tiling.h"

using namespace AscendC;

namespace atb {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

template <typename T>
class KernelFlashAttention {
 public:
  void Init(GM_ADDR out, GM_ADDR q, const int32_t* cuSeqlens,
            const FlashAttentionStrides& strides, const FlashAttentionTilingData& t, const FlashAttentionVT& vt) {
    t_ = &t;
    vt_ = vt;
    st_ = strides;
    cu_ = cuSeqlens;
    outGm_.SetGlobalBuffer(reinterpret_cast<T*>(out));
    qGm_.SetGlobalBuffer(reinterpret_cast<T*>(q));
    int64_t rows = t.maxRows, d = t.headDim, ld = t.ubRowElems, bk = t.blockKv;
    if constexpr (std::is_same<T, bfloat16_t>::value) dp_ = vt.vT != nullptr;
    expScale_ = dp_ && t.scale > 0.0f && t.scale <= 1.0f ? t.scale : 1.0f;
    // Q packed in k pairs (pack_bf16_pairs, 16-row panels) where that fits the UB of the fp32 qT it replaces.
    qPacked_ = dp_ && AlignUp(rows, 16) * AlignUp(d, 2) * 2 <= rows * d * int64_t(sizeof(float));
    pipe_.InitBuffer(qT_, rows * d * sizeof(float));
    pipe_.InitBuffer(acc_, rows * d * sizeof(float));
    pipe_.InitBuffer(s_, bk * rows * sizeof(float));
    if (dp_) {
      pipe_.InitBuffer(io_, rows * ld * sizeof(T));
      pipe_.InitBuffer(pPacked_, FlashAttentionPackedPBytes(rows, bk));
    }
    pipe_.InitBuffer(stats_, 6 * rows * sizeof(float));
  }

  void Process() {
    int64_t core = GetBlockIdx();
    for (int64_t i = t_->coreStart[core]; i < t_->coreStart[core + 1]; ++i) ProcessUnit(t_->units[i]);
  }

 private:
  void ProcessUnit(const FlashAttentionUnit& u) {
    int64_t seqStart = cu_[u.seq], seqLen = cu_[u.seq + 1] - seqStart;
    rows_ = u.qLen * t_->groupSplit;
    firstHead_ = u.kvHead * t_->groupSize + u.headOffset;
    if (dp_) CopyInQ(seqStart + u.qStart);
    else ComputeQ(seqStart + u.qStart);
    if constexpr (std::is_same<T, bfloat16_t>::value)
      if (qPacked_)
        Simd().pack_bf16_pairs(qT_.Get<uint16_t>().GetPhyAddr(), StorageBits(io_.Get<T>().GetPhyAddr()),
                               t_->ubRowElems, rows_, t_->headDim);
    Duplicate(stats_.Get<float>(), kNegInf, rows_);              // m
    Duplicate(stats_.Get<float>()[4 * rows_], 0.0f, rows_);      // l
    Duplicate(acc_.Get<float>(), 0.0f, rows_ * t_->headDim);
    int64_t first, last;
    FlashAttentionKvTiles(u.qStart, u.qLen, seqLen, t_->blockKv, t_->causal, t_->window, &first, &last);
    for (int64_t j = first; j < last; ++j) {
      int64_t kvStart = j * t_->blockKv, nk = std::min(t_->blockKv, seqLen - kvStart);
      // Causal: keys past the unit's last query are masked for all its rows; the tile stops at the next multiple
      // of 32 (whole AMX chunks) after them. Exact: those keys' P are 0 and add nothing anywhere.
      if (t_->causal) nk = std::min(nk, AlignUp(u.qStart + u.qLen - kvStart, int64_t(32)));
      const int64_t tile =
          FlashAttentionVTOffset(vt_.tileBase[u.seq] + j, u.kvHead, t_->numKvHeads, t_->headDim, t_->blockKv);
      if (dp_) {
        ScoresDp(vt_.kTiles + tile, nk);
        Mask(u.qStart, kvStart, nk);
        SoftmaxDp(nk);
        PVDp(vt_.vT + tile, nk);
        continue;
      }
      Scores(vt_.kF + tile, nk);
      Mask(u.qStart, kvStart, nk);
      Softmax(nk);
      PV(vt_.vF + tile, nk);
    }
    CopyOut(seqStart + u.qStart);
  }

  // The unit's Q rows, position-major (row m = position m / gs, head m % gs),
  // into io (the bf16 GEMM path packs them from there); each row is D
  // contiguous elements at its token and head stride.
  void CopyInQ(int64_t token0) {
    LocalTensor<T> io = io_.Get<T>();
    int64_t gs = t_->groupSplit, elt = sizeof(T), ld = t_->ubRowElems;
    DataCopyParams p{gs, t_->headDim * elt, (st_.qHead - t_->headDim) * elt, 0};
    for (int64_t pos = 0; pos * gs < rows_; ++pos)
      DataCopyPad(io[pos * gs * ld], qGm_[(token0 + pos) * st_.qToken + firstHead_ * st_.qHead], p);
  }

  // qT[d][m] = scale * q[m][d] in fp32, the rows (as CopyInQ orders them) read
  // where they lie; acc is free until the first P.V, so the widened rows pass
  // through it on their way to the transpose.
  void ComputeQ(int64_t token0) {
    const int64_t d = t_->headDim, gs = t_->groupSplit;
    float* tmp = acc_.Get<float>().GetPhyAddr();
    float* qt = qT_.Get<float>().GetPhyAddr();
    for (int64_t m = 0; m < rows_; ++m) {
      const T* q = qGm_.GetPhyAddr((token0 + m / gs) * st_.qToken + (firstHead_ + m % gs) * st_.qHead);
      float* row = tmp + m * d;
      if constexpr (std::is_same<T, float>::value) {
        Simd().muls(row, q, t_->scale, d);
      } else {
        CastRaw<float, T>(row, q, d);
        Simd().muls(row, row, t_->scale, d);
      }
    }
    const float* src = tmp;
    for (int64_t m = 0; m < rows_; ++m)
      for (int64_t i = 0; i < d; ++i) qt[i * rows_ + m] = src[m * d + i];
  }

  // S^T[n][m] = sum_d K[n][d] * qT[d][m]; kf: the tile's fp32 K rows, headDim apart.
  void Scores(const float* kf, int64_t nk) {
    MmadParams p{nk, rows_, t_->headDim, t_->headDim, rows_, rows_, false};
    MmadNN<float>(s_.Get<float>().GetPhyAddr(), kf, qT_.Get<float>().GetPhyAddr(), p);
  }

  // S^T[n][m] = sum_d K[n][d] * Q[m][d] (scaled here unless SoftmaxDp folds the scale), K the tile's nk rows
  // as the host copied them, headDim apart.
  void ScoresDp(const uint16_t* k, int64_t nk) {
    if constexpr (std::is_same<T, bfloat16_t>::value) {
      float* st = s_.Get<float>().GetPhyAddr();
      const int64_t d = t_->headDim;
      if (qPacked_)
        Simd().mmad_dp_bf16_packed(st, rows_, k, d, qT_.Get<uint16_t>().GetPhyAddr(), nk, rows_, d, false);
      else
        Simd().mmad_nt_dp_bf16(st, rows_, k, d, StorageBits(io_.Get<T>().GetPhyAddr()), t_->ubRowElems, nk, rows_,
                               d, false);
      if (expScale_ != t_->scale) Simd().muls(st, st, t_->scale, nk * rows_);
    }
  }

  // Key n (position kvStart + n) is visible to rows [lo, hi): causal hides it
  // from earlier positions, a window from positions window or more after it
  // (and, without causal, window or more before it). Rows are position-major,
  // so both bounds are contiguous ranges of S^T's row n.
  void Mask(int64_t qStart, int64_t kvStart, int64_t nk) {
    bool causal = t_->causal;
    int64_t w = t_->window, gs = t_->groupSplit;
    if (!causal && w == 0) return;
    LocalTensor<float> s = s_.Get<float>();
    auto clampRows = [&](int64_t pos) { return std::min<int64_t>(rows_, std::max<int64_t>(0, pos * gs)); };
    for (int64_t n = 0; n < nk; ++n) {
      int64_t kp = kvStart + n - qStart;  // key position relative to the unit's first query
      int64_t lo = 0, hi = rows_;
      if (causal) lo = clampRows(kp);
      if (w > 0) {
        hi = clampRows(kp + w);
        if (!causal) lo = clampRows(kp - w + 1);
      }
      if (lo >= hi) {
        Duplicate(s[n * rows_], kNegInf, rows_);
        continue;
      }
      if (lo > 0) Duplicate(s[n * rows_], kNegInf, lo);
      if (hi < rows_) Duplicate(s[n * rows_ + hi], kNegInf, rows_ - hi);
    }
  }

  // Online softmax over this tile's keys, vertical over the rows. A row that
  // has seen no visible key yet has m' = -inf; it subtracts 0 instead (the
  // "safe" max), so its P and alpha are exp(-inf) = 0 exactly, never NaN.
  void Softmax(int64_t nk) {
    LocalTensor<float> stats = stats_.Get<float>(), s = s_.Get<float>();
    LocalTensor<float> m = stats, mNew = stats[rows_], mSafe = stats[2 * rows_], alpha = stats[3 * rows_];
    LocalTensor<float> l = stats[4 * rows_], lTile = stats[5 * rows_];
    DataCopy(mNew, m, rows_);
    PoisonNanRows(nk, ColMax(mNew, s, rows_, nk, rows_));
    for (int64_t r = 0; r < rows_; ++r) mSafe(r) = mNew(r) == kNegInf ? 0.0f : mNew(r);
    Sub(alpha, m, mSafe, rows_);
    Exp(alpha, alpha, rows_);
    Duplicate(lTile, 0.0f, rows_);
    ExpSubAcc(s, s, rows_, mSafe, lTile, nk, rows_);
    Mul(l, l, alpha, rows_);
    Add(l, l, lTile, rows_);
    DataCopy(m, mNew, rows_);
    // acc *= alpha, skipped for the (most) rows whose max did not move: alpha is exactly 1 there.
    LocalTensor<float> acc = acc_.Get<float>();
    int64_t d = t_->headDim;
    for (int64_t r = 0; r < rows_; ++r)
      if (alpha(r) != 1.0f) Muls(acc[r * d], acc[r * d], alpha(r), d);
  }

  // The bf16 path's online softmax: as Softmax, over scores not yet scaled where the scale folds into the
  // exp (expScale_: max(scale x) = scale max(x) for 0 < scale <= 1, and scale x cannot overflow), in two
  // passes over the tile: the max, then P = 2^(s c - m c) with c = scale log2 e (one fma) summed and packed
  // in k pairs as PV's B operand straight from the scores (exp_pack_pairs_bf16).
  // The max a row's P are taken against moves only when the tile's exceeds it by more than ln 256 (in scaled
  // units), so P <= 256: acc^T and l are then rescaled (alpha != 1) on almost no tile rather than whenever a
  // row's max creeps up. The result is the same softmax (every P and l against one reference), rounded alike:
  // P's bf16 rounding is relative, and l and acc stay far from fp32's range.
  void SoftmaxDp(int64_t nk) {
    constexpr float kRescaleLog2 = 8.0f;  // log2 256
    const float c = expScale_ * 1.44269504088896341f;
    LocalTensor<float> stats = stats_.Get<float>();
    LocalTensor<float> m = stats, mNew = stats[rows_], bias = stats[2 * rows_], alpha = stats[3 * rows_];
    LocalTensor<float> l = stats[4 * rows_], lTile = stats[5 * rows_];
    DataCopy(mNew, m, rows_);
    PoisonNanRows(nk, ColMax(mNew, s_.Get<float>(), rows_, nk, rows_));
    bool rescale = false;
    for (int64_t r = 0; r < rows_; ++r) {
      const float old = m(r), tileMax = mNew(r);
      const bool move = old == kNegInf || !((tileMax - old) * c <= kRescaleLog2);  // (NaN: a +inf max)
      const float ref = move ? tileMax : old;
      bias(r) = -(c * (ref == kNegInf ? 0.0f : ref));
      alpha(r) = move ? std::exp2(std::fma(old, c, bias(r))) : 1.0f;  // exp2(-inf) = 0
      rescale |= move;
      m(r) = ref;
    }
    Duplicate(lTile, 0.0f, rows_);
    Simd().exp_pack_pairs_bf16(pPacked_.Get<uint16_t>().GetPhyAddr(), lTile.GetPhyAddr(),
                               s_.Get<float>().GetPhyAddr(), rows_, bias.GetPhyAddr(), c, nk, rows_);
    if (rescale) Mul(l, l, alpha, rows_);
    Add(l, l, lTile, rows_);
    // acc^T: every row of it takes alpha along its columns (blocks whose alpha are all exactly 1 skipped).
    if (rescale) Simd().mul_cols(acc_.Get<float>().GetPhyAddr(), rows_, alpha.GetPhyAddr(), t_->headDim, rows_);
  }

  // NaN must reach the output as in SDPA, but the max skips a NaN score and the
  // exp gives 0 for it, so neither carries it. The max pass reports whether the
  // masked score tile holds a NaN (NaN in q or in a visible key); only then are
  // the rows summed one by one to find which get l = NaN. A +inf max (SDPA:
  // exp(inf - inf) = NaN) poisons its row too.
  void PoisonNanRows(int64_t nk, bool anyNan) {
    LocalTensor<float> stats = stats_.Get<float>();
    LocalTensor<float> mNew = stats[rows_], l = stats[4 * rows_];
    const float* s = s_.Get<float>().GetPhyAddr();
    constexpr float kNan = std::numeric_limits<float>::quiet_NaN();
    if (anyNan) {
      for (int64_t r = 0; r < rows_; ++r) {
        float sum = 0.0f;
        for (int64_t n = 0; n < nk; ++n) sum += s[n * rows_ + r];
        if (std::isnan(sum)) l(r) = kNan;
      }
    }
    for (int64_t r = 0; r < rows_; ++r)
      if (mNew(r) == -kNegInf) l(r) = kNan;
  }

  // acc[m][d] += sum_n P^T[n][m] * V[n][d]; vf: the tile's fp32 V rows, headDim apart.
  void PV(const float* vf, int64_t nk) {
    MmadParams p{rows_, t_->headDim, nk, rows_, t_->headDim, t_->headDim, true};
    MmadTN(acc_.Get<float>().GetPhyAddr(), s_.Get<float>().GetPhyAddr(), vf, p);
  }

  // acc^T[d][m] += sum_n V^T[d][n] * bf16(P^T[n][m]) (P packed by SoftmaxDp); vT: the tile's V^T [D][blockKv].
  void PVDp(const uint16_t* vT, int64_t nk) {
    const uint16_t* pp = pPacked_.Get<uint16_t>().GetPhyAddr();
    Simd().mmad_dp_bf16_packed(acc_.Get<float>().GetPhyAddr(), rows_, vT, t_->blockKv, pp, t_->headDim, rows_, nk,
                               true);
  }

  void CopyOut(int64_t token0) {
    const int64_t d = t_->headDim, gs = t_->groupSplit;
    LocalTensor<float> acc = acc_.Get<float>(), l = stats_.Get<float>()[4 * rows_];
    if (dp_) {  // acc^T / l, transposed back to rows and rounded in one pass, straight to the output
      if constexpr (std::is_same<T, bfloat16_t>::value) {
        LocalTensor<float> inv = stats_.Get<float>()[rows_];
        for (int64_t r = 0; r < rows_; ++r) inv(r) = 1.0f / l(r);
        auto* out = reinterpret_cast<uint16_t*>(outGm_[(token0 * t_->numHeads + firstHead_) * d].GetPhyAddr());
        Simd().store_t_scaled_bf16(out, d, gs, t_->numHeads * d, acc.GetPhyAddr(), rows_, inv.GetPhyAddr(), rows_, d);
      }
      return;
    }
    // acc / l, rounded straight into the output rows (row r: position r / gs, head r % gs).
    for (int64_t r = 0; r < rows_; ++r) {
      T* out = outGm_.GetPhyAddr(((token0 + r / gs) * t_->numHeads + firstHead_ + r % gs) * d);
      float* a = acc.GetPhyAddr(r * d);
      if constexpr (std::is_same<T, float>::value) {
        Simd().muls(out, a, 1.0f / l(r), d);
      } else {
        Simd().muls(a, a, 1.0f / l(r), d);
        CastRaw<T, float>(out, a, d);
      }
    }
  }

  const FlashAttentionTilingData* t_ = nullptr;
  FlashAttentionStrides st_{};
  const int32_t* cu_ = nullptr;
  int64_t rows_ = 0, firstHead_ = 0;
  FlashAttentionVT vt_{};
  bool dp_ = false;       // bf16 Scores and PV as bf16 GEMMs (ScoresDp, PVDp; acc holds acc^T), else the fp32 Mmads
  bool qPacked_ = false;  // dp Scores over Q packed in k pairs once per unit (mmad_dp_bf16_packed)
  float expScale_ = 1.0f; // the scale SoftmaxDp folds into its exp (1: ScoresDp scaled the scores)
  TPipe pipe_;
  TBuf<TPosition::VECCALC> qT_, acc_, io_, s_, pPacked_, stats_;
  GlobalTensor<T> outGm_, qGm_;
};

// Calls tile(offset, k row 0, v row 0, keys) for the K/V workspace's items (tile, kv head), split evenly over the
// blocks; offset: the item's elements before it in the workspace (FlashAttentionVTOffset).
template <typename T, typename F>
void ForKVTiles(const int64_t* tileBase, const T* k, const T* v, const int32_t* cu, int64_t batch,
                const FlashAttentionStrides& st, const FlashAttentionTilingData& t, F&& tile) {
  const int64_t kvh = t.numKvHeads, bk = t.blockKv, items = tileBase[batch] * kvh;
  const int64_t blk = GetBlockIdx(), blocks = GetBlockNum();
  int64_t b = 0;
  for (int64_t i = items * blk / blocks; i < items * (blk + 1) / blocks; ++i) {
    const int64_t g = i / kvh, h = i % kvh;
    while (tileBase[b + 1] <= g) ++b;
    const int64_t kv0 = (g - tileBase[b]) * bk, nk = std::min(bk, int64_t(cu[b + 1] - cu[b]) - kv0);
    tile(FlashAttentionVTOffset(g, h, kvh, t.headDim, bk), k + (cu[b] + kv0) * st.kToken + h * st.kHead,
         v + (cu[b] + kv0) * st.vToken + h * st.vHead, nk);
  }
}

// The bf16 GEMM path's workspace: each tile's K rows copied together and its V transposed, zero past the
// sequence's keys.
void PrepareKVTilesDp(uint16_t* kTiles, uint16_t* vT, const int64_t* tileBase, const uint16_t* k, const uint16_t* v,
                      const int32_t* cu, int64_t batch, const FlashAttentionStrides& st,
                      const FlashAttentionTilingData& t) {
  const int64_t d = t.headDim, bk = t.blockKv;
  ForKVTiles(tileBase, k, v, cu, batch, st, t, [&](int64_t off, const uint16_t* kSrc, const uint16_t* vSrc, int64_t nk) {
    for (int64_t r = 0; r < nk; ++r) std::memcpy(kTiles + off + r * d, kSrc + r * st.kToken, size_t(d) * 2);
    uint16_t* dst = vT + off;
    Simd().transpose_b16(dst, bk, vSrc, st.vToken, nk, d);
    for (int64_t r = 0; nk < bk && r < d; ++r) std::fill(dst + r * bk + nk, dst + (r + 1) * bk, uint16_t(0));
  });
}

// The fp32 path's workspace: each tile's K and V rows together, widened to fp32 (rows past the sequence's keys
// are never read).
template <typename T>
void PrepareKVTilesF32(float* kF, float* vF, const int64_t* tileBase, const T* k, const T* v, const int32_t* cu,
                       int64_t batch, const FlashAttentionStrides& st, const FlashAttentionTilingData& t) {
  const int64_t d = t.headDim;
  ForKVTiles(tileBase, k, v, cu, batch, st, t, [&](int64_t off, const T* kSrc, const T* vSrc, int64_t nk) {
    for (int64_t r = 0; r < nk; ++r) {
      CastRaw<float, T>(kF + off + r * d, kSrc + r * st.kToken, d);
      CastRaw<float, T>(vF + off + r * d, vSrc + r * st.vToken, d);
    }
  });
}

// One call in storage type T: its K/V tile workspace (buffers kept per calling thread: no page faults per
// call), then the kernel.
template <typename T>
void LaunchFlashAttention(void* out, const void* q, const void* k, const void* v, const int32_t* cu, int64_t batch,
                          const FlashAttentionStrides& st, const FlashAttentionTilingData& t, const SocInfo& soc) {
  thread_local std::vector<int64_t> tileBase;
  tileBase.assign(size_t(batch + 1), 0);
  for (int64_t b = 0; b < batch; ++b) tileBase[b + 1] = tileBase[b] + CeilDiv(cu[b + 1] - cu[b], t.blockKv);
  const size_t tileElems = size_t(tileBase[batch] * t.numKvHeads * t.headDim * t.blockKv);
  // (the pointers taken here: inside the launched lambdas these thread_locals would name the workers' own)
  FlashAttentionVT vt;
  vt.tileBase = tileBase.data();
  const auto* kT = static_cast<const T*>(k);
  const auto* vTyped = static_cast<const T*>(v);
  if (t.dpBf16) {
    if constexpr (std::is_same<T, bfloat16_t>::value) {
      thread_local std::vector<uint16_t> vTBuf, kBuf;
      vTBuf.resize(tileElems);
      kBuf.resize(tileElems);
      uint16_t *vT = vTBuf.data(), *kTiles = kBuf.data();
      KernelLaunch(t.blockDim, soc.ub_size, [&]() {
        PrepareKVTilesDp(kTiles, vT, vt.tileBase, StorageBits(kT), StorageBits(vTyped), cu, batch, st, t);
      });
      vt.vT = vT;
      vt.kTiles = kTiles;
    }
  } else {
    thread_local std::vector<float> kFBuf, vFBuf;
    kFBuf.resize(tileElems);
    vFBuf.resize(tileElems);
    float *kF = kFBuf.data(), *vF = vFBuf.data();
    KernelLaunch(t.blockDim, soc.ub_size,
                 [&]() { PrepareKVTilesF32(kF, vF, vt.tileBase, kT, vTyped, cu, batch, st, t); });
    vt.kF = kF;
    vt.vF = vF;
  }
  GM_ADDR outGm = reinterpret_cast<GM_ADDR>(out), qGm = reinterpret_cast<GM_ADDR>(const_cast<void*>(q));
  KernelLaunch(t.blockDim, soc.ub_size, [&]() {
    KernelFlashAttention<T> op;
    op.Init(outGm, qGm, cu, st, t, vt);
    op.Process();
  });
}

}  // namespace

void FlashAttention(void* out, const void* q, const void* k, const void* v, const int32_t* cuSeqlens, int64_t batch,
                    int64_t numTokens, int64_t numHeads, int64_t numKvHeads, int64_t headDim,
                    const FlashAttentionStrides& strides, DataType dtype, float scale, bool causal, int64_t window,
                    const SocInfo& soc) {
  FlashAttentionTilingData t = FlashAttentionTiling(cuSeqlens, batch, numTokens, numHeads, numKvHeads, headDim, dtype,
                                                    scale, causal, window, soc);
  if (t.units.empty()) return;
  switch (DataType(t.tilingKey)) {
    case DataType::FLOAT32:
      return LaunchFlashAttention<float>(out, q, k, v, cuSeqlens, batch, strides, t, soc);
    case DataType::FLOAT16:
      return LaunchFlashAttention<half>(out, q, k, v, cuSeqlens, batch, strides, t, soc);
    case DataType::BFLOAT16:
      return LaunchFlashAttention<bfloat16_t>(out, q, k, v, cuSeqlens, batch, strides, t, soc);
  }
}

}  // namespace atb
