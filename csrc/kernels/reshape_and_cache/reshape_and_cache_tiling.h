#pragma once
#include <cstdint>

#include "ascendc/dtype.h"
#include "ascendc/soc.h"

namespace atb {

struct ReshapeAndCacheTilingData {
  int64_t tokens = 0;
  int64_t rowElems = 0;        // kvHeads * headDim: one token's K (or V) row
  int64_t blockDim = 1;
  int64_t blockFactor = 0;     // tokens per core; the last core takes the remainder
  int64_t tokensPerLoop = 0;   // tokens per UB tile
  int64_t ubBytes = 0;
  int64_t tilingKey = 0;       // dtype * 10 (one variant)
};

// Pure host function of (tokens, kvHeads, headDim, dtype, SoC).
ReshapeAndCacheTilingData ReshapeAndCacheTiling(int64_t tokens, int64_t kvHeads, int64_t headDim,
                                                AscendC::DataType dtype, const AscendC::SocInfo& soc);

// Checks every slot before anything is written: a slot must be negative (skip)
// or inside [0, numBlocks * blockSize), and no slot may appear twice (two
// tokens racing for one cache row is a scheduler bug, and which one would win
// depends on the core split). Throws std::invalid_argument naming the token.
void CheckSlotMapping(const int32_t* slotMapping, int64_t tokens, int64_t numBlocks, int64_t blockSize);

// Launches a plan (ReshapeAndCacheTiling, with slot_mapping already checked by
// CheckSlotMapping) over these tensors; strides as for ReshapeAndCache.
void ReshapeAndCacheRun(const ReshapeAndCacheTilingData& t, const void* key, int64_t keyStride, const void* value,
                        int64_t valueStride, void* keyCache, void* valueCache, const int32_t* slotMapping,
                        const AscendC::SocInfo& soc);

// Host entry: validates slot_mapping, tiles and launches.
//   key/value     [tokens, kvHeads, headDim]; token t's row starts at t * keyStride
//                 (resp. valueStride) elements, heads and head_dim are packed
//                 (so views into a fused QKV projection need no copy).
//   keyCache/valueCache  contiguous [numBlocks, blockSize, kvHeads, headDim].
//   slotMapping   int32 [tokens]; slot = block * blockSize + offset, < 0 = skip.
void ReshapeAndCache(const void* key, int64_t keyStride, const void* value, int64_t valueStride, void* keyCache,
                     void* valueCache, const int32_t* slotMapping, int64_t tokens, int64_t kvHeads, int64_t headDim,
                     int64_t numBlocks, int64_t blockSize, AscendC::DataType dtype, const AscendC::SocInfo& soc);

}  // namespace atb
