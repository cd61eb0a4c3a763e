// Picks the quantized linear's SIMD table from CPUID at first use
// (ATB_QUANT_ISA forces one; SelectQuantSimd switches at run time).
#include "quant_simd.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>

#include "ascendc/error.h"

namespace atb {
namespace {

// Every path by name, fastest first (auto takes the first the CPU runs), then the test-only SIMDe one.
constexpr const char* kIsas[] = {"avx512-i16", "avx512", "avx2", "portable", "avx512-i16-simde"};
constexpr const char* kValid = "auto, avx512-i16, avx512, avx2, portable, avx512-i16-simde";

bool Known(const std::string& isa) {
  for (const char* k : kIsas)
    if (isa == k) return true;
  return false;
}

bool CpuHas(const std::string& isa) {
#if defined(__x86_64__) || defined(_M_X64)
  __builtin_cpu_init();
  if (isa == "avx512-i16") return CpuHas("avx512") && CpuHas("avx2");
  if (isa == "avx512-i16-simde") return QuantAvx512VnniW4GemvSimde() && CpuHas("avx2");
  if (isa == "avx512")
    return QuantAvx512Ops() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("fma");
  if (isa == "avx2") return QuantAvx2Ops() && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                           __builtin_cpu_supports("f16c");  // F16C: fp16 scales widen in the GEMV
#endif
  return isa == "portable";
}

// "avx512-i16", auto's pick where the CPU runs both tables: the AVX-512 table with the AVX2 table's int16
// GEMVs, which then take every 16-bit x (quant_linear_kernel.cpp). Zen 4 (AVX512-BF16), 2 threads, SmolLM2
// bf16 x decode graph, MLP ms per step, two runs each, ATB_QUANT_ISA avx512 against avx2: W4 G32
// (vdpbf16ps route against int16) 6.27 and 5.61 against 3.57 and 3.66, so 10.8 / 9.4 against 6.6 / 6.9 ms
// per step; W8 (fp32 route against int16) 3.79 and 3.03 against 3.52 and 3.45, within the noise. The
// copy is made here, in code built for the baseline ISA, not in the AVX-512 file (quant_simd_avx512.cpp).
// Where the CPU has AVX512-VNNI, W4 takes its byte-plane GEMV instead (quant_simd_avx512_vnni.cpp).
const QuantSimdOps* Avx512WithInt16() {
  static const QuantSimdOps ops = [] {
    QuantSimdOps o = *QuantAvx512Ops();
    o.isa = "avx512-i16";
    __builtin_cpu_init();
    if (QuantAvx512VnniW4Gemv() && __builtin_cpu_supports("avx512vnni")) {
      o.gemv_w4_i16 = QuantAvx512VnniW4Gemv();
      o.w4_i16_x = W4XLayout::kBytePlanes;
    } else {
      o.gemv_w4_i16 = QuantAvx2Int16GemvsForAvx512Host()->w4;
    }
    o.gemv_w8_i16 = QuantAvx2Int16GemvsForAvx512Host()->w8;
    return o;
  }();
  return &ops;
}

// "avx512-i16-simde" (test-only): the AVX2 table with the AVX512-VNNI W4 GEMV compiled against SIMDe
// (quant_simd_avx512_vnni_simde.cpp), so that a CPU without AVX-512 runs that GEMV's logic in the tests.
const QuantSimdOps* Avx2WithSimdeVnniW4() {
  static const QuantSimdOps ops = [] {
    QuantSimdOps o = *QuantAvx2Ops();
    o.isa = "avx512-i16-simde";
    o.gemv_w4_i16 = QuantAvx512VnniW4GemvSimde();
    o.w4_i16_x = W4XLayout::kBytePlanes;
    return o;
  }();
  return &ops;
}

const QuantSimdOps* ByName(const std::string& isa) {
  if (isa == "avx512-i16") return Avx512WithInt16();
  if (isa == "avx512-i16-simde") return Avx2WithSimdeVnniW4();
  if (isa == "avx512") return QuantAvx512Ops();
  if (isa == "avx2") return QuantAvx2Ops();
  return QuantPortableOps();
}

const QuantSimdOps* Best() {
  const char* forced = std::getenv("ATB_QUANT_ISA");
  if (forced && *forced && std::string(forced) != "auto") {
    std::string f(forced);
    ATB_CHECK(Known(f), "ATB_QUANT_ISA: unknown ISA '", f, "'; valid: ", kValid);
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
  for (const char* isa : kIsas)
    if (CpuHas(isa)) paths.push_back(isa);
  return paths;
}

void SelectQuantSimd(const std::string& isa) {
  if (isa == "auto") {
    gActive = nullptr;
    QuantSimd();
    return;
  }
  ATB_CHECK(Known(isa), "quant set_isa: unknown ISA '", isa, "'; valid: ", kValid);
  ATB_CHECK(CpuHas(isa), "quant set_isa: this CPU cannot run '", isa, "'");
  gActive = ByName(isa);
}

void QuantizeXInt16(int16_t* xq, float* scale, const float* x, int64_t kLen) {
  // Plain loops the compiler vectorizes at the baseline ISA: per value a multiply by a power of two (exact)
  // and the round-to-nearest-even of adding and subtracting 1.5 * 2^23 (exact below 2^22). A libm
  // nearbyint/ldexp per value cost more than the GEMV it feeds (W8 1536x576: 37 -> 58 us).
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23
  for (int64_t c = 0; c < kLen / 32; ++c) {
    const float* v = x + c * 32;
    float amax = 0.0f, sum = 0.0f;
    for (int j = 0; j < 32; ++j) {
      amax = std::max(amax, std::fabs(v[j]));
      sum += v[j] * 0.0f;  // NaN exactly when some value is NaN or infinite
    }
    int16_t* q = xq + c * 32;
    bool nonFinite = sum != sum;
    if (nonFinite || amax == 0.0f) {
      scale[c] = nonFinite ? NAN : 0.0f;
      std::fill(q, q + 32, int16_t(0));
      continue;
    }
    int e = std::ilogb(amax);
    scale[c] = std::ldexp(1.0f, e - 14);
    const float up = std::ldexp(1.0f, 14 - e);
    for (int j = 0; j < 32; ++j) q[j] = int16_t(int32_t((v[j] * up + kRound) - kRound));
  }
}

void InterleaveXInt16ForW4(int16_t* dst, const int16_t* xq, int64_t kLen, W4XLayout layout) {
  constexpr int kOffset[4] = {0, 16, 1, 17};  // pairs: run j's value w of a chunk is x[2w + kOffset[j]]
  const bool planes = layout == W4XLayout::kBytePlanes;
  const int64_t chunks = kLen / 32, perLoad = planes ? 4 : 2, padded = (kLen + 127) / 128 * 128;
  for (int64_t c = 0; c < chunks; c += perLoad) {
    int16_t run[128] = {0};  // the load's values as they came (dst may be xq), zeros past kLen
    std::copy_n(xq + 32 * c, 32 * std::min(perLoad, chunks - c), run);
    if (!planes) {
      for (int half = 0; half < 2; ++half)
        for (int j = 0; j < 4; ++j)
          for (int w = 0; w < 8; ++w) dst[32 * c + 16 * j + 8 * half + w] = run[32 * half + 2 * w + kOffset[j]];
      continue;
    }
    uint8_t* out = reinterpret_cast<uint8_t*>(dst + 32 * c);
    for (int i = 0; i < 4; ++i)
      for (int j = 0; j < 16; ++j)
        for (int hi = 0; hi < 2; ++hi) {
          const int16_t v = run[32 * i + j + 16 * hi];
          out[64 * hi + 16 * i + j] = uint8_t(v & 0xFF);                // xl
          out[128 + 64 * hi + 16 * i + j] = uint8_t(int8_t(v >> 8));  // xh
        }
  }
  std::fill(dst + (chunks + perLoad - 1) / perLoad * perLoad * 32, dst + padded, int16_t(0));
}

}  // namespace atb
