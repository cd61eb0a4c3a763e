#include "swiglu_tiling.h"

#include "ascendc/error.h"
#include "kernels/common/tiling_utils.h"
#include "kernels/common/tiling_key.h"

namespace atb {

using AscendC::AlignUp;
using AscendC::CeilDiv;

namespace {
// UB per tile of r rows x c columns: gate, up and out queues, BUFFER_NUM slots
// each, rows padded to 32-byte blocks as DataCopyPad lays them out.
int64_t TileUb(int64_t r, int64_t c, int64_t elt) {
  return 3 * AscendC::BUFFER_NUM * UbSlot(r * AlignUp(c * elt, AscendC::ONE_BLK_SIZE));
}
// Gate bytes per tile: 8 KiB (x3 streams x2 buffers = 48 KiB of UB) keeps a
// tile's working set in L1/L2 while being long enough to amortize per-tile work.
constexpr int64_t kTileCapBytes = 8 * 1024;
}  // namespace

SwiGluTilingData SwiGluTiling(int64_t rows, int64_t cols, AscendC::DataType dtype, const AscendC::SocInfo& soc) {
  ATB_CHECK(rows >= 1 && cols >= 1, "swiglu tiling: rows and cols must be >= 1, got ", rows, " x ", cols);
  CheckDtypeOnSoc("swiglu", dtype, soc);
  SwiGluTilingData t;
  t.rows = rows;
  t.cols = cols;
  int64_t elt = AscendC::DataTypeSize(dtype);
  int64_t variant;
  if (cols * elt <= kTileCapBytes && TileUb(1, cols, elt) <= soc.ub_size) {
    variant = SWIGLU_ROWS;
    t.colTile = cols;
    t.colChunks = 1;
  } else {
    variant = SWIGLU_COL_TILES;
    // Whole 64-element tiles (32-byte blocks for every dtype), within the cap and the UB.
    int64_t tile = std::max<int64_t>(64, kTileCapBytes / elt / 64 * 64);
    while (tile > 64 && TileUb(1, tile, elt) > soc.ub_size) tile -= 64;
    ATB_CHECK(TileUb(1, tile, elt) <= soc.ub_size, "swiglu tiling: UB of ", soc.ub_size, " bytes is too small");
    t.colTile = std::min(tile, cols);
    t.colChunks = CeilDiv(cols, t.colTile);
  }
  t.units = rows * t.colChunks;
  t.blockDim = RowBlockDim(soc, t.units, 3 * t.colTile * elt);
  t.blockFactor = CeilDiv(t.units, t.blockDim);
  if (variant == SWIGLU_ROWS) {
    int64_t r = std::min(t.blockFactor, std::max<int64_t>(1, kTileCapBytes / (cols * elt)));
    while (r > 1 && TileUb(r, cols, elt) > soc.ub_size) --r;
    t.rowsPerLoop = r;
  }
  t.ubBytes = TileUb(t.rowsPerLoop, t.colTile, elt);
  ATB_CHECK(t.ubBytes <= soc.ub_size, "swiglu tiling: needs ", t.ubBytes, " bytes of UB, ", soc.name, " has ",
            soc.ub_size);
  t.tilingKey = EncodeTilingKey(dtype, variant);
  return t;
}

}  // namespace atb
