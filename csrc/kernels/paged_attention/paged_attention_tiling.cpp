#include "paged_attention_tiling.h"

#include <algorithm>

#include "ascendc/error.h"
#include "kernels/common/tiling_utils.h"
#include "kernels/common/tiling_key.h"

namespace atb {

using AscendC::CeilDiv;

namespace {
// Tiles are sized for the smallest UB in the SoC table so that every SoC runs
// the same tiles and produces the same bits (see the header).
constexpr int64_t kTileUbBudget = 192 * 1024;
// Direct reads: 128 keys per score tile (a 128 x 128 fp32 K tile is 64 KiB of
// cache traffic per MmadNT call, long enough to hide the per-tile softmax).
constexpr int64_t kDirectKvTile = 128;
// Gather staging (K and V, double-buffered) is held to 64 KiB of the UB.
constexpr int64_t kGatherStageBytes = 64 * 1024;
// Split grid: 256 keys per chunk. A split costs one partial row write of
// (head_dim + 2) floats per query row, <= 2% of the chunk's K/V bytes for
// head_dim >= 64, and 256-key chunks give a 2048-token sequence 8 pieces to
// spread over cores at batch 1.
constexpr int64_t kChunk = 256;
// Host cores are only worth waking for 16 KiB of K/V traffic each. In a decode step the K/V rows come
// from DRAM (the weights streamed through the caches since the last step), so a second core's misses
// in flight pay for the hand-off well below the 64 KiB this was first set to with warm caches. Zen 3,
// 2 threads, SmolLM2 shapes (bf16, 3 KV heads), 30 layers' caches with 16 MiB read between calls,
// medians of 20-25 interleaved rounds, batch 1 at 160 keys (123 KB, 3 items): 1 core 43-54 us per
// layer, 3 blocks on 2 cores 38-39 us; at 40 and 300 keys unchanged (1 and 3 blocks either way).
constexpr int64_t kMinBytesPerHostCore = 16 * 1024;

// The keys [lo, hi) that query positions pFirst..pLast see (causal, sliding window) and the chunks
// [c0, c1] of the fixed grid they span.
struct VisibleKeys {
  int64_t lo, hi, c0, c1;
  VisibleKeys(int64_t pFirst, int64_t pLast, int64_t window)
      : lo(window ? std::max<int64_t>(0, pFirst - window + 1) : 0), hi(pLast + 1), c0(lo / kChunk),
        c1((hi - 1) / kChunk) {}
};

// q in and out are an NPU's staging (the host kernel reads q and writes out where they lie); kept, so every SoC
// keeps the tiles it had.
int64_t AttentionUb(int64_t m, int64_t tn, int64_t d, int64_t elt, bool gather) {
  int64_t ub = 2 * UbSlot(m * d * elt)         // q in, out (storage type)
               + 2 * UbSlot(m * d * 4)         // scaled q, acc (fp32)
               + UbSlot(m * tn * 4)            // scores / probabilities
               + UbSlot(3 * m * 4);            // running max, sum, rescale factor
  if (gather) ub += 2 * AscendC::BUFFER_NUM * UbSlot(tn * d * elt);  // K and V tiles
  return ub;
}

int64_t MergeUb(int64_t d, int64_t elt) {
  return AscendC::BUFFER_NUM * UbSlot(d * 4) + UbSlot(d * 4) + UbSlot(d * elt);
}

// On the host, 4 logical cores per thread: the pool hands blocks out as
// threads come free, so a thread that the (shared) machine preempts, or that
// drew shorter items, does not hold up the whole launch.
constexpr int64_t kHostBlocksPerThread = 4;

int64_t CoreCap(const AscendC::SocInfo& soc, int64_t units, int64_t bytes) {
  int64_t cores = std::max<int64_t>(1, soc.cube_core_num);
  if (soc.is_host)
    cores = std::min(cores * kHostBlocksPerThread, std::max<int64_t>(1, bytes / kMinBytesPerHostCore));
  return std::max<int64_t>(1, std::min(cores, units));
}
}  // namespace

PagedAttentionTilingData PagedAttentionTiling(int64_t batch, int64_t numHeads, int64_t kvHeads, int64_t headDim,
                                              int64_t numBlocks, int64_t blockSize, int64_t maxBlocks,
                                              const int32_t* contextLens, const int32_t* qLens, int64_t totalQ,
                                              int64_t qStride, float scale, int64_t window, AscendC::DataType dtype,
                                              const AscendC::SocInfo& soc) {
  const char* op = "paged_attention";
  ATB_CHECK(batch >= 1, op, ": batch must be >= 1, got ", batch);
  ATB_CHECK(numHeads >= 1 && kvHeads >= 1 && numHeads % kvHeads == 0, op, ": num_heads (", numHeads,
            ") must be a positive multiple of num_kv_heads (", kvHeads, ")");
  ATB_CHECK(headDim >= 1, op, ": head_dim must be >= 1, got ", headDim);
  ATB_CHECK(numBlocks >= 1 && blockSize >= 1 && maxBlocks >= 1, op, ": need >= 1 cache block, >= 1 slot per block and ",
            ">= 1 block table column, got ", numBlocks, ", ", blockSize, ", ", maxBlocks);
  ATB_CHECK(qStride >= numHeads * headDim, op, ": q's token stride ", qStride, " must be >= num_heads * head_dim = ",
            numHeads * headDim);
  CheckDtypeOnSoc(op, dtype, soc);

  PagedAttentionTilingData t;
  t.batch = batch;
  t.numHeads = numHeads;
  t.kvHeads = kvHeads;
  t.headDim = headDim;
  t.groupSize = numHeads / kvHeads;
  t.blockSize = blockSize;
  t.maxBlocks = maxBlocks;
  t.numBlocks = numBlocks;
  t.totalQ = totalQ;
  t.qStride = qStride;
  t.scale = scale;
  t.window = window > 0 ? window : 0;

  // Lengths first: nothing is tiled from values that were not checked.
  int64_t capacity = maxBlocks * blockSize;
  t.contextLens.assign(contextLens, contextLens + batch);
  t.qLens.resize(size_t(batch));
  t.qStart.resize(size_t(batch + 1));
  t.qStart[0] = 0;
  for (int64_t b = 0; b < batch; ++b) {
    int64_t ctx = contextLens[b];
    ATB_CHECK(ctx >= 1 && ctx <= capacity, op, ": context_lens[", b, "] = ", ctx, " must be in [1, max_blocks * ",
              "block_size] = [1, ", maxBlocks, " * ", blockSize, "] = [1, ", capacity, "]");
    int64_t ql = qLens ? qLens[b] : 1;
    ATB_CHECK(ql >= 0 && ql <= ctx, op, ": q_lens[", b, "] = ", ql, " must be in [0, context_lens[", b, "]] = [0, ",
              ctx, "] (the new tokens are part of the context)");
    t.qLens[b] = int32_t(ql);
    t.qStart[b + 1] = t.qStart[b] + ql;
  }
  ATB_CHECK(t.qStart[batch] == totalQ, op, ": q has ", totalQ, " query rows but ",
            qLens ? "sum(q_lens)" : "batch (one query per sequence)", " is ", t.qStart[batch]);

  int64_t elt = AscendC::DataTypeSize(dtype);
  bool gather = blockSize < PA_GATHER_BELOW;
  int64_t tn = kDirectKvTile;
  if (gather)
    while (tn > 16 && 2 * AscendC::BUFFER_NUM * tn * headDim * elt > kGatherStageBytes) tn /= 2;
  int64_t m = PA_MAX_ROWS;
  while (m >= 1 && AttentionUb(m, tn, headDim, elt, gather) > kTileUbBudget) --m;
  ATB_CHECK(m >= 1, op, ": head_dim ", headDim, " is too large: one query row's tiles need ",
            AttentionUb(1, tn, headDim, elt, gather), " bytes of UB, more than ", kTileUbBudget);
  t.kvTile = tn;
  t.chunk = kChunk;
  t.rowsPerTile = m;
  t.headsPerTile = std::min(t.groupSize, m);
  t.ubBytes = AttentionUb(m, tn, headDim, elt, gather);
  ATB_CHECK(t.ubBytes <= soc.ub_size, op, " tiling: needs ", t.ubBytes, " bytes of UB, ", soc.name, " has ", soc.ub_size);
  t.mergeUbBytes = MergeUb(headDim, elt);
  t.tilingKey = EncodeTilingKey(dtype, gather ? PA_GATHER : PA_DIRECT);

  // Work items: q tiles x the fixed chunk grid over each tile's key range x
  // KV heads, heads innermost. Cores take contiguous runs of items, so one core
  // reads a chunk for every KV head in turn: the chunk's cache rows (a row holds
  // all heads) come in whole pages and cache lines instead of one head's
  // 128..512-byte slice per page, which would cost a TLB walk per row.
  //
  // Decode batches (one query per sequence, at least as many key chunks in all as cores): an item takes
  // every KV head of its chunk (kvn = kvHeads, its rows the token's heads in order) when they fit one q
  // tile, and scores each 24-key run for every head in turn, so its cache rows are read whole, front to
  // back, instead of one head's slice of each row per item. Each row's sums are those of the one-head
  // items. Zen 3, 2 threads, SmolLM2 shapes (bf16, 9 heads, 3 KV heads), 30 layers' caches with 16 MiB
  // read between calls, interleaved medians, us per layer: batch 16 at 160 keys 408-423 -> 332-358, at
  // 600 keys 2065 -> 1585; batch 2 at 160 keys 81 -> 51; batch 16 with warm caches 191 -> 167. Counting
  // chunks rather than sequences brings one long sequence in too (128-token blocks, 64 MiB read between
  // steps, medians of 3 interleaved runs): batch 1 at 400 keys 83 -> 65, at 1024 keys 203 -> 145, at
  // 2048 keys 395 -> 263. One sequence of one chunk keeps one item per KV head, so both cores work.
  bool wholeRows = !gather && t.headsPerTile == t.groupSize && numHeads <= m;
  int64_t decodeChunks = 0;  // the items whole-row decode would make: at least one per core
  for (int64_t b = 0; wholeRows && b < batch; ++b) {
    wholeRows = t.qLens[b] <= 1;
    if (t.qLens[b] == 1) {
      VisibleKeys keys(t.contextLens[b] - 1, t.contextLens[b] - 1, t.window);
      decodeChunks += keys.c1 - keys.c0 + 1;
    }
  }
  wholeRows = wholeRows && decodeChunks >= std::max<int64_t>(2, soc.cube_core_num);
  const int64_t kvn = wholeRows ? kvHeads : 1;
  int64_t ws = 0, kvBytes = 0, mergeBytes = 0;
  for (int64_t b = 0; b < batch; ++b) {
    int64_t ctx = t.contextLens[b], ql = t.qLens[b];
    for (int64_t g0 = 0; g0 < t.groupSize; g0 += t.headsPerTile) {
      int64_t gn = std::min(t.headsPerTile, t.groupSize - g0);
      int64_t qp = std::max<int64_t>(1, m / gn);
      for (int64_t q0 = 0; q0 < ql; q0 += qp) {
        int64_t qn = std::min(qp, ql - q0);
        int64_t pFirst = ctx - ql + q0, pLast = pFirst + qn - 1;
        const VisibleKeys keys(pFirst, pLast, t.window);
        const int64_t lo = keys.lo, hi = keys.hi, c0 = keys.c0, c1 = keys.c1, splits = c1 - c0 + 1;
        const int64_t units = kvHeads / kvn, heads = kvn * gn;  // items per chunk, query heads per item
        int64_t partialFloats = qn * heads * (headDim + 2);
        kvBytes += kvHeads * (hi - lo) * 2 * headDim * elt;
        int64_t base = ws;
        if (splits > 1) {
          for (int64_t u = 0; u < units; ++u)
            t.groups.push_back({int32_t(b), int32_t(u * kvn), int32_t(g0), int32_t(heads), int32_t(q0), int32_t(qn),
                                int32_t(splits), base + u * splits * partialFloats});
          ws += units * splits * partialFloats;
          mergeBytes += units * splits * partialFloats * 4;
        }
        for (int64_t c = c0; c <= c1; ++c)
          for (int64_t u = 0; u < units; ++u)
            t.items.push_back({int32_t(b), int32_t(u * kvn), int32_t(g0), int32_t(heads), int32_t(q0), int32_t(qn),
                               int32_t(std::max(lo, c * kChunk)), int32_t(std::min(hi, (c + 1) * kChunk)),
                               splits > 1 ? base + (u * splits + c - c0) * partialFloats : -1});
      }
    }
  }
  t.workspaceFloats = ws;
  int64_t n = int64_t(t.items.size());
  t.blockDim = CoreCap(soc, n, kvBytes);
  t.blockFactor = CeilDiv(n, t.blockDim);
  // Every q_len 0 leaves no items (blockFactor 0): one idle core, never a division by zero.
  if (n > 0) t.blockDim = CeilDiv(n, t.blockFactor);  // no core without items
  t.mergeBlockDim = t.groups.empty() ? 0 : CoreCap(soc, int64_t(t.groups.size()), mergeBytes);
  return t;
}

void CheckBlockTables(const int32_t* blockTables, const PagedAttentionTilingData& t) {
  for (int64_t b = 0; b < t.batch; ++b) {
    int64_t used = CeilDiv(t.contextLens[b], t.blockSize);
    const int32_t* row = blockTables + b * t.maxBlocks;
    for (int64_t i = 0; i < used; ++i)
      ATB_CHECK(row[i] >= 0 && row[i] < t.numBlocks, "paged_attention: block_tables[", b, ", ", i, "] = ", row[i],
                " is out of range: the cache has ", t.numBlocks, " blocks (sequence ", b, " has context_len ",
                t.contextLens[b], ", so it reads its first ", used, " block ids)");
  }
}

}  // namespace atb
