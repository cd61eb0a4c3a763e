#include "reshape_and_cache_tiling.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "ascendc/error.h"
#include "kernels/common/tiling_utils.h"
#include "kernels/common/tiling_key.h"

namespace atb {

using AscendC::CeilDiv;

namespace {
// UB per tile of r tokens: K and V rows, BUFFER_NUM slots each, storage type.
int64_t TileUb(int64_t r, int64_t rowBytes) { return 2 * AscendC::BUFFER_NUM * UbSlot(r * rowBytes); }
}  // namespace

ReshapeAndCacheTilingData ReshapeAndCacheTiling(int64_t tokens, int64_t kvHeads, int64_t headDim,
                                                AscendC::DataType dtype, const AscendC::SocInfo& soc) {
  ATB_CHECK(tokens >= 1 && kvHeads >= 1 && headDim >= 1, "reshape_and_cache tiling: tokens, kv_heads and head_dim ",
            "must be >= 1, got ", tokens, ", ", kvHeads, ", ", headDim);
  CheckDtypeOnSoc("reshape_and_cache", dtype, soc);
  ReshapeAndCacheTilingData t;
  t.tokens = tokens;
  t.rowElems = kvHeads * headDim;
  int64_t rowBytes = t.rowElems * AscendC::DataTypeSize(dtype);
  // Each token moves its K and V row in and out: 4 row transfers.
  t.blockDim = RowBlockDim(soc, tokens, 4 * rowBytes);
  t.blockFactor = CeilDiv(tokens, t.blockDim);
  ATB_CHECK(TileUb(1, rowBytes) <= soc.ub_size, "reshape_and_cache tiling: one token's K and V rows (", 2 * rowBytes,
            " bytes, double-buffered) do not fit the ", soc.ub_size, " bytes of UB on ", soc.name);
  // 16 KiB of K per tile streams at full copy speed and keeps the ping-pong in L1/L2.
  int64_t r = std::min(t.blockFactor, std::max<int64_t>(1, (16 * 1024) / rowBytes));
  while (r > 1 && TileUb(r, rowBytes) > soc.ub_size) --r;
  t.tokensPerLoop = r;
  t.ubBytes = TileUb(r, rowBytes);
  t.tilingKey = EncodeTilingKey(dtype, 0);
  return t;
}

void CheckSlotMapping(const int32_t* slotMapping, int64_t tokens, int64_t numBlocks, int64_t blockSize) {
  int64_t slots = numBlocks * blockSize;
  std::vector<std::pair<int32_t, int64_t>> used;  // (slot, token)
  used.reserve(size_t(tokens));
  for (int64_t i = 0; i < tokens; ++i) {
    int32_t s = slotMapping[i];
    if (s < 0) continue;
    ATB_CHECK(s < slots, "reshape_and_cache: slot_mapping[", i, "] = ", s, " is out of range: the cache has ", numBlocks,
              " blocks x ", blockSize, " slots = ", slots, " slots (valid: 0..", slots - 1, ", or negative to skip)");
    used.emplace_back(s, i);
  }
  std::sort(used.begin(), used.end());
  for (size_t i = 1; i < used.size(); ++i)
    ATB_CHECK(used[i].first != used[i - 1].first, "reshape_and_cache: slot ", used[i].first,
              " appears twice in slot_mapping (tokens ", used[i - 1].second, " and ", used[i].second,
              "); each cache slot may be written by at most one token per call");
}

}  // namespace atb
