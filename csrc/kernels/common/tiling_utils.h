// Helpers every host tiling function shares: how many cores a launch uses and
// how rows split over them (blockFactor = ceil(rows / blockDim), the last core
// takes the remainder), and the UB each tile may use.
#pragma once
#include <algorithm>
#include <cstdint>

#include "ascendc/soc.h"
#include "ascendc/tensor.h"

namespace atb {

// The one "dtype supported on this SoC" rule: bfloat16 needs the SoC's bf16 `unit` ("vector" or "cube").
inline void CheckDtypeOnSoc(const char* op, AscendC::DataType dtype, const AscendC::SocInfo& soc,
                            const char* unit = "vector") {
  ATB_CHECK(dtype != AscendC::DataType::BFLOAT16 || soc.supports_bf16, op, ": bfloat16 is not supported on ", soc.name,
            " (no bf16 ", unit, " unit); use float16 or float32");
}

// On an NPU a vector kernel uses every vector core that gets a row. On the
// host a hand-off to another thread costs a few microseconds, so a core must
// get at least minBytesPerCore of traffic before it is worth waking.
inline int64_t RowBlockDim(const AscendC::SocInfo& soc, int64_t rows, int64_t bytesPerRow,
                           int64_t minBytesPerCore = 64 * 1024) {
  if (rows <= 0) return 1;
  int64_t cores = std::max<int64_t>(1, soc.vector_core_num);
  if (soc.is_host) {
    int64_t byWork = std::max<int64_t>(1, rows * bytesPerRow / std::max<int64_t>(1, minBytesPerCore));
    cores = std::min(cores, byWork);
  }
  int64_t blockDim = std::min(cores, rows);
  // Re-derive so no core is left without rows: ceil(rows / ceil(rows / blockDim)).
  int64_t factor = AscendC::CeilDiv(rows, blockDim);
  return AscendC::CeilDiv(rows, factor);
}

// Bytes one UB slot takes (the TPipe aligns every slot to UB_ALIGN).
inline int64_t UbSlot(int64_t bytes) { return AscendC::AlignUp(bytes, AscendC::UB_ALIGN); }

}  // namespace atb
