// Picks the SIMD table from CPUID (and XCR0) at first use.
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <string>

#include "error.h"
#include "simd.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace AscendC {
namespace {

#if defined(__x86_64__) || defined(_M_X64)
// The OS saves the register state an ISA needs (XCR0, read with xgetbv):
// bits 1-2 for xmm/ymm, 5-7 for the opmask and zmm registers. A CPU may
// report AVX-512 under an OS (or hypervisor) that does not save zmm state.
uint64_t Xcr0() {
  unsigned eax, ebx, ecx, edx;
  if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx) || !(ecx & bit_OSXSAVE)) return 0;
  uint32_t lo, hi;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (uint64_t(hi) << 32) | lo;
}
#endif

bool CpuHasAvx2Fma() {
#if defined(__x86_64__) || defined(_M_X64)
  __builtin_cpu_init();
  return (Xcr0() & 0x6) == 0x6 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
         __builtin_cpu_supports("f16c");
#else
  return false;
#endif
}

bool CpuHasAvx512() {
#if defined(__x86_64__) || defined(_M_X64)
  __builtin_cpu_init();
  return CpuHasAvx2Fma() && (Xcr0() & 0xe6) == 0xe6 && __builtin_cpu_supports("avx512f") &&
         __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
         __builtin_cpu_supports("avx512dq");
#else
  return false;
#endif
}

bool CpuHasAvx512Bf16() {
#if defined(__x86_64__) || defined(_M_X64)
  return CpuHasAvx512() && __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}

// AMX-BF16 is usable when CPUID reports it, the OS enables the tile state in XCR0 (bits 17-18) and, as Linux
// requires before a process's first tile instruction, arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)
// grants it (once per process; torch's oneDNN asks the same).
bool CpuHasAmxBf16() {
#if (defined(__x86_64__) || defined(_M_X64)) && defined(__linux__)
  static const bool usable = [] {
    if (!CpuHasAvx512Bf16() || !__builtin_cpu_supports("amx-tile") || !__builtin_cpu_supports("amx-bf16")) return false;
    if (((Xcr0() >> 17) & 3) != 3) return false;
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return usable;
#else
  return false;
#endif
}

std::string DetectFeatures() {
  std::string s;
#if defined(__x86_64__) || defined(_M_X64)
  __builtin_cpu_init();
  struct Feature {
    const char* name;
    bool has;
  };
  const Feature features[] = {
      {"sse4.2", bool(__builtin_cpu_supports("sse4.2"))},     {"avx", bool(__builtin_cpu_supports("avx"))},
      {"avx2", bool(__builtin_cpu_supports("avx2"))},         {"fma", bool(__builtin_cpu_supports("fma"))},
      {"f16c", bool(__builtin_cpu_supports("f16c"))},         {"avx512f", bool(__builtin_cpu_supports("avx512f"))},
      {"avx512bw", bool(__builtin_cpu_supports("avx512bw"))}, {"avx512vl", bool(__builtin_cpu_supports("avx512vl"))},
      {"avx512dq", bool(__builtin_cpu_supports("avx512dq"))}, {"avx512bf16", bool(__builtin_cpu_supports("avx512bf16"))},
      {"avx512vnni", bool(__builtin_cpu_supports("avx512vnni"))},
      {"amx-bf16", bool(__builtin_cpu_supports("amx-bf16"))},
  };
  for (const Feature& f : features)
    if (f.has) s += (s.empty() ? "" : " ") + std::string(f.name);
  if (__builtin_cpu_supports("avx512f") && (Xcr0() & 0xe6) != 0xe6) s += " (no OS zmm state)";
#elif defined(__aarch64__)
  s = "aarch64";
#endif
  return s;
}

// The table named `isa` if this CPU and build can run it, else null (unknown names too).
const SimdOps* Lookup(const std::string& isa) {
  if (isa == "portable") return PortableSimdOps();
  if (isa == "avx2") return CpuHasAvx2Fma() ? Avx2SimdOps() : nullptr;
  if (isa == "avx512") return !CpuHasAvx512() ? nullptr : CpuHasAvx512Bf16() ? Avx512Bf16SimdOps() : Avx512SimdOps();
  if (isa == "avx512-amx") return CpuHasAmxBf16() ? Avx512AmxSimdOps() : nullptr;
  if (isa == "avx512-simde") return Avx512SimdeSimdOps();
  if (isa == "avx512-amx-simde") return Avx512AmxSimdeSimdOps();
  return nullptr;
}

// "auto" takes the widest table the CPU and OS run. The AVX-512 and AVX2 tables differ only in how the sums
// simd.h leaves free associate (16-lane reductions: rms_norm's sum of squares, decode attention's scores;
// ~1e-7 relative in fp32, after rounding to bf16 almost always the same bits). Such a difference can flip an
// exact logit tie, never more: a SmolLM2 bf16 greedy split blamed on this table was a tie between two
// tokens below a masked EOS.
const SimdOps* Fastest() {
  for (const char* isa : {"avx512-amx", "avx512", "avx2"})
    if (const SimdOps* t = Lookup(isa)) return t;
  return PortableSimdOps();
}

// ATB_ISA forces a table when it names one this machine can run; the Python
// layer rejects other values at import with a clear error.
const SimdOps* Initial() {
  const char* forced = std::getenv("ATB_ISA");
  if (forced && *forced && std::string(forced) != "auto")
    if (const SimdOps* t = Lookup(forced)) return t;
  return Fastest();
}

const SimdOps* gActive = nullptr;

}  // namespace

const SimdOps& Simd() {
  if (!gActive) gActive = Initial();
  return *gActive;
}

void SelectSimd(const char* isa) {
  std::string want(isa);
  if (want == "auto") {
    gActive = Fastest();
    return;
  }
  ATB_CHECK(want == "portable" || want == "avx2" || want == "avx512" || want == "avx512-amx" || want == "avx512-simde" ||
                want == "avx512-amx-simde",
            "set_isa: unknown ISA '", want, "'; valid: auto, ", AvailableIsas());
  const SimdOps* t = Lookup(want);
  ATB_CHECK(t, "set_isa: '", want, "' cannot run here (CPU features: ", CpuFeatures(), "; available: ", AvailableIsas(),
            want.find("simde") != std::string::npos
                ? "; the build found no SIMDe headers: pip install simde-py, then rebuild"
                : "",
            ")");
  gActive = t;
}

const char* AvailableIsas() {
  static const std::string names = [] {
    std::string s;
    // "auto"'s pick first
    for (const char* isa : {"avx512-amx", "avx512", "avx2", "portable", "avx512-simde", "avx512-amx-simde"})
      if (Lookup(isa)) s += (s.empty() ? "" : " ") + std::string(isa);
    return s;
  }();
  return names.c_str();
}

const char* CpuFeatures() {
  static const std::string features = DetectFeatures();
  return features.c_str();
}

namespace {
bool CpuIsIntel() {
#if defined(__x86_64__) || defined(_M_X64)
  unsigned eax, ebx, ecx, edx;
  if (!__get_cpuid(0, &eax, &ebx, &ecx, &edx)) return false;
  return ebx == 0x756e6547 && edx == 0x49656e69 && ecx == 0x6c65746e;  // "GenuineIntel"
#else
  return false;
#endif
}

// A speed setting whose default depends on the CPU vendor (simd.h says why for each): read on every call,
// set from Python; a negative value restores the default.
template <typename T>
class VendorSetting {
 public:
  VendorSetting(T onIntel, T elsewhere) : default_(CpuIsIntel() ? onIntel : elsewhere), value_(default_) {}
  T Get() const { return value_.load(std::memory_order_relaxed); }
  void Set(int64_t v) { value_.store(v < 0 ? default_ : T(v), std::memory_order_relaxed); }

 private:
  const T default_;
  std::atomic<T> value_;
};

VendorSetting<int64_t> gStreamPrefetch{int64_t(16) << 10, 0};  // bytes: 16 KiB on Intel, none elsewhere
VendorSetting<bool> gFp32DecodeCopy{false, true};               // the weights as they lie on Intel, the copy elsewhere
VendorSetting<bool> gFp32BatchCopy{true, false};                // the copy on Intel, the weights as they lie elsewhere
}  // namespace

int64_t StreamPrefetchBytes() { return gStreamPrefetch.Get(); }
void SetStreamPrefetchBytes(int64_t bytes) { gStreamPrefetch.Set(bytes); }
bool Fp32DecodeReadsCopy() { return gFp32DecodeCopy.Get(); }
void SetFp32DecodeReadsCopy(int on) { gFp32DecodeCopy.Set(on); }
bool Fp32BatchReadsCopy() { return gFp32BatchCopy.Get(); }
void SetFp32BatchReadsCopy(int on) { gFp32BatchCopy.Set(on); }

}  // namespace AscendC
