// Picks the quantized linear's SIMD table from CPUID at first use
// (ATB_QUANT_ISA forces one; SelectQuantSimd switches at run time).
#include "quant_simd.h"

#include <cstdlib>

#include "ascendc/error.h"

namespace atb {
namespace {

bool CpuHas(const std::string& isa) {
#if defined(__x86_64__) || defined(_M_X64)
  __builtin_cpu_init();
  if (isa == "avx512")
    return QuantAvx512Ops() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("fma");
  if (isa == "avx2") return QuantAvx2Ops() && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#endif
  return isa == "portable";
}

const QuantSimdOps* ByName(const std::string& isa) {
  if (isa == "avx512") return QuantAvx512Ops();
  if (isa == "avx2") return QuantAvx2Ops();
  return QuantPortableOps();
}

const QuantSimdOps* Best() {
  const char* forced = std::getenv("ATB_QUANT_ISA");
  if (forced && *forced && std::string(forced) != "auto") {
    std::string f(forced);
    ATB_CHECK(f == "avx512" || f == "avx2" || f == "portable", "ATB_QUANT_ISA: unknown ISA '", f,
              "'; valid: auto, avx512, avx2, portable");
    ATB_CHECK(CpuHas(f), "ATB_QUANT_ISA=", f, ": this CPU cannot run it");
    return ByName(f);
  }
  return ByName(QuantIsaPaths().front());
}

const QuantSimdOps* gActive = nullptr;

}  // namespace

const QuantSimdOps& QuantSimd() {
  if (!gActive) gActive = Best();
  return *gActive;
}

std::vector<std::string> QuantIsaPaths() {
  std::vector<std::string> paths;
  for (const char* isa : {"avx512", "avx2", "portable"})
    if (CpuHas(isa)) paths.push_back(isa);
  return paths;
}

void SelectQuantSimd(const std::string& isa) {
  if (isa == "auto") {
    gActive = nullptr;
    QuantSimd();
    return;
  }
  ATB_CHECK(isa == "avx512" || isa == "avx2" || isa == "portable", "quant set_isa: unknown ISA '", isa,
            "'; valid: auto, avx512, avx2, portable");
  ATB_CHECK(CpuHas(isa), "quant set_isa: this CPU cannot run '", isa, "'");
  gActive = ByName(isa);
}

}  // namespace atb
