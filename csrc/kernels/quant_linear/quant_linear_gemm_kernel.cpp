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
// bf16 x where the SIMD table has vdpbf16ps (tiling kDpPacked): the tile's
// integer values (exact in bf16) are unpacked and packed in k pairs in one pass
// from the stored bytes (pack_q4_pairs / pack_q8_pairs), its scales (and mins)
// laid out per 16-row panel,
// and x's rows run through mmad_dp_bf16_grouped as they lie: x q exact, each
// group's sum times its scale (plus min times x's group sum), nothing rounded
// to bf16 but x itself; twice the fp32 cube's rate. x's group sums (the W4 min
// term) are computed once per call before the launch (GroupSums).
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
  void Init(GM_ADDR x, const float* xPacked, const float* const* xsums, const LinearSegment* ls,
            const QuantSegment* qs, GM_ADDR residual, const QuantLinearTilingData& t) {
    dp_ = t.base.dpBf16 == kDpPacked;
    Gemm::InitGemm(x, xPacked, ls, residual, t.base, t.kPad, !dp_);
    q_ = qs;
    kPad_ = t.kPad;
    kGroups_ = t.kGroups;
    if (dp_) {
      Gemm::InitDpPacked();
      const int64_t groups = t.kGroups;  // at most
      for (int st = 0; st < this->streams_; ++st) {
        pipe_.InitBuffer(panelScale_[st], AlignUp(t_.nTile, kPairPanelRows) * groups * sizeof(float));
        pipe_.InitBuffer(panelMin_[st], AlignUp(t_.nTile, kPairPanelRows) * groups * sizeof(float));
      }
      for (int64_t s = 0; s < t.base.numSegments; ++s) xsums_[s] = xsums[s];
    }
    if (!dp_) pipe_.InitBuffer(rowBuf_, kQuantPackRows * t_.kTile * sizeof(float));  // PackWeight's rows
    // A row's scales, or (dp) a tile's.
    pipe_.InitBuffer(scaleBuf_, (dp_ ? t_.nTile : 1) * t.kGroups * sizeof(float));
    pipe_.InitBuffer(minBuf_, (dp_ ? t_.nTile : 1) * t.kGroups * sizeof(float));
  }

 private:
  void ProcessUnit(const GemmUnit& u) {
    if (dp_) return Gemm::ProcessDpPackedUnit(u);
    Gemm::ProcessPackedUnit(u);
  }

  // kDpPacked's B operand: the tile's integer values (exact in bf16) packed in k pairs; and its scales (and
  // mins) per panel, [groups][16], zero past the tile's rows.
  void PackPairs(int st, int seg, int64_t row, int64_t nt, int64_t k0, int64_t kv, uint16_t* dst) {
    const SimdOps& simd = Simd();
    const QuantSegment& q = q_[seg];
    const int64_t kl = std::min(t_.kTile, kPad_ - k0);
    if (q.bits == 4)
      simd.pack_q4_pairs(dst, static_cast<const uint8_t*>(q.data) + row * (kPad_ / 2) + k0 / 2, kPad_ / 2, nt, kv);
    else
      simd.pack_q8_pairs(dst, static_cast<const int8_t*>(q.data) + row * kPad_ + k0, kPad_, nt, kv);
    TileScales s = LoadScales(q, kPad_, row, nt, k0, kl, scaleBuf_.Get<float>().GetPhyAddr(),
                              minBuf_.Get<float>().GetPhyAddr(), kGroups_);
    // A per-channel segment's sums fold into the accumulators every kChannelFold values, not once per chunk,
    // so its bits do not depend on where K is split (chunks are multiples of it).
    group_[st] = q.group == 0 ? kChannelFold : s.group;
    seg_[st] = seg;
    hasMin_[st] = q.bits == 4;  // (LoadScales points min at its buffer for W8 too)
    const int64_t groups = CeilDiv(kv, group_[st]), panels = CeilDiv(nt, kPairPanelRows);
    ldsp_[st] = groups * kPairPanelRows;
    float* ps = panelScale_[st].Get<float>().GetPhyAddr();
    float* pm = panelMin_[st].Get<float>().GetPhyAddr();
    // Row by row (its scales are contiguous), each to its column of the panel's [groups][16].
    for (int64_t i = 0; i < panels * kPairPanelRows; ++i) {
      const int64_t at = i / kPairPanelRows * ldsp_[st] + i % kPairPanelRows;
      float* sd = ps + at;
      float* md = pm + at;
      if (i >= nt) {
        for (int64_t g = 0; g < groups; ++g) sd[g * kPairPanelRows] = 0.0f;
        if (hasMin_[st])
          for (int64_t g = 0; g < groups; ++g) md[g * kPairPanelRows] = 0.0f;
        continue;
      }
      const float* sr = s.scale + i * s.lds;
      if (q.group == 0) {  // per channel: the row's one scale in every fold
        for (int64_t g = 0; g < groups; ++g) sd[g * kPairPanelRows] = sr[0];
      } else {
        for (int64_t g = 0; g < groups; ++g) sd[g * kPairPanelRows] = sr[g];
      }
      if (hasMin_[st]) {
        const float* mr = s.min + i * s.lds;
        for (int64_t g = 0; g < groups; ++g) md[g * kPairPanelRows] = mr[g];
      }
    }
  }

  // x . (q * scale + min)^T of the packed tile, x = x[m0 :, k0 :]; the min term takes x's group sums.
  void DpMmad(int st, int64_t m0, int64_t k0, float* c, int64_t ldc, const uint16_t* a, int64_t lda,
              const uint16_t* bp, int64_t mt, int64_t nt, int64_t kv, bool acc) {
    const int64_t G = group_[st], groups = CeilDiv(t_.k, G);
    // K chunks are multiples of every group size, so the chunk's groups are x's groups from k0 / G.
    const float* xs = hasMin_[st] ? xsums_[seg_[st]] + m0 * groups + k0 / G : nullptr;
    Simd().mmad_dp_bf16_grouped(c, ldc, a, lda, bp, mt, nt, kv, G, panelScale_[st].Get<float>().GetPhyAddr(),
                                hasMin_[st] ? panelMin_[st].Get<float>().GetPhyAddr() : nullptr, ldsp_[st], xs,
                                groups, acc);
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

  static constexpr int64_t kPairPanelRows = 16;  // pack_bf16_pairs' panel
  static constexpr int64_t kChannelFold = 128;   // the K chunks' multiple (kQuantKHalving)

  const QuantSegment* q_ = nullptr;
  int64_t kPad_ = 0, kGroups_ = 0;
  bool dp_ = false;
  TBuf<TPosition::VECCALC> rowBuf_, scaleBuf_, minBuf_, panelScale_[2], panelMin_[2];
  int64_t group_[2] = {0, 0}, ldsp_[2] = {0, 0}, seg_[2] = {0, 0};  // this chunk's, per stream (PackPairs)
  bool hasMin_[2] = {false, false};
  const float* xsums_[kLinearMaxSegments] = {nullptr, nullptr, nullptr};  // per segment: GroupSums, or null
};

// x's sums per group of G values ([m][ceil(k / G)] fp32, each group's values widened, then reduce_sum) for the
// W4 min term. Once per call, the rows split over the cores: the GEMM's units take a weight tile's M passes in
// turn, so sums kept per unit were recomputed for every unit, a fifth of a 2048-row W4 g32 GEMM's time.
// The calling thread keeps the workspace (slot `slot`, one per segment) for its next call, up to
// kWidenKeepBytes as PackedX's.
const float* GroupSums(int slot, const void* x, int64_t m, int64_t k, int64_t G, const SocInfo& soc) {
  thread_local std::vector<float> workspace[kLinearMaxSegments];
  const int64_t groups = CeilDiv(k, G);
  std::vector<float>& ws = workspace[slot];
  const size_t need = size_t(m * groups);
  if (ws.capacity() * sizeof(float) > size_t(kWidenKeepBytes) && need * sizeof(float) <= size_t(kWidenKeepBytes))
    std::vector<float>().swap(ws);
  if (ws.size() < need) ws.resize(need);
  float* dst = ws.data();
  const uint16_t* src = static_cast<const uint16_t*>(x);
  int64_t cores = std::max<int64_t>(1, std::min(soc.vector_core_num, CeilDiv(m, 64)));
  KernelLaunch(cores, soc.ub_size, [&]() {
    const int64_t per = CeilDiv(m, GetBlockNum()), first = GetBlockIdx() * per, last = std::min(m, first + per);
    std::vector<float> row(static_cast<size_t>(k));
    for (int64_t i = first; i < last; ++i) {
      Simd().bf16_to_f32(row.data(), src + i * k, k);
      for (int64_t g = 0; g < groups; ++g)
        dst[i * groups + g] = Simd().reduce_sum(row.data() + g * G, std::min(G, k - g * G));
    }
  });
  return dst;
}

}  // namespace

void QuantLinearGemm(const void* x, const QuantSegment* segs, const void* residual, const QuantLinearTilingData& t,
                     const SocInfo& soc) {
  const bool dp = t.base.dpBf16 == kDpPacked;
  const float* xPacked = dp ? nullptr : PackedX(x, t.base.m, t.base.k, DataType(t.base.tilingKey / 10 % 10), soc);
  const float* xsums[kLinearMaxSegments] = {nullptr, nullptr, nullptr};
  for (int64_t s = 0; dp && s < t.base.numSegments; ++s) {
    if (segs[s].bits != 4) continue;
    for (int64_t p = 0; p < s && !xsums[s]; ++p)  // segments of one group size share one computation
      if (segs[p].bits == 4 && segs[p].group == segs[s].group) xsums[s] = xsums[p];
    if (!xsums[s]) xsums[s] = GroupSums(int(s), x, t.base.m, t.base.k, segs[s].group, soc);
  }
  const float* const* sums = xsums;
  LaunchQuantKernel<KernelQuantLinearGemm>(x, segs, residual, t, soc, xPacked, sums);
}

}  // namespace atb
