#pragma once
#include <cstdint>

#include "ascendc/dtype.h"
#include "ascendc/soc.h"

namespace atb {

// tilingKey = dtype * 10 + variant: variant 0 moves whole rows (several per
// tile), variant 1 walks long rows in column tiles (one row piece per tile).
enum SwiGluVariant : int64_t { SWIGLU_ROWS = 0, SWIGLU_COL_TILES = 1 };

struct SwiGluTilingData {
  int64_t rows = 0, cols = 0;
  int64_t colTile = 0;      // columns per tile (== cols in variant 0)
  int64_t colChunks = 1;    // column tiles per row (1 in variant 0)
  int64_t units = 0;        // work units split over cores: rows x colChunks
  int64_t blockDim = 1;
  int64_t blockFactor = 0;  // units per core; the last core takes the remainder
  int64_t rowsPerLoop = 1;  // rows per tile (variant 0)
  int64_t ubBytes = 0;      // UB the kernel will carve
  int64_t tilingKey = 0;
};

// Pure host function of (rows, cols = the output's last dim, dtype, SoC).
SwiGluTilingData SwiGluTiling(int64_t rows, int64_t cols, AscendC::DataType dtype, const AscendC::SocInfo& soc);

// Host entry: out[r][c] = silu(gate[r][c]) * up[r][c] over [rows, cols], HF
// numerics (silu rounded to dtype, then the product). gate/up rows are
// rowStride elements apart (swiglu: both inside one [rows, 2*cols] tensor);
// out is contiguous.
void SiluMul(void* out, const void* gate, int64_t gateRowStride, const void* up, int64_t upRowStride, int64_t rows,
             int64_t cols, AscendC::DataType dtype, const AscendC::SocInfo& soc);

}  // namespace atb
