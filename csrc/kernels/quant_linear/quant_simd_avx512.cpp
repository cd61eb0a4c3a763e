// AVX-512 (F/BW/VL) table of the quantized linear. Compiled with those target
// features for this file only (pragma after every system header, everything
// in an anonymous namespace); selected only when CPUID reports them.
//
// Here the weights are widened to fp32 in registers and meet x in FMAs; with
// bf16 activations on an AVX512-BF16 CPU, the W4 GEMV instead turns nibbles into
// bf16 and meets x in vdpbf16ps (exact products, see quant_simd.h). The file is
// compiled with avx512bf16 enabled, but only GemvW4Bf16 uses it and its table
// is handed out only when CPUID reports the extension. The int16 GEMVs that the
// avx512-i16 path adds for 16-bit x live in quant_simd_avx2.cpp and, on
// AVX512-VNNI, quant_simd_avx512_vnni.cpp.
#include <algorithm>
#include <cstdint>

#include "quant_simd.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma")
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

__m512i NibbleToBf16Table() {
  alignas(64) uint16_t t[32];
  ::AscendC::NibbleBf16Table(t);
  return _mm512_load_si512(t);
}

// 32 bf16 values of x: [x[k + a .. k + a + 16), x[k + b .. k + b + 16)].
inline __m512bh XHalves(const uint16_t* x, int64_t a, int64_t b) {
  __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + a));
  __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + b));
  return (__m512bh)_mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

// NR weight rows x MB rows of x, two 32-value chunks (A, B) at a time: one 32-byte load widened to 32
// words, one AND and one shift give the nibble indices [A 0..15, B 0..15] and [A 16..31, B 16..31],
// two vpermw turn them into bf16, and they meet x (loaded in the same halves) in two vdpbf16ps per x
// row. Lanes 0..7 of the dot then hold chunk A, lanes 8..15 chunk B: with G = 32 (A and B in two
// groups) the pair's dot is scaled by [scale A x 8, scale B x 8]; with G >= 64 a pair never crosses a
// group, and each group's dot is scaled once. A last odd chunk goes alone (its 16 bytes give
// [0..15, 16..31] in one register). The min term is one dot of mins and x's group sums at the end.
// At M == 1, NR = 8 independent dpbf16 chains cover the instruction's latency.
template <int NR, int MB>
void GemvW4Bf16Block(float* y, int64_t ldy, const uint16_t* x, int64_t ldx, const float* xg, int64_t ldxg,
                     const uint8_t* q, int64_t ldq, const float* scale, const float* min, int64_t lds, int64_t kLen,
                     int64_t G, bool accumulate, __m512i lut) {
  const __m512i low = _mm512_set1_epi16(0xF);
  __m512 a[NR][MB];
  for (int r = 0; r < NR; ++r)
    for (int mb = 0; mb < MB; ++mb) a[r][mb] = _mm512_setzero_ps();
  // t[r][mb] (+)= the pair at k of weight row r . x row mb
  auto pair = [&](int64_t k, __m512 (&t)[NR][MB]) {
    __m512bh xl[MB], xh[MB];
    for (int mb = 0; mb < MB; ++mb) {
      xl[mb] = XHalves(x + mb * ldx, k, k + 32);
      xh[mb] = XHalves(x + mb * ldx, k + 16, k + 48);
    }
    for (int r = 0; r < NR; ++r) {
      __m512i b = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + r * ldq + k / 2)));
      __m512bh wl = (__m512bh)_mm512_permutexvar_epi16(_mm512_and_si512(b, low), lut);
      __m512bh wh = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(b, 4), lut);
      for (int mb = 0; mb < MB; ++mb) t[r][mb] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(t[r][mb], wl, xl[mb]), wh, xh[mb]);
    }
  };
  auto zero = [](__m512 (&t)[NR][MB]) {
    for (int r = 0; r < NR; ++r)
      for (int mb = 0; mb < MB; ++mb) t[r][mb] = _mm512_setzero_ps();
  };
  // a[r][mb] += t[r][mb] * the scale of group g of row r
  auto scaleInto = [&](int64_t g, __m512 (&t)[NR][MB]) {
    for (int r = 0; r < NR; ++r) {
      __m512 s = _mm512_set1_ps(scale[r * lds + g]);
      for (int mb = 0; mb < MB; ++mb) a[r][mb] = _mm512_fmadd_ps(t[r][mb], s, a[r][mb]);
    }
  };
  int64_t pairsEnd = kLen & ~int64_t(63);
  __m512 t[NR][MB];
  if (G == 32) {
    for (int64_t k = 0; k < pairsEnd; k += 64) {
      zero(t);
      pair(k, t);
      int64_t g = k / 32;
      for (int r = 0; r < NR; ++r) {
        __m512 s = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(scale[r * lds + g]), _mm512_set1_ps(scale[r * lds + g + 1]));
        for (int mb = 0; mb < MB; ++mb) a[r][mb] = _mm512_fmadd_ps(t[r][mb], s, a[r][mb]);
      }
    }
  } else {
    for (int64_t k0 = 0; k0 < pairsEnd; k0 += G) {
      zero(t);
      for (int64_t k = k0; k < std::min(pairsEnd, k0 + G); k += 64) pair(k, t);
      scaleInto(k0 / G, t);
    }
  }
  if (pairsEnd < kLen) {
    int64_t k = pairsEnd;
    zero(t);
    for (int r = 0; r < NR; ++r) {
      __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + r * ldq + k / 2)));
      __m512i idx = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(b, _mm256_set1_epi16(0xF))),
                                       _mm256_srli_epi16(b, 4), 1);
      __m512bh w = (__m512bh)_mm512_permutexvar_epi16(idx, lut);
      for (int mb = 0; mb < MB; ++mb)
        t[r][mb] = _mm512_dpbf16_ps(t[r][mb], w, (__m512bh)_mm512_loadu_si512(x + mb * ldx + k));
    }
    scaleInto(k / G, t);
  }
  int64_t ng = (kLen + G - 1) / G;
  for (int r = 0; r < NR; ++r)
    for (int mb = 0; mb < MB; ++mb) {
      float v = _mm512_reduce_add_ps(a[r][mb]) + DotLanes<V512>(min + r * lds, xg + mb * ldxg, ng);
      float* o = y + mb * ldy + r;
      *o = accumulate ? *o + v : v;
    }
}

template <int MB>
struct W4Bf16Rows {
  static void Run(float* y, int64_t ldy, const uint16_t* x, int64_t ldx, const float* xg, int64_t ldxg,
                  const uint8_t* q, int64_t ldq, const float* scale, const float* min, int64_t lds, int64_t N,
                  int64_t kLen, int64_t G, bool acc) {
    constexpr int NR = MB == 1 ? 8 : 2;  // 32 zmm: t, acc, x, the table and the unpack temporaries
    const __m512i lut = NibbleToBf16Table();
    int64_t n = 0;
    for (; n + NR <= N; n += NR)
      GemvW4Bf16Block<NR, MB>(y + n, ldy, x, ldx, xg, ldxg, q + n * ldq, ldq, scale + n * lds, min + n * lds, lds,
                              kLen, G, acc, lut);
    for (; n < N; ++n)
      GemvW4Bf16Block<1, MB>(y + n, ldy, x, ldx, xg, ldxg, q + n * ldq, ldq, scale + n * lds, min + n * lds, lds,
                             kLen, G, acc, lut);
  }
};

void GemvW4Bf16(float* y, int64_t ldy, const uint16_t* x, int64_t ldx, const float* xsum, int64_t ldxs,
                const uint8_t* q, int64_t ldq, const float* scale, const float* min, int64_t lds, int64_t M, int64_t N,
                int64_t kLen, int64_t G, bool acc) {
  GemvBlocks<4, uint16_t, W4Bf16Rows>(y, ldy, x, ldx, xsum, ldxs, q, ldq, scale, min, lds, M, N, kLen, G, acc);
}

// constexpr: the tables are constant-initialized, so no code compiled for AVX-512 runs at load time on a
// CPU without it (a run-time copy of the 64-byte table compiled to one zmm move here).
constexpr QuantSimdOps kOps = MakeQuantOps<V512>("avx512");

constexpr QuantSimdOps WithBf16(QuantSimdOps ops) {
  ops.gemv_w4_bf16 = GemvW4Bf16;
  return ops;
}
constexpr QuantSimdOps kOpsBf16 = WithBf16(kOps);

}  // namespace

const QuantSimdOps* QuantAvx512Ops() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512bf16") ? &kOpsBf16 : &kOps;
}

}  // namespace atb

#pragma GCC diagnostic pop
#pragma GCC pop_options

#else
namespace atb {
const QuantSimdOps* QuantAvx512Ops() { return nullptr; }
}  // namespace atb
#endif
