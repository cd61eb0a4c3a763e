// AVX-512 (F/BW/VL) table of the quantized linear. Compiled with those target
// features for this file only (pragma after every system header, everything
// in an anonymous namespace); selected only when CPUID reports them.
//
// Why not VNNI: vpdpbusd multiplies int8 by int8, so it needs the activations
// quantized to int8 (W8A8). Here the activations stay fp32/bf16/fp16 (A16), so
// the weights are widened to fp32 in registers and meet x in FMAs.
#include <algorithm>
#include <cstdint>

#include "quant_simd.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx2,fma")
// GCC 12's own avx512fintrin.h (_mm512_reduce_add_ps, the widening loads) trips these on its
// deliberately undefined __Y temporaries.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

namespace atb {
namespace {

struct V512 {
  using reg = __m512;
  static constexpr int kVecs = 2;
  static constexpr int kW4Off[2] = {0, 16};  // low nibbles: values 0..15, high: 16..31
  static constexpr int kW8Off[2] = {0, 16};
  static constexpr int kMB = 4, kNR1 = 4, kNR = 2;  // 32 zmm: 2x4 blocks keep t, acc and x in registers
  static reg zero() { return _mm512_setzero_ps(); }
  static reg load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, reg v) { _mm512_storeu_ps(p, v); }
  static reg set1(float v) { return _mm512_set1_ps(v); }
  static reg fma(reg a, reg b, reg c) { return _mm512_fmadd_ps(a, b, c); }
  static reg add(reg a, reg b) { return _mm512_add_ps(a, b); }
  static reg mul(reg a, reg b) { return _mm512_mul_ps(a, b); }
  static float hsum(reg v) { return _mm512_reduce_add_ps(v); }
  static void UnpackW4(const uint8_t* q, reg w[2]) {
    __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
    w[0] = _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(0xF)));
    w[1] = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
  }
  static void UnpackW8(const int8_t* q, reg w[2]) {
    w[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q))));
    w[1] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16))));
  }
};

#include "quant_simd_impl.h"

const QuantSimdOps kOps = MakeQuantOps<V512>("avx512");

}  // namespace

const QuantSimdOps* QuantAvx512Ops() { return &kOps; }

}  // namespace atb

#pragma GCC diagnostic pop
#pragma GCC pop_options

#else
namespace atb {
const QuantSimdOps* QuantAvx512Ops() { return nullptr; }
}  // namespace atb
#endif
