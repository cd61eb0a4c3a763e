// Flash attention (prefill): varlen packed sequences, GQA/MQA, causal or not,
// optional sliding window; online softmax in fp32, never an S x S matrix.
#pragma once
#include <algorithm>
#include <cstdint>
#include <vector>

#include "ascendc/dtype.h"
#include "ascendc/soc.h"

namespace atb {

// One unit of work: qLen query positions of one sequence (from qStart, relative
// to the sequence's first token) for groupSplit query heads sharing kv head
// kvHead, starting at query head kvHead * groupSize + headOffset. Its rows are
// position-major: row m is position m / groupSplit, head m % groupSplit.
struct FlashAttentionUnit {
  int32_t seq;
  int32_t kvHead;
  int32_t headOffset;
  int32_t qStart;
  int32_t qLen;
};

struct FlashAttentionTilingData {
  int64_t batch = 0, numTokens = 0, numHeads = 0, numKvHeads = 0, headDim = 0;
  int64_t groupSize = 1;   // query heads per kv head
  int64_t groupSplit = 1;  // query heads per unit (divides groupSize; == it unless the UB is too small)
  int64_t blockQ = 1;      // query positions per unit
  int64_t blockKv = 64;    // keys per K/V tile
  bool dpBf16 = false;     // bf16 on a table with the bf16 GEMM: both products as bf16 GEMMs (the kernel's dp path)
  int64_t maxRows = 1;     // blockQ * groupSplit: the M of the score and P.V products
  int64_t ubRowElems = 0;  // elements per UB row of a Q/K/V/out tile (head_dim padded to 32 bytes)
  bool causal = true;
  int64_t window = 0;      // 0: no sliding window
  float scale = 1.0f;
  int64_t blockDim = 1;
  int64_t tilingKey = 0;   // the DataType
  int64_t ubBytes = 0;     // UB the kernel will carve per core
  std::vector<FlashAttentionUnit> units;  // grouped by core: core c owns [coreStart[c], coreStart[c+1])
  std::vector<int64_t> coreStart;
  std::vector<int64_t> coreCost;  // estimated multiply-adds per core (the balance the split achieved)
};

// Token strides of q/k/v in elements (the last dim is always contiguous), so
// views into a fused QKV projection are read where they lie.
struct FlashAttentionStrides {
  int64_t qToken, qHead, kToken, kHead, vToken, vHead;
  static FlashAttentionStrides Contiguous(int64_t numHeads, int64_t numKvHeads, int64_t headDim) {
    return {numHeads * headDim, headDim, numKvHeads * headDim, headDim, numKvHeads * headDim, headDim};
  }
};

// The K/V tile workspace the host prepares once per call (flash_attention_kernel.cpp), per (tile, kv head), tile
// g of sequence b being tileBase[b] + j; the kernel reads tile (g, h) at + (g * numKvHeads + h) * headDim * blockKv.
// * bf16 GEMM path: each tile's V transposed, V^T [headDim][blockKv] (vT), and its K rows copied together,
//   [keys][headDim] (kTiles).
// * fp32 path (every other dtype and table): the tile's K and V rows copied together and widened to fp32,
//   [keys][headDim] each (kF, vF), so no unit copies or widens a tile again.
struct FlashAttentionVT {
  const uint16_t* vT = nullptr;
  const int64_t* tileBase = nullptr;
  const uint16_t* kTiles = nullptr;
  const float* kF = nullptr;
  const float* vF = nullptr;
};

// Elements before the V^T of tile g (tileBase[b] + j), kv head h in the workspace.
inline int64_t FlashAttentionVTOffset(int64_t g, int64_t h, int64_t numKvHeads, int64_t headDim, int64_t blockKv) {
  return (g * numKvHeads + h) * headDim * blockKv;
}

// UB of the bf16 path's packed P (exp_pack_pairs_bf16 of a rows x blockKv P^T tile: 16-row panels).
inline int64_t FlashAttentionPackedPBytes(int64_t rows, int64_t blockKv) {
  return (rows + 15) / 16 * 16 * ((blockKv + 1) / 2) * 2 * 2;
}

// Keys [first, last) * blockKv of a sequence of seqLen tokens that queries
// [qStart, qStart + qLen) can see; tiles outside are skipped entirely.
inline void FlashAttentionKvTiles(int64_t qStart, int64_t qLen, int64_t seqLen, int64_t blockKv, bool causal,
                                  int64_t window, int64_t* first, int64_t* last) {
  int64_t qHi = qStart + qLen - 1;
  int64_t keyLo = 0, keyHi = seqLen - 1;
  if (causal) keyHi = std::min(keyHi, qHi);
  if (window > 0) {
    keyLo = std::max<int64_t>(0, qStart - window + 1);
    if (!causal) keyHi = std::min(keyHi, qHi + window - 1);
  }
  *first = keyLo / blockKv;
  *last = keyHi / blockKv + 1;
}

// Pure host function of (sequence lengths, heads, head_dim, dtype, mask, SoC).
// Validates the shapes and cu_seqlens (0 first, non-decreasing, numTokens last).
FlashAttentionTilingData FlashAttentionTiling(const int32_t* cuSeqlens, int64_t batch, int64_t numTokens,
                                              int64_t numHeads, int64_t numKvHeads, int64_t headDim,
                                              AscendC::DataType dtype, float scale, bool causal, int64_t window,
                                              const AscendC::SocInfo& soc);

// Host entry: tiles and launches. q [numTokens, numHeads, headDim], k/v
// [numTokens, numKvHeads, headDim] with the given strides; out is a contiguous
// [numTokens, numHeads, headDim] tensor of `dtype`. cuSeqlens has batch + 1 entries.
void FlashAttention(void* out, const void* q, const void* k, const void* v, const int32_t* cuSeqlens, int64_t batch,
                    int64_t numTokens, int64_t numHeads, int64_t numKvHeads, int64_t headDim,
                    const FlashAttentionStrides& strides, AscendC::DataType dtype, float scale, bool causal,
                    int64_t window, const AscendC::SocInfo& soc);

}  // namespace atb
