#include "rms_norm_tiling.h"

#include "ascendc/error.h"
#include "kernels/common/tiling_utils.h"
#include "kernels/common/tiling_key.h"

namespace atb {

using AscendC::AlignUp;
using AscendC::CeilDiv;

namespace {
// UB per tile (variant 0), for r rows of `cols` columns:
//   in queues   BUFFER_NUM x (x [+ residual]) rows, storage type
//   out queues  BUFFER_NUM x (y [+ x+residual]) rows, storage type
//   fp32 work   r rows
//   fp32 weight one row (loaded once per core)
int64_t RowsUb(int64_t r, int64_t cols, int64_t elt, bool res) {
  int64_t streams = res ? 2 : 1;
  return streams * AscendC::BUFFER_NUM * UbSlot(r * cols * elt) * 2 + UbSlot(r * cols * 4) + UbSlot(cols * 4);
}
}  // namespace

RmsNormTilingData RmsNormTiling(int64_t rows, int64_t cols, AscendC::DataType dtype, float eps, bool hasResidual,
                                const AscendC::SocInfo& soc) {
  // Errors carry the name the caller used: the fused PRENORM form is add_rms_norm.
  const char* op = hasResidual ? "add_rms_norm" : "rms_norm";
  ATB_CHECK(rows >= 1 && cols >= 1, op, " tiling: rows and cols must be >= 1, got ", rows, " x ", cols);
  CheckDtypeOnSoc(op, dtype, soc);
  RmsNormTilingData t;
  t.rows = rows;
  t.cols = cols;
  t.eps = eps;
  t.hasResidual = hasResidual;
  int64_t elt = AscendC::DataTypeSize(dtype);
  t.blockDim = RowBlockDim(soc, rows, cols * elt * (hasResidual ? 4 : 2));
  t.blockFactor = CeilDiv(rows, t.blockDim);
  int64_t variant;
  if (RowsUb(1, cols, elt, hasResidual) <= soc.ub_size) {
    variant = RMS_NORM_ROWS;
    // Largest row count that fits, at most what one core owns. Tiles of a few
    // KiB already stream at full speed, so cap at 16 KiB of input per tile to
    // keep the ping-pong in L1/L2.
    int64_t cap = std::max<int64_t>(1, (16 * 1024) / (cols * elt));
    int64_t r = std::min(t.blockFactor, cap);
    while (r > 1 && RowsUb(r, cols, elt, hasResidual) > soc.ub_size) --r;
    t.rowsPerLoop = r;
    t.colTile = cols;
    t.ubBytes = RowsUb(r, cols, elt, hasResidual);
  } else {
    variant = RMS_NORM_SPLIT_D;
    t.rowsPerLoop = 1;
    // Per column of a tile: in/out queues (storage), fp32 work, fp32 weight.
    int64_t streams = hasResidual ? 2 : 1;
    int64_t perCol = streams * AscendC::BUFFER_NUM * elt * 2 + 4 + 4;
    int64_t tile = (soc.ub_size - 8 * AscendC::UB_ALIGN) / perCol;
    tile = tile / 64 * 64;  // whole 32-byte blocks for every dtype, cache-line friendly
    ATB_CHECK(tile >= 64, op, " tiling: UB of ", soc.ub_size, " bytes is too small");
    t.colTile = tile;
    t.ubBytes = streams * AscendC::BUFFER_NUM * UbSlot(tile * elt) * 2 + UbSlot(tile * 4) * 2;
  }
  t.tilingKey = EncodeTilingKey(dtype, variant);
  ATB_CHECK(t.ubBytes <= soc.ub_size, op, " tiling: needs ", t.ubBytes, " bytes of UB, ", soc.name, " has ",
            soc.ub_size);
  return t;
}

}  // namespace atb
