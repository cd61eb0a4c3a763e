// The SoC table: the facts about each Ascend chip that tiling depends on.
// Sources: CANN platform_config <SoC>.ini; ATB src/atb/utils/config.cpp (the
// exact 10-character name "Ascend910B" is 910A-class). "host" is this CPU,
// with as many cores as the thread pool and a UB sized to stay inside L2.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace AscendC {

struct SocInfo {
  std::string name;
  int64_t cube_core_num;
  int64_t vector_core_num;
  int64_t ub_size;  // bytes of Unified Buffer per core
  int64_t l1_size;  // bytes of L1 per cube core
  bool supports_bf16;
  bool is_host;
};

// Looks up a SoC by name (aliases accepted); throws listing the valid names.
SocInfo GetSocInfo(const std::string& name);
std::vector<std::string> SocNames();

}  // namespace AscendC
