// Picks the SIMD table from CPUID at first use.
#include <cstdlib>
#include <cstring>
#include <string>

#include "error.h"
#include "simd.h"

namespace AscendC {
namespace {

bool CpuHasAvx2Fma() {
#if defined(__x86_64__) || defined(_M_X64)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#else
  return false;
#endif
}

std::string DetectFeatures() {
  std::string s;
#if defined(__x86_64__) || defined(_M_X64)
  __builtin_cpu_init();
  const char* names[] = {"sse4.2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512bf16"};
  for (const char* n : names) {
    bool has = false;
    if (!std::strcmp(n, "sse4.2")) has = __builtin_cpu_supports("sse4.2");
    else if (!std::strcmp(n, "avx")) has = __builtin_cpu_supports("avx");
    else if (!std::strcmp(n, "avx2")) has = __builtin_cpu_supports("avx2");
    else if (!std::strcmp(n, "fma")) has = __builtin_cpu_supports("fma");
    else if (!std::strcmp(n, "f16c")) has = __builtin_cpu_supports("f16c");
    else if (!std::strcmp(n, "avx512f")) has = __builtin_cpu_supports("avx512f");
    else if (!std::strcmp(n, "avx512bw")) has = __builtin_cpu_supports("avx512bw");
    else if (!std::strcmp(n, "avx512vl")) has = __builtin_cpu_supports("avx512vl");
    else if (!std::strcmp(n, "avx512bf16")) has = __builtin_cpu_supports("avx512bf16");
    if (has) s += (s.empty() ? "" : " ") + std::string(n);
  }
#elif defined(__aarch64__)
  s = "aarch64";
#endif
  return s;
}

const SimdOps* Initial() {
  const char* forced = std::getenv("ATB_ISA");
  if (forced && std::string(forced) == "portable") return PortableSimdOps();
  if (CpuHasAvx2Fma() && Avx2SimdOps()) return Avx2SimdOps();
  return PortableSimdOps();
}

const SimdOps* gActive = nullptr;

}  // namespace

const SimdOps& Simd() {
  if (!gActive) gActive = Initial();
  return *gActive;
}

void SelectSimd(const char* isa) {
  std::string want(isa);
  if (want == "portable") {
    gActive = PortableSimdOps();
  } else if (want == "avx2") {
    ATB_CHECK(CpuHasAvx2Fma() && Avx2SimdOps(), "set_isa: this CPU (", CpuFeatures(), ") has no AVX2+FMA+F16C");
    gActive = Avx2SimdOps();
  } else if (want == "auto") {
    gActive = nullptr;
    Simd();
  } else {
    ThrowError("set_isa: unknown ISA '", want, "'; valid: auto, avx2, portable");
  }
}

const char* CpuFeatures() {
  static const std::string features = DetectFeatures();
  return features.c_str();
}

}  // namespace AscendC
