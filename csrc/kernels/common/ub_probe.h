#pragma once
#include <cstdint>

#include "ascendc/soc.h"

namespace atb {

// Test hook: launches `blockDim` blocks on `soc`, each carving `bytes` of UB with TPipe
// and writes every byte of it. Carving past the SoC's UB raises, as on hardware.
void UbCarveProbe(int64_t bytes, const AscendC::SocInfo& soc, int64_t blockDim = 1);

}  // namespace atb
