#include "soc.h"

#include <algorithm>
#include <cctype>
#include <fstream>
#include <sstream>

#include "error.h"
#include "runtime.h"

namespace AscendC {
namespace {

constexpr int64_t KiB = 1024;

const std::vector<SocInfo>& Table() {
  // name, cube cores, vector cores, UB, L1, bf16. 910A's UB/L1 are not in a public
  // platform file we could check; 256 KiB / 1 MiB are the commonly quoted sizes.
  // 310P3 has 7 standalone vector cores besides its 8 AI cores; vector kernels
  // tile over the AI cores' vector units, so 8 is what tiling sees.
  static const std::vector<SocInfo> table = {
      {"Ascend910", 32, 32, 256 * KiB, 1024 * KiB, false, false},
      {"Ascend910B1", 24, 48, 192 * KiB, 512 * KiB, true, false},
      {"Ascend910B2", 24, 48, 192 * KiB, 512 * KiB, true, false},
      {"Ascend910B3", 20, 40, 192 * KiB, 512 * KiB, true, false},
      {"Ascend910B4", 20, 40, 192 * KiB, 512 * KiB, true, false},
      {"Ascend910_93", 24, 48, 192 * KiB, 512 * KiB, true, false},
      {"Ascend310P3", 8, 8, 256 * KiB, 1024 * KiB, false, false},
  };
  return table;
}

int64_t HostL2PerCore() {
  std::ifstream f("/sys/devices/system/cpu/cpu0/cache/index2/size");
  std::string s;
  if (!(f >> s) || s.empty()) return 512 * KiB;
  int64_t v = std::stoll(s);
  char unit = s.back();
  if (unit == 'K') v *= KiB;
  if (unit == 'M') v *= KiB * KiB;
  return v;
}

SocInfo HostSoc() {
  // Half of L2 for the UB leaves room for the weights/K/V a kernel streams past
  // it; clamped to [192 KiB, 1 MiB] so tiles stay comparable with the NPUs'.
  int64_t ub = HostL2PerCore() / 2;
  if (ub < 192 * KiB) ub = 192 * KiB;
  if (ub > 1024 * KiB) ub = 1024 * KiB;
  int64_t cores = GetNumThreads();
  return {"host", cores, cores, ub, 2 * ub, true, true};
}

}  // namespace

std::vector<std::string> SocNames() {
  std::vector<std::string> names;
  for (const auto& s : Table()) names.push_back(s.name);
  names.push_back("host");
  return names;
}

SocInfo GetSocInfo(const std::string& requested) {
  // Names match in any case ("ascend910b4"); the SocInfo carries the canonical spelling.
  auto same = [](const std::string& a, const std::string& b) {
    return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin(), [](char x, char y) {
             return std::tolower(static_cast<unsigned char>(x)) == std::tolower(static_cast<unsigned char>(y));
           });
  };
  std::string name = requested;
  for (const std::string& n : SocNames())
    if (same(n, requested)) name = n;
  for (const char* alias : {"Ascend910B", "Ascend910ProB", "Ascend910A", "Ascend310P"})
    if (same(alias, requested)) name = alias;
  if (name == "host") return HostSoc();
  // ATB treats the exact names "Ascend910B" and "Ascend910ProB" as 910A-class.
  std::string lookup = name;
  if (name == "Ascend910B" || name == "Ascend910ProB" || name == "Ascend910A") lookup = "Ascend910";
  if (name == "Ascend310P") lookup = "Ascend310P3";
  for (const auto& s : Table()) {
    if (s.name == lookup) {
      SocInfo info = s;
      info.name = name;
      return info;
    }
  }
  std::ostringstream valid;
  for (const auto& n : SocNames()) valid << (valid.tellp() ? ", " : "") << n;
  ThrowError("soc_type: unknown SoC '", name, "'; valid names: ", valid.str(),
             " (aliases: Ascend910B, Ascend910ProB -> Ascend910-class; Ascend310P -> Ascend310P3)");
}

}  // namespace AscendC
