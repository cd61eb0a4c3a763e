// Decode-shaped quantized linear (the STREAM kernel; quant_linear_gemm_kernel.cpp has the
// prefill one): y = x dequant(W)^T (+ bias) with the float linear's fused epilogues.
// Each core owns blockFactor consecutive weight rows (across the segments'
// concatenation) and streams their packed bytes from GM once per pass over x,
// dequantizing in registers: x sits widened to fp32 (zero-padded to kPad) in UB
// with its per-32-value sums (the W4 min term), the tile's group scales are
// widened to fp32 in UB, and the micro-kernel (quant_simd.h) keeps every group's
// partial dot in registers and scales it once per group. With bf16 x and a W4
// segment on an AVX512-BF16 CPU, x is also kept as bf16 (zero-padded) for the
// vdpbf16ps route (quant_simd.h: gemv_w4_bf16). With fp16/bf16 x on a table with the int16 routes (AVX2),
// x is also kept as int16 per 32-value chunk (QuantizeXInt16) for gemv_w4_i16 / gemv_w8_i16.
#include <algorithm>
#include <type_traits>

#include "kernels/common/tiling_utils.h"
#include "quant_linear_io.h"

using namespace AscendC;

namespace atb {
namespace {

template <typename T>
class KernelQuantLinear : public LinearStreamIo<T, KernelQuantLinear<T>> {
  static constexpr bool kBf16 = std::is_same<T, bfloat16_t>::value;
  static constexpr bool kHalfWidth = !std::is_same<T, float>::value;
  using Stream = LinearStreamIo<T, KernelQuantLinear<T>>;
  friend Stream;
  using Stream::t_, Stream::streams_, Stream::pipe_, Stream::xGm_, Stream::sums_;

 public:
  void Init(GM_ADDR x, const LinearSegment* ls, const QuantSegment* qs, GM_ADDR residual,
            const QuantLinearTilingData& t) {
    Stream::InitStream(x, ls, residual, t.base, t.kPad);
    q_ = qs;
    kPad_ = t.kPad;
    kChunks_ = t.kChunks;
    kGroups_ = t.kGroups;
    int64_t mt = t_.mTile, nt = t_.nTile;
    pipe_.InitBuffer(xBuf_, mt * t_.kTile * sizeof(float));
    std::copy_n(t.lanes, kLinearMaxSegments, lanes_);
    gemv_ = t.AnyGemv();
    if (t.AnyLanes()) {
      panel_ = QuantLanesPanelRows(t_.kTile);
      pipe_.InitBuffer(wBuf_, std::max(panel_ * t_.kTile, mt * panel_) * sizeof(float));
      for (int s = 0; s < streams_; ++s) pipe_.InitBuffer(lanesBuf_[s], mt * nt * 8 * sizeof(float));
    }
    for (int s = 0; s < streams_; ++s) {
      pipe_.InitBuffer(scaleBuf_[s], nt * kGroups_ * sizeof(float));
      pipe_.InitBuffer(minBuf_[s], nt * kGroups_ * sizeof(float));
      pipe_.InitBuffer(sums_[s], mt * nt * sizeof(float));
    }
    if (!gemv_) return;
    pipe_.InitBuffer(xsumBuf_, mt * kChunks_ * sizeof(float));
    if (kBf16) pipe_.InitBuffer(xbBuf_, mt * t_.kTile * sizeof(uint16_t));
    // The int16 route, decided once: 16-bit x on a table that has it (the tiling budgets its UB for every
    // 16-bit x, so a table without it just leaves the buffers unused).
    int16_ = kHalfWidth && QuantSimd().gemv_w4_i16 && QuantSimd().gemv_w8_i16;
    // x as int16 in the order of each int16 GEMV the launch runs: W8's as QuantizeXInt16 writes it, W4's pairs
    // (InterleaveXInt16ForW4, in place when no W8 segment needs the first).
    if (int16_) {
      w4Pairs_ = t.gemvW4;
      w8Order_ = t.gemvW8;
      pipe_.InitBuffer(xqBuf_, mt * XqPitch() * sizeof(int16_t));
      pipe_.InitBuffer(xqScaleBuf_, mt * kChunks_ * sizeof(float));
      if (w4Pairs_ && w8Order_) pipe_.InitBuffer(xqPairsBuf_, mt * XqPitch() * sizeof(int16_t));
    }
  }

 private:
  void ProcessTile(int s, int64_t row, int64_t m0, int64_t mt, int64_t nt, bool xResident) {
    for (int64_t k0 = 0; k0 < kPad_; k0 += t_.kTile) {
      int64_t kl = std::min(t_.kTile, kPad_ - k0);
      if (!xResident) CopyInX(m0, mt, k0, kl);
      for (int st = 0; st < streams_; ++st) Compute(st, st == 1 ? 1 : s, row, mt, nt, k0, kl);
    }
    for (int st = 0; st < streams_; ++st)
      if (lanes_[st == 1 ? 1 : s]) SumPanelLanes(st, mt, nt);
    Stream::OutputSums(s, row, m0, mt, nt);
  }

  // x[m0 : m0 + mt, k0 : k0 + kl] widened to fp32 (zeros past K) and its sums per 32 values.
  void CopyInX(int64_t m0, int64_t mt, int64_t k0, int64_t kl) {
    float* x = xBuf_.Get<float>().GetPhyAddr();
    float* xs = xsumBuf_.Get<float>().GetPhyAddr();
    int64_t valid = std::max<int64_t>(0, std::min(kl, t_.k - k0));
    for (int64_t m = 0; m < mt; ++m) {
      float* row = x + m * t_.kTile;
      CastRaw<float, T>(row, xGm_.GetPhyAddr((m0 + m) * t_.k + k0), valid);
      std::fill(row + valid, row + kl, 0.0f);
      if (!gemv_) continue;
      for (int64_t c = 0; c < kl / kQuantChunk; ++c) xs[m * kChunks_ + c] = Simd().reduce_sum(row + c * kQuantChunk, kQuantChunk);
      if (int16_) {
        int16_t* xq = xqBuf_.Get<int16_t>().GetPhyAddr(m * XqPitch());
        QuantizeXInt16(xq, xqScaleBuf_.Get<float>().GetPhyAddr(m * kChunks_), row, kl);
        if (w4Pairs_) InterleaveXInt16ForW4(XPairs() + m * XqPitch(), xq, kl, QuantSimd().w4_i16_x);
      }
      if (kBf16) {
        uint16_t* xb = xbBuf_.Get<uint16_t>().GetPhyAddr(m * t_.kTile);
        std::copy_n(reinterpret_cast<const uint16_t*>(xGm_.GetPhyAddr((m0 + m) * t_.k + k0)), valid, xb);
        std::fill(xb + valid, xb + kl, uint16_t(0));
      }
    }
  }

  // sums (+)= x chunk . dequant(W rows [row, row + nt), chunk)^T for stream st (segment seg).
  void Compute(int st, int seg, int64_t row, int64_t mt, int64_t nt, int64_t k0, int64_t kl) {
    const QuantSegment& q = q_[seg];
    float* scaleUb = scaleBuf_[st].Get<float>().GetPhyAddr();
    float* minUb = minBuf_[st].Get<float>().GetPhyAddr();
    float* y = Stream::Sums(st);
    const float* xs = xsumBuf_.Get<float>().GetPhyAddr();
    if (int16_ && !lanes_[seg]) {
      QuantScaleRows sr = StoredScales(q, kPad_, row, nt, k0, kl, scaleUb, minUb, kGroups_);
      const int64_t group = q.group ? q.group : kl;
      if (q.bits == 4)
        return QuantSimd().gemv_w4_i16(y, nt, XPairs(), XqPitch(), XInt16Scales(), kChunks_, xs, kChunks_,
                                       static_cast<const uint8_t*>(q.data) + row * (kPad_ / 2) + k0 / 2, kPad_ / 2, sr,
                                       mt, nt, kl, group, k0 > 0);
      return QuantSimd().gemv_w8_i16(y, nt, xqBuf_.Get<int16_t>().GetPhyAddr(), XqPitch(), XInt16Scales(), kChunks_,
                                     static_cast<const int8_t*>(q.data) + row * kPad_ + k0, kPad_, sr, mt, nt, kl,
                                     group, k0 > 0);
    }
    TileScales sc = LoadScales(q, kPad_, row, nt, k0, kl, scaleUb, minUb, kGroups_);
    const float* x = xBuf_.Get<float>().GetPhyAddr();
    if (lanes_[seg]) return DequantLanes(st, q, sc, row, mt, nt, k0, kl);
    if (q.bits == 4) {
      const uint8_t* w = static_cast<const uint8_t*>(q.data) + row * (kPad_ / 2) + k0 / 2;
      if (kBf16 && QuantSimd().gemv_w4_bf16)
        return QuantSimd().gemv_w4_bf16(y, nt, xbBuf_.Get<uint16_t>().GetPhyAddr(), t_.kTile, xs, kChunks_, w, kPad_ / 2,
                                        sc.scale, sc.min, sc.lds, mt, nt, kl, sc.group, k0 > 0);
      QuantSimd().gemv_w4(y, nt, x, t_.kTile, xs, kChunks_, w, kPad_ / 2, sc.scale, sc.min, sc.lds, mt, nt, kl, sc.group,
                          k0 > 0);
    } else {
      const int8_t* w = static_cast<const int8_t*>(q.data) + row * kPad_ + k0;
      QuantSimd().gemv_w8(y, nt, x, t_.kTile, w, kPad_, sc.scale, sc.lds, mt, nt, kl, sc.group, k0 > 0);
    }
  }

  // lanes (+)= x chunk . W_tile^T, W_tile = the tile's rows dequantized to fp32 (one rounding per value:
  // fma(q, scale, min), as the GEMM's packing), in the float STREAM's lane order. A panel of rows at a
  // time (QuantLanesPanelRows: L1-sized), each panel's lanes their own [mt, rows, 8] block, so the
  // dequantized values are still in L1 when every x row passes over them.
  void DequantLanes(int st, const QuantSegment& q, const TileScales& sc, int64_t row, int64_t mt, int64_t nt,
                    int64_t k0, int64_t kl) {
    float* w = wBuf_.Get<float>().GetPhyAddr();
    float* lanes = lanesBuf_[st].Get<float>().GetPhyAddr();
    const float* x = xBuf_.Get<float>().GetPhyAddr();
    for (int64_t n0 = 0; n0 < nt; n0 += panel_) {
      int64_t nb = std::min(panel_, nt - n0);
      for (int64_t n = n0; n < n0 + nb; ++n)
        DequantRowScaled(q, kPad_, row + n, k0, kl, w + (n - n0) * t_.kTile, sc.scale + n * sc.lds,
                         sc.min ? sc.min + n * sc.lds : nullptr, sc.group);
      Simd().mmad_nt_lanes_f32(lanes + n0 * mt * 8, x, t_.kTile, w, t_.kTile, mt, nb, kl, k0 > 0);
    }
  }

  // sums[m][n] of stream st from the panels' lanes ([mt, rows, 8] per panel).
  void SumPanelLanes(int st, int64_t mt, int64_t nt) {
    const float* lanes = lanesBuf_[st].Get<float>().GetPhyAddr();
    float* sums = Stream::Sums(st);
    float* panelSums = wBuf_.Get<float>().GetPhyAddr();  // free between tiles
    for (int64_t n0 = 0; n0 < nt; n0 += panel_) {
      int64_t nb = std::min(panel_, nt - n0);
      Simd().sum_lanes8(panelSums, lanes + n0 * mt * 8, mt * nb);
      for (int64_t m = 0; m < mt; ++m) std::copy_n(panelSums + m * nb, nb, sums + m * nt + n0);
    }
  }

  // Row pitch of the int16 x buffers: a W4 chunk pair takes 64 values, so an odd last chunk gets its pair's room.
  int64_t XqPitch() const { return AlignUp(t_.kTile, kQuantXInt16Align); }
  int16_t* XPairs() { return (w8Order_ ? xqPairsBuf_ : xqBuf_).Get<int16_t>().GetPhyAddr(); }
  const float* XInt16Scales() { return xqScaleBuf_.Get<float>().GetPhyAddr(); }

  const QuantSegment* q_ = nullptr;
  int64_t kPad_ = 0, kChunks_ = 0, kGroups_ = 0, panel_ = 0;
  bool int16_ = false, gemv_ = false, w4Pairs_ = false, w8Order_ = false, lanes_[kLinearMaxSegments] = {false, false, false};
  TBuf<TPosition::VECCALC> xBuf_, xsumBuf_, xbBuf_, xqBuf_, xqScaleBuf_, xqPairsBuf_, scaleBuf_[2], minBuf_[2], wBuf_, lanesBuf_[2];
};

// Embedding rows: each core dequantizes its share of the requested rows, in K pieces that fit its UB.
constexpr int64_t kDequantPiece = 4096;  // fp32 values per piece: 16 KiB of row + its scales

template <typename T>
class KernelQuantDequantRows {
 public:
  void Init(const QuantSegment& w, int64_t k, const int32_t* idx, int64_t count, void* out, int64_t blockFactor) {
    w_ = w;
    k_ = k;
    kPad_ = AlignUp(k, kQuantChunk);
    idx_ = idx;
    out_ = static_cast<T*>(out);
    piece_ = std::min(kPad_, kDequantPiece);
    first_ = GetBlockIdx() * blockFactor;
    last_ = std::min(count, first_ + blockFactor);
    pipe_.InitBuffer(rowBuf_, piece_ * sizeof(float));
    const int64_t groups = piece_ / (w.group == kQuantHalfChunkGroup ? kQuantHalfChunkGroup : kQuantChunk);
    pipe_.InitBuffer(scaleBuf_, groups * sizeof(float));
    pipe_.InitBuffer(minBuf_, groups * sizeof(float));
  }
  void Process() {
    float* row = rowBuf_.Get<float>().GetPhyAddr();
    for (int64_t i = first_; i < last_; ++i)
      for (int64_t k0 = 0; k0 < kPad_; k0 += piece_) {
        int64_t kl = std::min(piece_, kPad_ - k0);
        DequantRow(w_, kPad_, idx_[i], k0, kl, row, scaleBuf_.Get<float>().GetPhyAddr(), minBuf_.Get<float>().GetPhyAddr());
        CastRaw<T, float>(out_ + i * k_ + k0, row, std::min(kl, k_ - k0));
      }
  }

 private:
  QuantSegment w_;
  int64_t k_ = 0, kPad_ = 0, piece_ = 0, first_ = 0, last_ = 0;
  const int32_t* idx_ = nullptr;
  T* out_ = nullptr;
  TPipe pipe_;
  TBuf<TPosition::VECCALC> rowBuf_, scaleBuf_, minBuf_;
};

}  // namespace

void QuantLinear(const void* x, int64_t m, int64_t k, const QuantSegment* segs, int64_t numSegments,
                 const void* residual, LinearEpilogue ep, DataType dtype, const SocInfo& soc) {
  QuantLinearTilingData t = QuantLinearTiling(m, k, segs, numSegments, ep, dtype, soc);
  if (t.base.tilingKey / 100 == LINEAR_GEMM) return QuantLinearGemm(x, segs, residual, t, soc);
  LaunchQuantKernel<KernelQuantLinear>(x, segs, residual, t, soc);
}

void LinearOrQuant(const void* x, int64_t m, int64_t k, const LinearSegment* segs, const QuantRef* const* quant,
                   int64_t numSegments, const void* residual, LinearEpilogue ep, DataType dtype, const SocInfo& soc) {
  int64_t nq = 0;
  QuantSegment qs[kLinearMaxSegments];
  for (int64_t s = 0; s < numSegments; ++s) {
    const QuantRef* q = quant ? quant[s] : nullptr;
    if (q && q->data) {
      ++nq;
      qs[s] = {q->data, q->scale, q->min, segs[s].bias, segs[s].out, segs[s].n, q->bits, q->group, q->scaleType};
    }
  }
  if (nq == 0) return Linear(x, m, k, segs, numSegments, residual, ep, dtype, soc);
  if (nq == numSegments) return QuantLinear(x, m, k, qs, numSegments, residual, ep, dtype, soc);
  ATB_CHECK(ep == LINEAR_PLAIN, "linear: a fused SWIGLU/RESIDUAL launch cannot mix float and quantized weights");
  for (int64_t s = 0; s < numSegments; ++s) {
    if (quant && quant[s] && quant[s]->data)
      QuantLinear(x, m, k, &qs[s], 1, nullptr, LINEAR_PLAIN, dtype, soc);
    else
      Linear(x, m, k, &segs[s], 1, nullptr, LINEAR_PLAIN, dtype, soc);
  }
}

void QuantDequantRows(const QuantSegment& w, int64_t k, const int32_t* idx, int64_t count, void* out, DataType dtype,
                      const SocInfo& soc) {
  if (count <= 0) return;
  int64_t rowBytes = AlignUp(k, kQuantChunk) * w.bits / 8;
  int64_t blockDim = RowBlockDim(soc, count, rowBytes);
  int64_t factor = CeilDiv(count, blockDim);
  auto run = [&](auto tag) {
    KernelQuantDequantRows<decltype(tag)> op;
    op.Init(w, k, idx, count, out, factor);
    op.Process();
  };
  auto kernel = [&]() {
    switch (dtype) {
      case DataType::FLOAT32: return run(float{});
      case DataType::FLOAT16: return run(half{});
      case DataType::BFLOAT16: return run(bfloat16_t{});
    }
  };
  KernelLaunch(blockDim, soc.ub_size, kernel);
}

}  // namespace atb
