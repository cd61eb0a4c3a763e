// PagedAttention: queries against a K/V cache read through block tables.
//
// One item = the query rows of one q tile (query tokens x the query heads that
// share one KV head, GQA rows stacked into the M dimension of the cube so each
// K/V row is read once for all of them) against a range of key positions:
//   S = (scale * Q) K^T    MmadNT, K rows taken per cache block (or gathered)
//   online softmax in fp32 per row (running max m, sum l, causal/window mask)
//   acc = acc * alpha + P V   MmadNN
// An item that covers its rows' whole key range writes out = acc / l; a key
// range cut over several items (flash-decoding) writes (m, l, acc) partials,
// and the merge kernel combines them:  out = sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s.
#include <algorithm>
#include <cmath>
#include <vector>

#include "ascendc/block_prefetch.h"
#include "ascendc/kernel_operator.h"
#include "paged_attention_tiling.h"
#include "kernels/common/tiling_key.h"

using namespace AscendC;

namespace atb {
namespace {

// A run of consecutive key positions whose K (and V) rows are ld elements
// apart: one cache block's slice for one KV head, or the gathered UB tile.
template <typename T>
struct KvRun {
  const T* k;
  const T* v;
  int64_t ld, col, n;  // row stride, first column in the score tile, keys
};

template <typename T>
class KernelPagedAttention {
 public:
  void Init(GM_ADDR q, GM_ADDR keyCache, GM_ADDR valueCache, const int32_t* blockTables, GM_ADDR out, float* workspace,
            const PagedAttentionTilingData& t) {
    t_ = &t;
    d_ = t.headDim;
    gather_ = TilingKeyVariant(t.tilingKey) == PA_GATHER;
    qGm_.SetGlobalBuffer(reinterpret_cast<T*>(q));
    kGm_.SetGlobalBuffer(reinterpret_cast<T*>(keyCache));
    vGm_.SetGlobalBuffer(reinterpret_cast<T*>(valueCache));
    oGm_.SetGlobalBuffer(reinterpret_cast<T*>(out));
    wsGm_.SetGlobalBuffer(workspace);
    bt_ = blockTables;
    int64_t m = t.rowsPerTile, tn = t.kvTile;
    pipe_.InitBuffer(qBuf_, m * d_ * 4);
    pipe_.InitBuffer(accBuf_, m * d_ * 4);
    pipe_.InitBuffer(sBuf_, m * tn * 4);
    pipe_.InitBuffer(statBuf_, 3 * m * 4);
    if (gather_) {
      pipe_.InitBuffer(inK_, BUFFER_NUM, tn * d_ * int64_t(sizeof(T)));
      pipe_.InitBuffer(inV_, BUFFER_NUM, tn * d_ * int64_t(sizeof(T)));
    }
    runs_.reserve(size_t(tn));
  }

  void Process() {
    int64_t first = GetBlockIdx() * t_->blockFactor;
    int64_t last = std::min<int64_t>(int64_t(t_->items.size()), first + t_->blockFactor);
    if (first >= last) return;
    if (gather_) {
      // An item's first tile is requested before the item starts (the next item's while this one runs):
      // PrefetchKv inside an item only covers the tiles after its first.
      PrefetchFirstTile(t_->items[size_t(first)]);
      for (int64_t i = first; i < last; ++i) {
        if (i + 1 < last) PrefetchFirstTile(t_->items[size_t(i + 1)]);
        ProcessItem(t_->items[size_t(i)]);
      }
      return;
    }
    ahead_.Start(*t_, bt_, kGm_.GetPhyAddr(0), vGm_.GetPhyAddr(0), first, last);
    for (int64_t i = first; i < last; ++i) ProcessItem(t_->items[size_t(i)]);
  }

 private:
  void ProcessItem(const PagedAttentionItem& it) {
    rows_ = int64_t(it.qn) * it.gn;
    kvn_ = ItemKvHeads(it, t_->groupSize);
    int64_t ctx = t_->contextLens[it.batch], ql = t_->qLens[it.batch];
    for (int64_t tp = 0; tp < it.qn; ++tp) {
      int64_t p = ctx - ql + it.q0 + tp;  // this query token's position
      lo_[tp] = t_->window ? std::max<int64_t>(0, p - t_->window + 1) : 0;
      hi_[tp] = p + 1;
    }
    PrepareQuery(it);
    for (int64_t t0 = it.kvStart; t0 < it.kvEnd;) {
      int64_t t1 = TileEnd(t0, it.kvEnd, t_->kvTile);
      CopyInKv(it, t0, t1);
      if (gather_) PrefetchKv(it, t1, TileEnd(t1, it.kvEnd, t_->kvTile));
      Compute(it, t0, t1);
      t0 = t1;
    }
    CopyOut(it);
  }

  int64_t QueryRow(const PagedAttentionItem& it, int64_t tp) const { return t_->qStart[it.batch] + it.q0 + tp; }
  int64_t FirstHead(const PagedAttentionItem& it) const { return int64_t(it.kvHead) * t_->groupSize + it.g0; }

  // fp32 Q with the softmax scale folded in, widened from q where it lies (the gn heads of one query token are
  // adjacent in q: one run per token; staging them in a UB queue first was one more copy of every query);
  // fresh running statistics.
  void PrepareQuery(const PagedAttentionItem& it) {
    LocalTensor<float> q = qBuf_.Get<float>();
    for (int64_t tp = 0; tp < it.qn; ++tp)
      CastRaw<float, T>(q.GetPhyAddr(tp * it.gn * d_),
                        qGm_.GetPhyAddr(QueryRow(it, tp) * t_->qStride + FirstHead(it) * d_), int64_t(it.gn) * d_);
    Muls(q, q, t_->scale, rows_ * d_);
    LocalTensor<float> st = statBuf_.Get<float>();
    Duplicate(st, -INFINITY, rows_);        // m
    Duplicate(st[rows_], 0.0f, rows_);      // l
    Duplicate(accBuf_.Get<float>(), 0.0f, rows_ * d_);
  }

  // K/V rows of key positions [t0, t1), block by block through the block table.
  void CopyInKv(const PagedAttentionItem& it, int64_t t0, int64_t t1) {
    runs_.clear();
    const int64_t bs = t_->blockSize;
    const int32_t* table = bt_ + int64_t(it.batch) * t_->maxBlocks;
    LocalTensor<T> k, v;
    if (gather_) {
      k = inK_.AllocTensor<T>();
      v = inV_.AllocTensor<T>();
    }
    for (int64_t pos = t0; pos < t1;) {
      int64_t n = std::min(bs - pos % bs, t1 - pos), base = CacheRowOffset(*t_, table, pos, it.kvHead);
      if (gather_) {
        GatherRows(k[(pos - t0) * d_], kGm_[base], n);
        GatherRows(v[(pos - t0) * d_], vGm_[base], n);
      } else {
        runs_.push_back({kGm_.GetPhyAddr(base), vGm_.GetPhyAddr(base), t_->kvHeads * d_, pos - t0, n});
      }
      pos += n;
    }
    if (gather_) {
      inK_.EnQue(k);
      inV_.EnQue(v);
    }
  }

  // The bytes of one key's cache row that an item of kvn KV heads reads (its heads are adjacent).
  int64_t ItemRowBytes(int64_t kvn) const { return kvn * d_ * int64_t(sizeof(T)); }

  static int64_t TileEnd(int64_t t0, int64_t end, int64_t tn) { return std::min<int64_t>(end, (t0 / tn + 1) * tn); }

  // The rows of a direct-read block's items in the order the score and P x V loops read them: per tile,
  // its K rows, then its V rows; then the next tile, then the next item. Requests run a fixed number of
  // bytes ahead of the reads, topped up before every key chunk, so the copy engine's requests are spread
  // over the compute instead of issued a tile (~100 KiB) at a time: a burst of prefetches larger than the
  // core's outstanding misses stalls the core until it drains, and the reads after it then wait on DRAM
  // again. The item boundaries inside a block are crossed the same way. The old scheme (a tile's burst
  // before it and a 48-keys-ahead request inside each cache-block run, which at 128-token blocks never
  // reached past the run) against this one, Zen 3, 2 threads, SmolLM2 shapes (bf16, 9 heads, 3 KV heads,
  // 128-token blocks), 30 layers' caches with 64 MiB read between steps, medians of 6 interleaved runs,
  // us per layer: batch 16 x 160 keys 530 -> 366, 16 x 600 1878 -> 1150, 4 x 300 270 -> 159, 1 x 160
  // 48 -> 37. Leads of 4 to 96 KiB measured within noise of each other at 16 x 160; 8 KiB (into L1)
  // stays clear of the item's UB buffers. Where the SIMD table says so (prefetch_to_l2: AVX-512) the
  // requests go to L2: Zen 4, 2 threads, SmolLM2 bf16 decode graph, attention ms per step, medians of 5
  // interleaved runs, into L1 -> into L2: batch 16 4.92 -> 3.23 (leads of 16 and 32 KiB: 3.28, 3.44;
  // 4 KiB 3.38; prefetcht2 3.39), batch 1 0.60 -> 0.29.
  class RowStream {
   public:
    void Start(const PagedAttentionTilingData& t, const int32_t* blockTables, const void* keyCache,
               const void* valueCache, int64_t first, int64_t last) {
      t_ = &t;
      bt_ = blockTables;
      k_ = static_cast<const char*>(keyCache);
      v_ = static_cast<const char*>(valueCache);
      item_ = first;
      last_ = last;
      issued_ = read_ = 0;
      toL2_ = Simd().prefetch_to_l2;
      rowPitch_ = t.kvHeads * t.headDim * int64_t(sizeof(T));
      StartItem();
    }
    // Called before reading the next n rows: requests up to kLeadBytes past them.
    void Read(int64_t n) {
      while (item_ < last_ && issued_ < read_ + n + lead_) {
        if (pos_ < runLo_ || pos_ >= runHi_) {  // a new cache block: one table lookup (and division) per block
          runLo_ = pos_ - pos_ % t_->blockSize;
          runHi_ = runLo_ + t_->blockSize;
          runBase_ = CacheRowOffset(*t_, table_, runLo_, kvHead_) * int64_t(sizeof(T));
        }
        const char* row = (inV_ ? v_ : k_) + runBase_ + (pos_ - runLo_) * rowPitch_;
        const char* end = row + rowBytes_;
        for (const char* p = reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(row) & ~uintptr_t(63)); p < end;
             p += 64)
          if (toL2_) __builtin_prefetch(p, 0, 2);
          else __builtin_prefetch(p, 0, 3);
        ++issued_;
        Advance();
      }
      read_ += n;
    }

   private:
    static constexpr int64_t kLeadBytes = 8 * 1024;
    void StartItem() {
      if (item_ >= last_) return;
      const PagedAttentionItem& it = t_->items[size_t(item_)];
      table_ = bt_ + int64_t(it.batch) * t_->maxBlocks;
      rowBytes_ = ItemKvHeads(it, t_->groupSize) * t_->headDim * int64_t(sizeof(T));
      lead_ = std::max<int64_t>(1, kLeadBytes / rowBytes_);
      kvHead_ = it.kvHead;
      runLo_ = runHi_ = 0;
      t0_ = pos_ = it.kvStart;
      t1_ = TileEnd(t0_, it.kvEnd, t_->kvTile);
      inV_ = false;
    }
    void Advance() {
      if (++pos_ < t1_) return;
      pos_ = t0_;
      if (!inV_) {
        inV_ = true;
        return;
      }
      inV_ = false;
      const PagedAttentionItem& it = t_->items[size_t(item_)];
      if (t1_ < it.kvEnd) {
        t0_ = pos_ = t1_;
        t1_ = TileEnd(t0_, it.kvEnd, t_->kvTile);
        return;
      }
      ++item_;
      StartItem();
    }
    const PagedAttentionTilingData* t_ = nullptr;
    const int32_t *bt_ = nullptr, *table_ = nullptr;
    const char *k_ = nullptr, *v_ = nullptr;
    int64_t item_ = 0, last_ = 0, issued_ = 0, read_ = 0, lead_ = 0, rowBytes_ = 0;
    int64_t kvHead_ = 0, t0_ = 0, t1_ = 0, pos_ = 0;
    int64_t runLo_ = 0, runHi_ = 0, runBase_ = 0, rowPitch_ = 0;  // the cache block pos_ is in
    bool inV_ = false;
    bool toL2_ = false;
  };

  // Gathered tiles (small cache blocks): the ping-pong half of the copy engine: while
  // tile i is computed, tile i+1's K/V rows are requested. A one-head item's rows are head_dim * elt bytes (128
  // to 512) every kv_heads * head_dim elements, a pattern the CPU's stream
  // prefetchers do not follow across pages; without this the cube would stall
  // on every row it reads from DRAM.
  ATB_PREFETCH_INLINE void PrefetchKv(const PagedAttentionItem& it, int64_t t0, int64_t t1) {
    const int64_t rowBytes = ItemRowBytes(ItemKvHeads(it, t_->groupSize));
    const int32_t* table = bt_ + int64_t(it.batch) * t_->maxBlocks;
    for (int64_t pos = t0; pos < t1; ++pos) {
      int64_t base = CacheRowOffset(*t_, table, pos, it.kvHead);
      const char* k = reinterpret_cast<const char*>(kGm_.GetPhyAddr(base));
      const char* v = reinterpret_cast<const char*>(vGm_.GetPhyAddr(base));
      for (int64_t b = 0; b < rowBytes; b += 64) {
        __builtin_prefetch(k + b, 0, 2);
        __builtin_prefetch(v + b, 0, 2);
      }
    }
  }

  void PrefetchFirstTile(const PagedAttentionItem& it) {
    int64_t tn = t_->kvTile;
    PrefetchKv(it, it.kvStart, std::min<int64_t>(it.kvEnd, (it.kvStart / tn + 1) * tn));
  }

  // n rows of head_dim elements, kv_heads * head_dim apart in the cache, packed in UB.
  void GatherRows(const LocalTensor<T>& dst, const GlobalTensor<T>& src, int64_t n) {
    int64_t rowBytes = d_ * int64_t(sizeof(T));
    if (rowBytes % ONE_BLK_SIZE == 0) {
      DataCopyParams p;
      p.blockCount = n;
      p.blockLen = rowBytes;
      p.srcStride = (t_->kvHeads - 1) * rowBytes;
      DataCopyPad(dst, src, p);
    } else {  // DataCopyPad would pad each UB row to 32 bytes; keep rows packed
      for (int64_t r = 0; r < n; ++r) DataCopy(dst[r * d_], src[r * t_->kvHeads * d_], d_);
    }
  }

  void Compute(const PagedAttentionItem& it, int64_t t0, int64_t t1) {
    LocalTensor<T> k, v;
    if (gather_) {
      k = inK_.DeQue<T>();
      v = inV_.DeQue<T>();
      runs_.assign(1, {k.GetPhyAddr(), v.GetPhyAddr(), d_, 0, t1 - t0});
    }
    const int64_t n = t1 - t0, tn = t_->kvTile;
    float* s = sBuf_.Get<float>().GetPhyAddr();
    float* q = qBuf_.Get<float>().GetPhyAddr();
    float* acc = accBuf_.Get<float>().GetPhyAddr();
    float* m = statBuf_.Get<float>().GetPhyAddr();
    float* l = m + rows_;
    // A decode item of several KV heads (its rows are one token's heads, kvn_ groups of rows_ / kvn_):
    // each key chunk is scored for every KV head in turn, so the chunk's whole cache rows are read once.
    const int64_t hr = rows_ / kvn_, keys = KeysPerChunk(hr);
    for (const auto& r : runs_) ForKeyChunkHeads(r, keys, [&](int64_t j, int64_t nj, int64_t h) {
      MmadNTRows<T>(s + h * hr * tn + r.col + j, q + h * hr * d_, r.k + h * d_ + j * r.ld,
                    {hr, nj, d_, d_, r.ld, tn, false});
    });
    for (int64_t tp = 0; tp < it.qn; ++tp) {
      // Keys this token may see inside the tile (causal end, sliding-window start).
      int64_t c0 = std::clamp<int64_t>(lo_[tp] - t0, 0, n), c1 = std::clamp<int64_t>(hi_[tp] - t0, 0, n);
      for (int64_t gi = 0; gi < it.gn; ++gi) {
        int64_t r = tp * it.gn + gi;
        float* row = s + r * tn;
        if (c1 <= c0) {
          Simd().duplicate(row, 0.0f, n);
          continue;
        }
        float mx = std::max(m[r], Simd().reduce_max(row + c0, c1 - c0));
        if (mx == -INFINITY) {  // every visible score so far is -inf: weight 0 (all of them: l = 0, out NaN as SDPA)
          Simd().duplicate(row, 0.0f, n);
          continue;
        }
        // NaN must reach the output as in SDPA, but the max and exp above drop
        // it (vector max returns the non-NaN operand; exp clamps its input). One
        // sum over the visible scores (1/head_dim of the QK^T work) catches a NaN
        // in q or a visible key; a +inf score makes SDPA's softmax NaN as well.
        float raw = Simd().reduce_sum(row + c0, c1 - c0);
        if (std::isnan(raw) || mx == INFINITY) l[r] = NAN;
        Simd().adds(row + c0, row + c0, -mx, c1 - c0);
        Simd().exp(row + c0, row + c0, c1 - c0);
        if (c0 > 0) Simd().duplicate(row, 0.0f, c0);
        if (c1 < n) Simd().duplicate(row + c1, 0.0f, n - c1);
        float sum = Simd().reduce_sum(row + c0, c1 - c0);
        if (mx != m[r]) {  // rescale what was accumulated under the old max
          float alpha = std::exp(m[r] - mx);  // 0 on the first tile (m = -inf)
          l[r] *= alpha;
          Simd().muls(acc + r * d_, acc + r * d_, alpha, d_);
          m[r] = mx;
        }
        l[r] += sum;
      }
    }
    for (const auto& r : runs_) ForKeyChunkHeads(r, keys, [&](int64_t j, int64_t nj, int64_t h) {
      MmadNNRows<T>(acc + h * hr * d_, s + h * hr * tn + r.col + j, r.v + h * d_ + j * r.ld,
                    {hr, d_, nj, tn, r.ld, d_, true});
    });
    if (gather_) {
      inK_.FreeTensor(k);
      inV_.FreeTensor(v);
    }
  }

  // Keys per chunk for Mmad calls of `rows` query rows. A decode item's few rows (a token's query heads of one
  // KV head) do little arithmetic per key, so the item waits on its K/V rows. Each top-up of the row stream
  // is a burst of prefetches that stalls the core until the oldest requests are served, after which the
  // arithmetic runs with few requests in flight: at 24 keys a whole-row item (every KV head) topped up 24
  // rows' lines at once. Short chunks, topped up head by head (ForKeyChunkHeads), keep the bursts short and
  // spread through the arithmetic. Zen 3, 2 threads, SmolLM2 bf16 decode graph (30 layers' caches in DRAM),
  // attention us per layer, medians of 8-10 interleaved rounds: 24 keys per top-up -> 6 keys: batch 16 x 160
  // keys 0.74x, batch 1 x 1024 0.77-0.80x, batch 1 x 160 0.92x (48 keys: 1.21x); then 6 keys per top-up ->
  // 12-key chunks topped up per head (4 rows each at 3 KV heads): 16 x 160 0.84x, 1 x 1024 0.87-0.89x,
  // 4 x 400 0.88x, 1 x 160 1.00x (9 keys: 0.84-0.99x, 18 keys: 0.92-1.11x). 12 is a whole number of score
  // blocks for every few-row block shape (2, 3 or 4 keys). Prefill items (up to 64 rows) keep 24: each
  // P x V call loads and stores its rows' accumulators, which at 12 keys would cost a sixth as many
  // instructions as its FMAs.
  static int64_t KeysPerChunk(int64_t rows) { return rows <= 8 ? 12 : 24; }

  // Each chunk of a run's keys, KV head by KV head: fn(j, nj, h) for keys [j, j + nj) of the item's head h,
  // the row stream (direct reads) topped up by that head's share of the chunk's rows before each call.
  // One head's rows are 128-512 bytes every kv_heads * head_dim elements: the hardware prefetcher does not
  // keep up, and whole-tile requests alone left the score loop stalled on its loads (bf16 16 x 1024 keys,
  // cache-resident: 85% of MmadNTRows' samples on its two K-row loads). Splitting keys (the scores' N) or
  // the keys of P x V (its K, accumulated in order) leaves every sum as it was.
  template <typename Fn>
  void ForKeyChunkHeads(const KvRun<T>& r, int64_t keys, Fn&& fn) {
    for (int64_t j = 0; j < r.n; j += keys) {
      const int64_t nj = std::min(keys, r.n - j);
      for (int64_t h = 0; h < kvn_; ++h) {
        if (!gather_) ahead_.Read(nj * (h + 1) / kvn_ - nj * h / kvn_);
        fn(j, nj, h);
      }
    }
  }

  void CopyOut(const PagedAttentionItem& it) {
    float* acc = accBuf_.Get<float>().GetPhyAddr();
    LocalTensor<float> st = statBuf_.Get<float>();
    if (it.partial >= 0) {  // (m, l, acc) for the merge stage, fp32
      DataCopy(wsGm_[it.partial], st, rows_);
      DataCopy(wsGm_[it.partial + rows_], st[rows_], rows_);
      DataCopy(wsGm_[it.partial + 2 * rows_], accBuf_.Get<float>(), rows_ * d_);
      return;
    }
    // out = acc / l, rounded straight into the output rows (a token's gn heads are adjacent there too).
    const float* l = st.GetPhyAddr() + rows_;
    for (int64_t tp = 0; tp < it.qn; ++tp) {
      T* out = oGm_.GetPhyAddr((QueryRow(it, tp) * t_->numHeads + FirstHead(it)) * d_);
      for (int64_t gi = 0; gi < it.gn; ++gi) {
        const int64_t r = tp * it.gn + gi;
        Simd().muls(acc + r * d_, acc + r * d_, 1.0f / l[r], d_);
        CastRaw<T, float>(out + gi * d_, acc + r * d_, d_);
      }
    }
  }

  const PagedAttentionTilingData* t_ = nullptr;
  int64_t d_ = 0, rows_ = 0, kvn_ = 1;
  bool gather_ = false;
  int64_t lo_[PA_MAX_ROWS], hi_[PA_MAX_ROWS];
  const int32_t* bt_ = nullptr;
  std::vector<KvRun<T>> runs_;
  RowStream ahead_;
  TPipe pipe_;
  TQue<QuePosition::VECIN, BUFFER_NUM> inK_, inV_;
  TBuf<TPosition::VECCALC> qBuf_, accBuf_, sBuf_, statBuf_;
  GlobalTensor<T> qGm_, kGm_, vGm_, oGm_;
  GlobalTensor<float> wsGm_;
};

// Combines the split partials of each merge group, row by row, in split order.
template <typename T>
class KernelPagedAttentionMerge {
 public:
  void Init(const float* workspace, GM_ADDR out, const PagedAttentionTilingData& t) {
    t_ = &t;
    d_ = t.headDim;
    wsGm_.SetGlobalBuffer(const_cast<float*>(workspace));
    oGm_.SetGlobalBuffer(reinterpret_cast<T*>(out));
    pipe_.InitBuffer(inAcc_, BUFFER_NUM, d_ * 4);
    pipe_.InitBuffer(accBuf_, d_ * 4);
    pipe_.InitBuffer(outO_, 1, d_ * int64_t(sizeof(T)));
  }

  void Process() {
    int64_t n = int64_t(t_->groups.size());
    for (int64_t g = GetBlockIdx(); g < n; g += GetBlockNum()) {
      const auto& grp = t_->groups[size_t(g)];
      for (int64_t r = 0; r < int64_t(grp.qn) * grp.gn; ++r) {
        float l = Compute(grp, r);
        CopyOut(grp, r, l);
      }
    }
  }

 private:
  // acc row = sum_s w_s acc_s, w_s = e^(m_s - max_s m_s); returns sum_s w_s l_s.
  float Compute(const PagedAttentionMergeGroup& g, int64_t r) {
    int64_t rows = int64_t(g.qn) * g.gn, stride = rows * (d_ + 2);
    float mx = -INFINITY;
    for (int64_t s = 0; s < g.splits; ++s) mx = std::max(mx, wsGm_.GetValue(g.partial + s * stride + r));
    LocalTensor<float> acc = accBuf_.Get<float>();
    Duplicate(acc, 0.0f, d_);
    float l = 0.0f;
    for (int64_t s = 0; s < g.splits; ++s) {
      int64_t p = g.partial + s * stride;
      float ms = wsGm_.GetValue(p + r);
      if (ms == -INFINITY) continue;  // no key of this split is visible to the row
      float w = std::exp(ms - mx);
      l += w * wsGm_.GetValue(p + rows + r);
      LocalTensor<float> a = inAcc_.AllocTensor<float>();
      DataCopy(a, wsGm_[p + 2 * rows + r * d_], d_);
      inAcc_.EnQue(a);
      a = inAcc_.DeQue<float>();
      Axpy(acc, a, w, d_);
      inAcc_.FreeTensor(a);
    }
    return l;
  }

  void CopyOut(const PagedAttentionMergeGroup& g, int64_t r, float l) {
    LocalTensor<float> acc = accBuf_.Get<float>();
    Muls(acc, acc, 1.0f / l, d_);
    LocalTensor<T> o = outO_.AllocTensor<T>();
    Cast(o, acc, RoundMode::CAST_RINT, d_);
    outO_.EnQue(o);
    o = outO_.DeQue<T>();
    int64_t tp = r / g.gn, gi = r % g.gn;
    int64_t row = t_->qStart[g.batch] + g.q0 + tp;
    int64_t head = int64_t(g.kvHead) * t_->groupSize + g.g0 + gi;
    DataCopy(oGm_[(row * t_->numHeads + head) * d_], o, d_);
    outO_.FreeTensor(o);
  }

  const PagedAttentionTilingData* t_ = nullptr;
  int64_t d_ = 0;
  TPipe pipe_;
  TQue<QuePosition::VECIN, BUFFER_NUM> inAcc_;
  TQue<QuePosition::VECOUT, 1> outO_;
  TBuf<TPosition::VECCALC> accBuf_;
  GlobalTensor<float> wsGm_;
  GlobalTensor<T> oGm_;
};

template <typename T>
void RunPagedAttention(GM_ADDR q, GM_ADDR kc, GM_ADDR vc, const int32_t* bt, GM_ADDR out, float* ws,
                       const PagedAttentionTilingData& t) {
  KernelPagedAttention<T> op;
  op.Init(q, kc, vc, bt, out, ws, t);
  op.Process();
}

template <typename T>
void RunPagedAttentionMerge(const float* ws, GM_ADDR out, const PagedAttentionTilingData& t) {
  KernelPagedAttentionMerge<T> op;
  op.Init(ws, out, t);
  op.Process();
}

}  // namespace

void PagedAttention(void* out, const void* q, int64_t qStride, const void* keyCache, const void* valueCache,
                    const int32_t* blockTables, const int32_t* contextLens, const int32_t* qLens, int64_t batch,
                    int64_t numHeads, int64_t kvHeads, int64_t headDim, int64_t numBlocks, int64_t blockSize,
                    int64_t maxBlocks, int64_t totalQ, float scale, int64_t window, DataType dtype,
                    const SocInfo& soc) {
  PagedAttentionTilingData t = PagedAttentionTiling(batch, numHeads, kvHeads, headDim, numBlocks, blockSize, maxBlocks,
                                                    contextLens, qLens, totalQ, qStride, scale, window, dtype, soc);
  CheckBlockTables(blockTables, t);
  PagedAttentionRun(t, out, q, keyCache, valueCache, blockTables, soc);
}

void PagedAttentionRun(const PagedAttentionTilingData& t, void* out, const void* q, const void* keyCache,
                       const void* valueCache, const int32_t* blockTables, const SocInfo& soc) {
  if (t.items.empty()) return;  // every q_len is 0
  // Partials live for one call; the buffer is kept per calling thread so decode
  // steps do not allocate.
  thread_local std::vector<float> workspace;
  if (int64_t(workspace.size()) < t.workspaceFloats) workspace.resize(size_t(t.workspaceFloats));
  float* ws = workspace.data();
  DataType dtype = TilingKeyDtype(t.tilingKey);
  auto attention = [&]() {
    DispatchDtype(dtype, [&](auto tag) {
      RunPagedAttention<decltype(tag)>(GmAddr(q), GmAddr(keyCache), GmAddr(valueCache), blockTables, GmAddr(out), ws, t);
    });
  };
  KernelLaunch(t.blockDim, soc.ub_size, attention);
  if (t.groups.empty()) return;
  auto merge = [&]() {
    DispatchDtype(dtype, [&](auto tag) { RunPagedAttentionMerge<decltype(tag)>(ws, GmAddr(out), t); });
  };
  KernelLaunch(t.mergeBlockDim, soc.ub_size, merge);
}

}  // namespace atb
