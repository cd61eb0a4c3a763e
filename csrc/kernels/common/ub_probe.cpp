#include "ub_probe.h"

#include <cstring>

#include "ascendc/kernel_operator.h"

namespace atb {

void UbCarveProbe(int64_t bytes, const AscendC::SocInfo& soc, int64_t blockDim) {
  ATB_CHECK(blockDim >= 1, "_ub_carve_probe: block_dim must be >= 1, got ", blockDim);
  auto kernel = [&]() {
    AscendC::TPipe pipe;
    AscendC::TBuf<AscendC::TPosition::VECCALC> buf;
    pipe.InitBuffer(buf, bytes);
    AscendC::LocalTensor<uint8_t> ub = buf.Get<uint8_t>();
    std::memset(ub.GetPhyAddr(), 0x5a, size_t(bytes));
  };
  AscendC::KernelLaunch(blockDim, soc.ub_size, kernel);
}

}  // namespace atb
