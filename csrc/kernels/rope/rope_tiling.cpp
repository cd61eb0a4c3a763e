#include "rope_tiling.h"

#include "ascendc/error.h"
#include "kernels/common/tiling_utils.h"
#include "kernels/common/tiling_key.h"

namespace atb {

using AscendC::AlignUp;
using AscendC::CeilDiv;

namespace {
// UB for a tile of n tokens x hc heads:
//   in + out queues  BUFFER_NUM x 2 x n*hc head rows (storage type, rows padded to 32 bytes)
//   cos, sin         fp32, n x rotaryDim each
//   staging          n x rotaryDim in the storage type (16-bit dtypes only: cos/sin pass through it)
int64_t TileUb(int64_t n, int64_t hc, int64_t pitch, int64_t rd, int64_t elt) {
  int64_t ub = AscendC::BUFFER_NUM * 2 * UbSlot(n * hc * pitch * elt) + 2 * UbSlot(n * rd * 4);
  if (elt != 4) ub += UbSlot(n * rd * elt);
  return ub;
}
// Input bytes per tile: 16 KiB in + 16 KiB out (one token of 32 heads x 128
// fp32) stays in L1/L2 beside the next tile. 8, 16 and 32 KiB measured alike
// (0.33-0.48 ns per element, one thread, fp32); smaller tiles only add loop overhead.
constexpr int64_t kTileCapBytes = 16 * 1024;
}  // namespace

RopeTilingData RopeTiling(int64_t tokens, int64_t heads, int64_t kvHeads, int64_t headDim, int64_t rotaryDim,
                          AscendC::DataType dtype, AscendC::DataType cosDtype, RopeStyle style,
                          const AscendC::SocInfo& soc) {
  ATB_CHECK(tokens >= 1 && heads >= 1 && kvHeads >= 1 && headDim >= 1, "rope tiling: tokens, heads, kv_heads and "
            "head_dim must be >= 1, got ", tokens, ", ", heads, ", ", kvHeads, ", ", headDim);
  ATB_CHECK(rotaryDim >= 2 && rotaryDim % 2 == 0 && rotaryDim <= headDim, "rope tiling: rotary_dim must be even and in [2, head_dim=",
            headDim, "], got ", rotaryDim);
  CheckDtypeOnSoc("rope", dtype, soc);
  ATB_CHECK(cosDtype == dtype || cosDtype == AscendC::DataType::FLOAT32, "rope: cos/sin must be ",
            AscendC::DataTypeName(dtype), " (q's dtype) or float32, got ", AscendC::DataTypeName(cosDtype));
  RopeTilingData t;
  t.tokens = tokens;
  t.heads = heads;
  t.kvHeads = kvHeads;
  t.headDim = headDim;
  t.rotaryDim = rotaryDim;
  int64_t elt = AscendC::DataTypeSize(dtype);
  int64_t maxHeads = std::max(heads, kvHeads);
  t.headPitch = AlignUp(headDim * elt, AscendC::ONE_BLK_SIZE) / elt;
  // Each token reads and writes (heads + kvHeads) rows, plus its cos/sin rows.
  int64_t bytesPerToken = 2 * (heads + kvHeads) * headDim * elt + 2 * rotaryDim * AscendC::DataTypeSize(cosDtype);
  t.blockDim = RowBlockDim(soc, tokens, bytesPerToken);
  t.blockFactor = CeilDiv(tokens, t.blockDim);
  if (TileUb(1, maxHeads, t.headPitch, rotaryDim, elt) <= soc.ub_size) {
    t.headsPerLoop = maxHeads;
    int64_t n = std::min(t.blockFactor, std::max<int64_t>(1, kTileCapBytes / (maxHeads * headDim * elt)));
    while (n > 1 && TileUb(n, maxHeads, t.headPitch, rotaryDim, elt) > soc.ub_size) --n;
    t.tokensPerLoop = n;
  } else {
    // One token's heads overflow the UB: walk them in chunks, one token per tile.
    t.tokensPerLoop = 1;
    int64_t hc = maxHeads;
    while (hc > 1 && TileUb(1, hc, t.headPitch, rotaryDim, elt) > soc.ub_size) --hc;
    t.headsPerLoop = hc;
  }
  t.ubBytes = TileUb(t.tokensPerLoop, t.headsPerLoop, t.headPitch, rotaryDim, elt);
  ATB_CHECK(t.ubBytes <= soc.ub_size, "rope tiling: one head of ", headDim, " ", AscendC::DataTypeName(dtype),
            " elements needs ", t.ubBytes, " bytes of UB, ", soc.name, " has ", soc.ub_size);
  t.tilingKey = EncodeTilingKey(cosDtype, style, int64_t(dtype));
  return t;
}

}  // namespace atb
