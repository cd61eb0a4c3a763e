#pragma once
#include <cstdint>

#include "ascendc/soc.h"

namespace atb {

// Test hook: launches one block on `soc` that carves `bytes` of UB with TPipe
// and writes every byte of it. Carving past the SoC's UB raises, as on hardware.
void UbCarveProbe(int64_t bytes, const AscendC::SocInfo& soc);

}  // namespace atb
