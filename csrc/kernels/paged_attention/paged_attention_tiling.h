#pragma once
#include <cstdint>
#include <vector>

#include "ascendc/dtype.h"
#include "ascendc/soc.h"

namespace atb {

// tilingKey = dtype * 10 + variant. DIRECT: the cube reads each K/V run where
// it lies in the paged cache (one run per cache block). GATHER (block_size <
// PA_GATHER_BELOW): runs are copied into a contiguous UB tile first, so the
// matmuls see one long run instead of many 1..15-token ones.
enum PagedAttentionVariant : int64_t { PA_DIRECT = 0, PA_GATHER = 1 };
constexpr int64_t PA_GATHER_BELOW = 16;
// Most query rows (tokens x heads) one q tile holds.
constexpr int64_t PA_MAX_ROWS = 64;

// One core's unit of work: the query rows (query tokens q0..q0+qn of sequence
// `batch`, heads kvHead*G + g0 .. +gn) against key positions [kvStart, kvEnd).
// gn > G only in decode (qn == 1, g0 == 0): the item then covers the gn / G
// consecutive KV heads from kvHead, its rows the token's gn query heads in order.
// partial < 0: the item covers the rows' whole key range and writes the output;
// otherwise it writes (max, sum, acc) for its rows at workspace[partial].
struct PagedAttentionItem {
  int32_t batch, kvHead, g0, gn, q0, qn, kvStart, kvEnd;
  int64_t partial;
};

// The KV heads an item covers; groupSize = query heads per KV head.
inline int64_t ItemKvHeads(const PagedAttentionItem& it, int64_t groupSize) {
  return it.gn > groupSize ? it.gn / groupSize : 1;
}

// The rows of one q tile whose key range was split into `splits` chunks;
// the merge stage combines their partials (stored back to back) in order.
struct PagedAttentionMergeGroup {
  int32_t batch, kvHead, g0, gn, q0, qn, splits;
  int64_t partial;
};

struct PagedAttentionTilingData {
  int64_t batch = 0, numHeads = 0, kvHeads = 0, headDim = 0, groupSize = 0;
  int64_t blockSize = 0, maxBlocks = 0, numBlocks = 0, totalQ = 0, qStride = 0;
  int64_t window = 0;           // <= 0: full causal context
  float scale = 1.0f;
  int64_t rowsPerTile = 0;      // query rows (tokens x heads) per q tile, Mmax
  int64_t headsPerTile = 0;     // query heads of one KV head per q tile, <= groupSize
  int64_t kvTile = 0;           // keys per score tile (TN)
  int64_t chunk = 0;            // keys per split (CH), a multiple of kvTile
  int64_t blockDim = 1, mergeBlockDim = 0;
  int64_t blockFactor = 0;      // items per core (a contiguous run); the last core takes the remainder
  int64_t ubBytes = 0, mergeUbBytes = 0;
  int64_t workspaceFloats = 0;  // partials: rows * (headDim + 2) floats per split item
  int64_t tilingKey = 0;
  std::vector<int64_t> qStart;  // first query row of each sequence, [batch + 1]
  std::vector<int32_t> contextLens, qLens;
  std::vector<PagedAttentionItem> items;
  std::vector<PagedAttentionMergeGroup> groups;
};

// Pure host function of the shapes, the per-sequence lengths, dtype and SoC.
// Validates every length (context_len in [1, maxBlocks * blockSize], q_len in
// [0, context_len], sum(q_len) == totalQ) and throws std::invalid_argument.
//
// Results are bitwise identical on every SoC and thread count: the key range
// is cut on a fixed grid of `chunk` positions and scored in fixed `kvTile`
// tiles, both chosen from (head_dim, dtype, block_size) to fit the smallest UB
// in the SoC table (192 KiB); the SoC only decides which core runs which item
// and whether a decode item covers one KV head or all (the same sums either way).
// qLens == nullptr: one query per sequence (decode).
PagedAttentionTilingData PagedAttentionTiling(int64_t batch, int64_t numHeads, int64_t kvHeads, int64_t headDim,
                                              int64_t numBlocks, int64_t blockSize, int64_t maxBlocks,
                                              const int32_t* contextLens, const int32_t* qLens, int64_t totalQ,
                                              int64_t qStride, float scale, int64_t window, AscendC::DataType dtype,
                                              const AscendC::SocInfo& soc);

// Every block id a sequence uses (its first ceil(context_len / block_size)
// entries) must lie in [0, numBlocks); entries past that are never read.
void CheckBlockTables(const int32_t* blockTables, const PagedAttentionTilingData& t);

// Element offset of key position pos's row for KV head kvHead in a [blocks, block_size, kv_heads,
// head_dim] cache, through one sequence's block table row.
inline int64_t CacheRowOffset(const PagedAttentionTilingData& t, const int32_t* table, int64_t pos, int64_t kvHead) {
  return ((int64_t(table[pos / t.blockSize]) * t.blockSize + pos % t.blockSize) * t.kvHeads + kvHead) * t.headDim;
}

// Launches a validated plan (PagedAttentionTiling + CheckBlockTables) over
// these tensors: the attention stage and, when a sequence's key range was
// split over cores, the merge stage. A decode graph plans once per step (per
// distinct window) and runs the plan in every layer (ATB Setup / Execute).
void PagedAttentionRun(const PagedAttentionTilingData& t, void* out, const void* q, const void* keyCache,
                       const void* valueCache, const int32_t* blockTables, const AscendC::SocInfo& soc);

// Host entry: validates, tiles (the plan), then runs it.
//   out          [totalQ, numHeads, headDim] contiguous, dtype
//   q            [totalQ, numHeads, headDim], token stride qStride elements
//   key/valueCache [numBlocks, blockSize, kvHeads, headDim] contiguous
//   blockTables  int32 [batch, maxBlocks]; contextLens int32 [batch]
//   qLens        int32 [batch] or nullptr (decode: totalQ == batch)
//   window       sliding window (query at p sees keys p - window < j <= p), <= 0 = none
void PagedAttention(void* out, const void* q, int64_t qStride, const void* keyCache, const void* valueCache,
                    const int32_t* blockTables, const int32_t* contextLens, const int32_t* qLens, int64_t batch,
                    int64_t numHeads, int64_t kvHeads, int64_t headDim, int64_t numBlocks, int64_t blockSize,
                    int64_t maxBlocks, int64_t totalQ, float scale, int64_t window, AscendC::DataType dtype,
                    const AscendC::SocInfo& soc);

}  // namespace atb
