#pragma once
#include <cstdint>

#include "ascendc/dtype.h"
#include "ascendc/soc.h"

namespace atb {

// tilingKey = dtype * 100 + cosDtype * 10 + style (0 neox, 1 interleave).
enum RopeStyle : int64_t { ROPE_NEOX = 0, ROPE_INTERLEAVE = 1 };

struct RopeTilingData {
  int64_t tokens = 0, heads = 0, kvHeads = 0, headDim = 0, rotaryDim = 0;
  int64_t blockDim = 1;
  int64_t blockFactor = 0;     // tokens per core; the last core takes the remainder
  int64_t tokensPerLoop = 0;   // tokens per UB tile
  int64_t headsPerLoop = 0;    // heads per UB tile (< max(heads, kvHeads) only when one token's heads overflow UB)
  int64_t headPitch = 0;       // UB elements per head row: head_dim padded to whole 32-byte blocks
  int64_t ubBytes = 0;         // UB the kernel will carve
  int64_t tilingKey = 0;
};

// Pure host function of (shapes, dtypes, style, SoC). cos/sin are [tokens,
// rotaryDim] in cosDtype, which is dtype or float32.
RopeTilingData RopeTiling(int64_t tokens, int64_t heads, int64_t kvHeads, int64_t headDim, int64_t rotaryDim,
                          AscendC::DataType dtype, AscendC::DataType cosDtype, RopeStyle style,
                          const AscendC::SocInfo& soc);

// A [tokens, heads, headDim] view: the last dim is contiguous, the other two
// strides (in elements) are free, e.g. q/k slices of a fused QKV projection.
struct RopeView {
  void* data;
  int64_t tokenStride;
  int64_t headStride;
};

// Host entry: tiles and launches. out may equal in (in place). cos/sin are
// contiguous [tokens, rotaryDim]; float32 cos/sin with a 16-bit dtype are
// rounded to that dtype first, as HF's rotary embedding returns them.
void Rope(RopeView qOut, RopeView kOut, RopeView q, RopeView k, const void* cos, const void* sin, int64_t tokens,
          int64_t heads, int64_t kvHeads, int64_t headDim, int64_t rotaryDim, AscendC::DataType dtype,
          AscendC::DataType cosDtype, RopeStyle style, const AscendC::SocInfo& soc);

}  // namespace atb
