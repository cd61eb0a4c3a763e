#include "flash_attention_tiling.h"

#include <numeric>

#include "ascendc/error.h"
#include "ascendc/simd.h"
#include "kernels/common/tiling_utils.h"

namespace atb {

using AscendC::AlignUp;
using AscendC::CeilDiv;

namespace {

constexpr int64_t kMaxHeadDim = 256;
// Rows (query positions x heads) per unit the tiling aims for. Each K/V tile
// is pulled through L1 once per unit, so taller units amortize that better; past ~128 rows the S^T tile (64 keys x rows x 4 B)
// outgrows L1 (32-64 KiB) and the causal waste on the diagonal grows.
constexpr int64_t kTargetRows = 128;
constexpr int64_t kHostBlocksPerThread = 4;

int64_t UbRowElems(int64_t headDim, int64_t elt) { return AlignUp(headDim * elt, AscendC::ONE_BLK_SIZE) / elt; }

// Keys per K/V tile. It sets where the online softmax rescales, i.e. the
// rounding of every output, so it depends on head_dim and the path only, never
// on the SoC: every SoC then produces bit-identical results.
// * fp32 cube path: 64 keys make the two products 64-deep/-wide; at head_dim >
//   128 the fp32 K and V tiles (2 x 64 x 256 x 4 B = 128 KiB) would crowd L1
//   and L2 (and did a 192 KiB UB when they were staged there), so 32.
// * bf16 GEMM path (dp): no K/V tile in UB, so 128 keys whatever head_dim: four
//   32-k AMX chunks per load and store of acc^T in P.V. AMX Xeon, 32/8/128 at
//   S = 2048, one thread: 64 keys 10-15% slower than 128; 256 no faster (the
//   128 x 256 fp32 score tile leaves L1).
int64_t BlockKv(int64_t headDim, bool dp) {
  if (dp) return 128;
  return headDim <= 128 ? 64 : 32;
}

// UB carved by the kernel for a unit of `rows` rows (see KernelFlashAttention::Init).
int64_t UbBytes(int64_t rows, int64_t headDim, int64_t blockKv, int64_t elt, bool dp) {
  int64_t ld = UbRowElems(headDim, elt);
  int64_t b = 0;
  if (dp) {  // K and V are read from the host's tiles, never copied into UB
    b += 2 * UbSlot(rows * headDim * 4);                    // packed Q (within qT's fp32 slot) and acc^T
    b += UbSlot(rows * ld * elt);                           // io: the Q block as copied in
    b += UbSlot(blockKv * rows * 4);                        // S^T
    b += UbSlot(FlashAttentionPackedPBytes(rows, blockKv));  // P packed in k pairs
    b += UbSlot(6 * rows * 4);                              // row statistics
    return b;
  }
  // K and V are read from the host's fp32 tiles, Q and the output where they lie: none is staged in UB
  b += 2 * UbSlot(rows * headDim * 4);  // qT (scaled Q, transposed) and acc (fp32 output)
  b += UbSlot(blockKv * rows * 4);      // S^T / P^T tile
  b += UbSlot(6 * rows * 4);            // row statistics: max, new max, safe max, alpha, sum, tile sum
  return b;
}

}  // namespace

FlashAttentionTilingData FlashAttentionTiling(const int32_t* cuSeqlens, int64_t batch, int64_t numTokens,
                                              int64_t numHeads, int64_t numKvHeads, int64_t headDim,
                                              AscendC::DataType dtype, float scale, bool causal, int64_t window,
                                              const AscendC::SocInfo& soc) {
  ATB_CHECK(numHeads >= 1 && numKvHeads >= 1, "flash_attention: num_heads and num_kv_heads must be >= 1, got ",
            numHeads, " and ", numKvHeads);
  ATB_CHECK(numHeads % numKvHeads == 0, "flash_attention: num_heads (", numHeads,
            ") must be a multiple of num_kv_heads (", numKvHeads, ")");
  ATB_CHECK(headDim >= 1 && headDim <= kMaxHeadDim, "flash_attention: head_dim must be in [1, ", kMaxHeadDim,
            "], got ", headDim);
  ATB_CHECK(dtype != AscendC::DataType::BFLOAT16 || soc.supports_bf16, "flash_attention: bfloat16 is not supported on ",
            soc.name, " (no bf16 vector unit); use float16 or float32");
  ATB_CHECK(window >= 0, "flash_attention: window must be >= 1 (or 0 for none), got ", window);
  ATB_CHECK(batch >= 0 && numTokens >= 0, "flash_attention: batch and token count must be >= 0");
  ATB_CHECK(numTokens <= INT32_MAX, "flash_attention: ", numTokens, " tokens exceed int32 positions");
  ATB_CHECK(cuSeqlens[0] == 0, "flash_attention: cu_seqlens[0] must be 0, got ", cuSeqlens[0]);
  int64_t maxLen = 0;
  for (int64_t b = 0; b < batch; ++b) {
    ATB_CHECK(cuSeqlens[b + 1] >= cuSeqlens[b], "flash_attention: cu_seqlens must be non-decreasing, got cu_seqlens[",
              b + 1, "]=", cuSeqlens[b + 1], " < cu_seqlens[", b, "]=", cuSeqlens[b]);
    maxLen = std::max<int64_t>(maxLen, cuSeqlens[b + 1] - cuSeqlens[b]);
  }
  ATB_CHECK(cuSeqlens[batch] == numTokens, "flash_attention: cu_seqlens[-1] must equal the number of tokens (",
            numTokens, "), got ", cuSeqlens[batch]);

  FlashAttentionTilingData t;
  t.batch = batch;
  t.numTokens = numTokens;
  t.numHeads = numHeads;
  t.numKvHeads = numKvHeads;
  t.headDim = headDim;
  t.groupSize = numHeads / numKvHeads;
  t.causal = causal;
  t.window = window;
  t.scale = scale;
  t.tilingKey = int64_t(dtype);
  int64_t elt = AscendC::DataTypeSize(dtype);
  t.ubRowElems = UbRowElems(headDim, elt);
  const bool dp = dtype == AscendC::DataType::BFLOAT16 && AscendC::Simd().mmad_dp_bf16_packed != nullptr;
  t.dpBf16 = dp;
  t.blockKv = BlockKv(headDim, dp);

  // Heads per unit: the whole group, so each K/V tile is loaded once for all
  // of its query heads; a smaller divisor only when one position of the whole
  // group does not fit the UB (e.g. MQA with 128 heads of 256 in fp32 on 192 KiB).
  int64_t gs = t.groupSize;
  while (gs > 1 && UbBytes(gs, headDim, t.blockKv, elt, dp) > soc.ub_size) {
    int64_t d = gs - 1;
    while (t.groupSize % d) --d;
    gs = d;
  }
  ATB_CHECK(UbBytes(gs, headDim, t.blockKv, elt, dp) <= soc.ub_size, "flash_attention tiling: head_dim ", headDim,
            " needs ", UbBytes(gs, headDim, t.blockKv, elt, dp), " bytes of UB, ", soc.name, " has ", soc.ub_size);
  t.groupSplit = gs;

  // Positions per unit: about kTargetRows rows, a multiple of 16 / gcd(gs, 16)
  // so the rows fill whole 16-wide panels of the score product, no more than
  // the longest sequence, and within the UB.
  int64_t step = 16 / std::gcd<int64_t>(gs, 16);
  int64_t bq = std::max<int64_t>(1, kTargetRows / gs);
  if (bq >= step) bq = bq / step * step;
  bq = std::max<int64_t>(1, std::min(bq, maxLen));
  while (bq > 1 && UbBytes(bq * gs, headDim, t.blockKv, elt, dp) > soc.ub_size) bq -= (bq > step ? step : 1);
  t.blockQ = bq;
  t.maxRows = bq * gs;
  t.ubBytes = UbBytes(t.maxRows, headDim, t.blockKv, elt, dp);

  // Units, and their cost in multiply-adds (Q.K^T and P.V over the K/V tiles
  // they visit, plus loading Q and storing the output). Causal units near a
  // sequence's end cost up to S/blockQ times more than those near its start,
  // so they are spread by longest-processing-time-first: the costliest unit
  // goes to the least loaded core.
  struct Costed {
    FlashAttentionUnit u;
    int64_t cost;
  };
  std::vector<Costed> all;
  for (int64_t b = 0; b < batch; ++b) {
    int64_t len = cuSeqlens[b + 1] - cuSeqlens[b];
    for (int64_t qs = 0; qs < len; qs += bq) {
      int64_t ql = std::min(bq, len - qs), first, last;
      FlashAttentionKvTiles(qs, ql, len, t.blockKv, causal, window, &first, &last);
      int64_t keys = std::min(last * t.blockKv, len) - first * t.blockKv;
      int64_t cost = ql * gs * headDim * (2 * keys + 1);
      for (int64_t g = 0; g < numKvHeads; ++g)
        for (int64_t h = 0; h < t.groupSize; h += gs)
          all.push_back({{int32_t(b), int32_t(g), int32_t(h), int32_t(qs), int32_t(ql)}, cost});
    }
  }
  std::stable_sort(all.begin(), all.end(), [](const Costed& a, const Costed& b) { return a.cost > b.cost; });
  // On the host, 4 logical cores per thread, each LPT-balanced: the pool hands
  // them out as threads come free, so a thread the shared machine preempts
  // does not hold up the launch (its remaining blocks go to the other threads).
  int64_t cores = std::max<int64_t>(1, soc.cube_core_num) * (soc.is_host ? kHostBlocksPerThread : 1);
  t.blockDim = std::max<int64_t>(1, std::min<int64_t>(cores, int64_t(all.size())));
  std::vector<std::vector<FlashAttentionUnit>> perCore(t.blockDim);
  t.coreCost.assign(t.blockDim, 0);
  for (const Costed& c : all) {
    int64_t best = std::min_element(t.coreCost.begin(), t.coreCost.end()) - t.coreCost.begin();
    perCore[best].push_back(c.u);
    t.coreCost[best] += c.cost;
  }
  t.coreStart.assign(1, 0);
  for (const auto& list : perCore) {
    t.units.insert(t.units.end(), list.begin(), list.end());
    t.coreStart.push_back(int64_t(t.units.size()));
  }
  ATB_CHECK(t.ubBytes <= soc.ub_size, "flash_attention tiling: needs ", t.ubBytes, " bytes of UB, ", soc.name, " has ",
            soc.ub_size);
  return t;
}

}  // namespace atb
