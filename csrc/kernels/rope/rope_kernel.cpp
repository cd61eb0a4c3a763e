// Rotary position embedding (RoPE) on q and k, HF `apply_rotary_pos_emb`
// numerics: out = x*cos + rotate(x)*sin, each product rounded to T, then the
// sum (torch evaluates the expression op by op in T). Bit-exact with HF for
// every dtype: the fp32 product of two T values is exact for fp16/bf16, and no
// FMA is used, so every rounding happens where torch's does.
//
// Per tile (n tokens x hc heads): CopyIn gathers the head rows of q or k from
// their strided GM view into UB, Compute rotates them with the token's cos/sin
// rows (fp32 in UB, loaded once per tile and shared by q and k), CopyOut writes
// them to the output view (possibly the input itself: in place). Where both views
// space their head rows alike, the host kernel rotates them where they lie instead.
#include <algorithm>
#include <type_traits>
#include <utility>
#include <vector>

#include "ascendc/kernel_operator.h"
#include "rope_tiling.h"

using namespace AscendC;

namespace atb {
namespace {

struct RopeArgs {
  RopeView qOut, kOut, q, k;
  const void* cos;
  const void* sin;
  bool interleave;
};

template <typename T, typename C>
class KernelRope {
 public:
  void Init(const RopeArgs& a, const RopeTilingData& t) {
    t_ = t;
    a_ = a;
    first_ = GetBlockIdx() * t.blockFactor;
    count_ = std::max<int64_t>(0, std::min(t.blockFactor, t.tokens - first_));
    cosGm_.SetGlobalBuffer(static_cast<C*>(const_cast<void*>(a.cos)));
    sinGm_.SetGlobalBuffer(static_cast<C*>(const_cast<void*>(a.sin)));
    tokPitch_ = t.headsPerLoop * t.headPitch;
    int64_t tileElems = t.tokensPerLoop * tokPitch_, csElems = t.tokensPerLoop * t.rotaryDim;
    pipe_.InitBuffer(inQ_, BUFFER_NUM, tileElems * sizeof(T));
    pipe_.InitBuffer(outQ_, BUFFER_NUM, tileElems * sizeof(T));
    pipe_.InitBuffer(cosF_, csElems * sizeof(float));
    pipe_.InitBuffer(sinF_, csElems * sizeof(float));
    if (!std::is_same<T, float>::value) pipe_.InitBuffer(stage_, csElems * sizeof(T));
  }

  void Process() {
    for (int64_t i = 0; i < count_; i += t_.tokensPerLoop) {
      int64_t tok = first_ + i, n = std::min(t_.tokensPerLoop, count_ - i);
      LoadCosSin(tok, n);
      RopeGroup(a_.q, a_.qOut, t_.heads, tok, n);
      RopeGroup(a_.k, a_.kOut, t_.kvHeads, tok, n);
    }
  }

 private:
  // cos/sin rows of n tokens -> fp32 UB, rounded to T first when given in fp32.
  void LoadCosSin(int64_t tok, int64_t n) {
    int64_t len = n * t_.rotaryDim, off = tok * t_.rotaryDim;
    LoadTable(cosF_.Get<float>(), cosGm_[off], len);
    LoadTable(sinF_.Get<float>(), sinGm_[off], len);
  }
  void LoadTable(const LocalTensor<float>& dst, const GlobalTensor<C>& src, int64_t len) {
    if constexpr (std::is_same<T, float>::value) {
      DataCopy(dst, src, len);
    } else if constexpr (std::is_same<C, float>::value) {
      LocalTensor<T> s = stage_.Get<T>();
      DataCopy(dst, src, len);
      Cast(s, dst, RoundMode::CAST_RINT, len);  // HF hands cos/sin over in q's dtype
      Cast(dst, s, RoundMode::CAST_NONE, len);
    } else {
      LocalTensor<T> s = stage_.Get<T>();
      DataCopy(s, src, len);
      Cast(dst, s, RoundMode::CAST_NONE, len);
    }
  }

  void RopeGroup(const RopeView& in, const RopeView& out, int64_t heads, int64_t tok, int64_t n) {
    if (in.headStride == out.headStride) return RopeWhereTheyLie(in, out, heads, tok, n);
    // Views spaced differently: each head row goes through its own 32-byte-padded UB row.
    for (int64_t h = 0; h < heads; h += t_.headsPerLoop) {
      int64_t hn = std::min(t_.headsPerLoop, heads - h);
      CopyIn(in, tok, n, h, hn);
      Compute(n, hn, t_.headPitch);
      CopyOut(out, tok, n, h, hn);
    }
  }

  // Head rows the same distance apart in both views (in place, or the same layout): each token's rows are
  // rotated where they lie, straight into the output rows (the rope tables compute a row before storing it,
  // so an output view that is the input is fine). Staging them in UB queues was a copy in and a copy out of
  // every row.
  void RopeWhereTheyLie(const RopeView& in, const RopeView& out, int64_t heads, int64_t tok, int64_t n) {
    const float* c = cosF_.Get<float>().GetPhyAddr();
    const float* s = sinF_.Get<float>().GetPhyAddr();
    const T* x = static_cast<const T*>(in.data);
    T* y = static_cast<T*>(out.data);
    for (int64_t j = 0; j < n; ++j)
      RopeRaw(y + (tok + j) * out.tokenStride, x + (tok + j) * in.tokenStride, c + j * t_.rotaryDim,
              s + j * t_.rotaryDim, heads, in.headStride, t_.headDim, t_.rotaryDim, a_.interleave);
  }

  // The hn head rows of one token, between GM (rows headStride apart) and UB.
  DataCopyParams Rows(int64_t hn, int64_t headStride, bool toUb) const {
    int64_t elt = sizeof(T), d = t_.headDim;
    int64_t gap = (headStride - d) * elt;
    return toUb ? DataCopyParams{hn, d * elt, gap, 0} : DataCopyParams{hn, d * elt, 0, gap};
  }

  void CopyIn(const RopeView& in, int64_t tok, int64_t n, int64_t h, int64_t hn) {
    LocalTensor<T> x = inQ_.AllocTensor<T>();
    DataCopyParams p = Rows(hn, in.headStride, true);
    GlobalTensor<T> g;
    g.SetGlobalBuffer(static_cast<T*>(in.data));
    for (int64_t j = 0; j < n; ++j) DataCopyPad(x[j * tokPitch_], g[(tok + j) * in.tokenStride + h * in.headStride], p);
    inQ_.EnQue(x);
  }

  void Compute(int64_t n, int64_t hn, int64_t rowPitch) {
    LocalTensor<T> x = inQ_.DeQue<T>();
    LocalTensor<T> y = outQ_.AllocTensor<T>();
    const float* c = cosF_.Get<float>().GetPhyAddr();
    const float* s = sinF_.Get<float>().GetPhyAddr();
    for (int64_t j = 0; j < n; ++j) {
      RopeRaw(y.GetPhyAddr(j * tokPitch_), x.GetPhyAddr(j * tokPitch_), c + j * t_.rotaryDim, s + j * t_.rotaryDim, hn,
              rowPitch, t_.headDim, t_.rotaryDim, a_.interleave);
    }
    outQ_.EnQue(y);
    inQ_.FreeTensor(x);
  }

  void CopyOut(const RopeView& out, int64_t tok, int64_t n, int64_t h, int64_t hn) {
    LocalTensor<T> y = outQ_.DeQue<T>();
    DataCopyParams p = Rows(hn, out.headStride, false);
    GlobalTensor<T> g;
    g.SetGlobalBuffer(static_cast<T*>(out.data));
    for (int64_t j = 0; j < n; ++j) DataCopyPad(g[(tok + j) * out.tokenStride + h * out.headStride], y[j * tokPitch_], p);
    outQ_.FreeTensor(y);
  }

  RopeTilingData t_;
  RopeArgs a_;
  int64_t first_ = 0, count_ = 0, tokPitch_ = 0;
  TPipe pipe_;
  TQue<QuePosition::VECIN, BUFFER_NUM> inQ_;
  TQue<QuePosition::VECOUT, BUFFER_NUM> outQ_;
  TBuf<TPosition::VECCALC> cosF_, sinF_, stage_;
  GlobalTensor<C> cosGm_, sinGm_;
};

template <typename T, typename C>
void RunRope(const RopeArgs& a, const RopeTilingData& t) {
  KernelRope<T, C> op;
  op.Init(a, t);
  op.Process();
}

// In place, every head row (headDim contiguous elements) is rewritten where it
// lies: a row shared by two heads, tokens or by q and k would be rotated twice
// (or read already rotated), and cos/sin inside q or k would change under the
// kernel. Checked here, not in Python, because it costs nanoseconds: spans and
// strides settle every usual layout (separate tensors, q/k views of one fused
// QKV output); only interleaved layouts fall back to comparing rows.
struct ByteSpan {
  uintptr_t lo, hi;  // [lo, hi)
  bool Meets(const ByteSpan& o) const { return lo < o.hi && o.lo < hi; }
};

ByteSpan SpanOf(const RopeView& v, int64_t tokens, int64_t heads, int64_t headDim, int64_t elt) {
  uintptr_t lo = reinterpret_cast<uintptr_t>(v.data);
  int64_t last = (tokens > 1 ? (tokens - 1) * v.tokenStride : 0) + (heads > 1 ? (heads - 1) * v.headStride : 0);
  return {lo, lo + uintptr_t((last + headDim) * elt)};
}

// No two rows of one view overlap: walking its dims from the smallest stride up,
// each stride clears everything the smaller ones reach (any token/head order).
bool RowsDisjoint(const RopeView& v, int64_t tokens, int64_t heads, int64_t headDim) {
  std::pair<int64_t, int64_t> dims[2] = {{v.headStride, heads}, {v.tokenStride, tokens}};
  if (dims[0].first > dims[1].first) std::swap(dims[0], dims[1]);
  int64_t reach = headDim;
  for (const auto& [stride, n] : dims) {
    if (n <= 1) continue;
    if (stride < reach) return false;
    reach += (n - 1) * stride;
  }
  return true;
}

void CheckInPlace(const RopeView& q, const RopeView& k, const void* cos, const void* sin, int64_t tokens, int64_t heads,
                  int64_t kvHeads, int64_t headDim, int64_t rotaryDim, int64_t elt, int64_t cosElt) {
  ATB_CHECK(RowsDisjoint(q, tokens, heads, headDim), "rope: inplace=True needs q's rows not to overlap, got token ",
            "stride ", q.tokenStride, " and head stride ", q.headStride, " for ", heads, " heads of ", headDim);
  ATB_CHECK(RowsDisjoint(k, tokens, kvHeads, headDim), "rope: inplace=True needs k's rows not to overlap, got token ",
            "stride ", k.tokenStride, " and head stride ", k.headStride, " for ", kvHeads, " heads of ", headDim);
  ByteSpan sq = SpanOf(q, tokens, heads, headDim, elt), sk = SpanOf(k, tokens, kvHeads, headDim, elt);
  for (const void* table : {cos, sin}) {
    uintptr_t lo = reinterpret_cast<uintptr_t>(table);
    ByteSpan st{lo, lo + uintptr_t(tokens * rotaryDim * cosElt)};
    ATB_CHECK(!st.Meets(sq) && !st.Meets(sk), "rope: inplace=True needs cos/sin not to overlap q or k in memory");
  }
  if (!sq.Meets(sk)) return;
  // q and k in one buffer with the same token stride P: within one period, k's
  // rows must lie after q's and end before q's next token begins.
  int64_t rq = sq.hi - sq.lo, rk = sk.hi - sk.lo;
  if (tokens > 1 && q.tokenStride == k.tokenStride && q.tokenStride > 0) {
    int64_t period = q.tokenStride * elt;
    rq = ((heads - 1) * q.headStride + headDim) * elt;
    rk = ((kvHeads - 1) * k.headStride + headDim) * elt;
    int64_t off = ((int64_t(sk.lo) - int64_t(sq.lo)) % period + period) % period;
    if (rq <= off && off + rk <= period) return;
  }
  // Anything else: all rows sorted by address; neighbours must not overlap.
  std::vector<uintptr_t> rows;
  rows.reserve(size_t(tokens * (heads + kvHeads)));
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t h = 0; h < heads; ++h) rows.push_back(sq.lo + uintptr_t((t * q.tokenStride + h * q.headStride) * elt));
    for (int64_t h = 0; h < kvHeads; ++h) rows.push_back(sk.lo + uintptr_t((t * k.tokenStride + h * k.headStride) * elt));
  }
  std::sort(rows.begin(), rows.end());
  for (size_t i = 1; i < rows.size(); ++i)
    ATB_CHECK(rows[i] >= rows[i - 1] + uintptr_t(headDim * elt), "rope: inplace=True needs q and k not to overlap in ",
              "memory (a q row and a k row share elements)");
}

}  // namespace

void Rope(RopeView qOut, RopeView kOut, RopeView q, RopeView k, const void* cos, const void* sin, int64_t tokens,
          int64_t heads, int64_t kvHeads, int64_t headDim, int64_t rotaryDim, DataType dtype, DataType cosDtype,
          RopeStyle style, const SocInfo& soc) {
  RopeTilingData t = RopeTiling(tokens, heads, kvHeads, headDim, rotaryDim, dtype, cosDtype, style, soc);
  if (qOut.data == q.data && kOut.data == k.data)
    CheckInPlace(q, k, cos, sin, tokens, heads, kvHeads, headDim, rotaryDim, DataTypeSize(dtype), DataTypeSize(cosDtype));
  RopeArgs a{qOut, kOut, q, k, cos, sin, style == ROPE_INTERLEAVE};
  auto kernel = [&]() {
    switch (t.tilingKey / 10) {
      case 0 * 10 + 0: return RunRope<float, float>(a, t);
      case 1 * 10 + 1: return RunRope<half, half>(a, t);
      case 1 * 10 + 0: return RunRope<half, float>(a, t);
      case 2 * 10 + 2: return RunRope<bfloat16_t, bfloat16_t>(a, t);
      case 2 * 10 + 0: return RunRope<bfloat16_t, float>(a, t);
    }
    ThrowError("rope: no kernel for tiling key ", t.tilingKey);
  };
  KernelLaunch(t.blockDim, soc.ub_size, kernel);
}

}  // namespace atb
