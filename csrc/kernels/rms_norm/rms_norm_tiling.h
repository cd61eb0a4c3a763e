#pragma once
#include <cstdint>

#include "ascendc/dtype.h"
#include "ascendc/soc.h"

namespace atb {

// tilingKey = dtype * 10 + variant: variant 0 keeps whole rows in UB, variant 1
// ("split-D") walks a row in column tiles, two passes (sum of squares, then
// normalize), when a single row does not fit the UB.
enum RmsNormVariant : int64_t { RMS_NORM_ROWS = 0, RMS_NORM_SPLIT_D = 1 };

struct RmsNormTilingData {
  int64_t rows = 0, cols = 0;
  int64_t blockDim = 1;
  int64_t blockFactor = 0;  // rows per core; the last core takes the remainder
  int64_t rowsPerLoop = 0;  // rows per UB tile (variant 0)
  int64_t colTile = 0;      // columns per UB tile (== cols in variant 0)
  int64_t ubBytes = 0;      // UB the kernel will carve
  int64_t tilingKey = 0;
  bool hasResidual = false;  // add_rms_norm: x + residual first, both outputs
  float eps = 1e-6f;
};

// Pure host function of (shape, dtype, eps, residual?, SoC).
RmsNormTilingData RmsNormTiling(int64_t rows, int64_t cols, AscendC::DataType dtype, float eps, bool hasResidual,
                                const AscendC::SocInfo& soc);

// Host entry: tiles and launches. Pointers are contiguous [rows, cols] tensors
// of `dtype`; residualOut/residual are null for plain rms_norm.
void RmsNorm(void* y, void* residualOut, const void* x, const void* residual, const void* weight, int64_t rows,
             int64_t cols, AscendC::DataType dtype, float eps, const AscendC::SocInfo& soc);

}  // namespace atb
