// AVX2 + FMA table of the quantized linear (pragma-scoped target features, as
// in quant_simd_avx512.cpp); selected when CPUID reports AVX2 and FMA.
#include <algorithm>
#include <cstdint>

#include "quant_simd.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx2,fma")

namespace atb {
namespace {

struct V256 {
  using reg = __m256;
  static constexpr int kVecs = 4;
  // 8 bytes widen to 8 lanes: low nibbles are values 0..7 (then 8..15), high nibbles 16..23 (then 24..31).
  static constexpr int kW4Off[4] = {0, 16, 8, 24};
  static constexpr int kW8Off[4] = {0, 8, 16, 24};
  static constexpr int kMB = 2, kNR1 = 2, kNR = 1;  // 16 ymm registers
  static reg zero() { return _mm256_setzero_ps(); }
  static reg load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, reg v) { _mm256_storeu_ps(p, v); }
  static reg set1(float v) { return _mm256_set1_ps(v); }
  static reg fma(reg a, reg b, reg c) { return _mm256_fmadd_ps(a, b, c); }
  static reg add(reg a, reg b) { return _mm256_add_ps(a, b); }
  static reg mul(reg a, reg b) { return _mm256_mul_ps(a, b); }
  static float hsum(reg v) {
    __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    return _mm_cvtss_f32(_mm_add_ss(lo, _mm_movehdup_ps(lo)));
  }
  static void UnpackW4(const uint8_t* q, reg w[4]) {
    const __m256i mask = _mm256_set1_epi32(0xF);
    for (int h = 0; h < 2; ++h) {
      __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * h)));
      w[2 * h] = _mm256_cvtepi32_ps(_mm256_and_si256(b, mask));
      w[2 * h + 1] = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
    }
  }
  static void UnpackW8(const int8_t* q, reg w[4]) {
    for (int v = 0; v < 4; ++v)
      w[v] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * v))));
  }
};

#include "quant_simd_impl.h"

const QuantSimdOps kOps = MakeQuantOps<V256>("avx2");

}  // namespace

const QuantSimdOps* QuantAvx2Ops() { return &kOps; }

}  // namespace atb

#pragma GCC pop_options

#else
namespace atb {
const QuantSimdOps* QuantAvx2Ops() { return nullptr; }
}  // namespace atb
#endif
