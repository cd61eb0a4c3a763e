// AVX-512 (F + BW + VL + DQ, with FMA and F16C) table. The file is compiled
// twice: natively here, with those target features for this file only (pragma
// below, after every system header; everything lives in an anonymous
// namespace) and selected only when CPUID and the OS (XCR0) report them; and
// a second time by simd_avx512_simde.cpp against SIMDe, whose portable
// implementations of the same intrinsics let a CPU without AVX-512 run this
// code's logic in the tests (table "avx512-simde"; SIMDe's fmadd is not fused,
// so that table's results differ from the native one in the last bits).
//
// Numerics, relative to the AVX2 table:
// * bit-identical: elementwise ops, exp/silu (same polynomial), conversions,
//   rope and silu_mul (HF's roundings), the lanes Mmad (same 8-lane sums: a
//   zmm holds 8 k of two weight rows, see LanesBlock), and every Mmad whose
//   elements are one fma chain over k (nn, tn, nn_rows);
// * same contract, other association: reductions and the nt / nt_rows Mmads
//   sum 16 lanes, then a fixed tree.
// The AVX512-BF16 instructions stay out of the table's existing entries:
// vcvtneps2bf16 flushes denormal inputs to zero (torch rounds them), and
// vdpbf16ps sums k in pairs with denormals flushed, which would break the lanes
// contract that makes a linear's result independent of its K tiling and equal
// across tables. Decode GEMVs are bound by memory, where widening bf16 with a
// shift costs nothing. vdpbf16ps runs only in its own entry, mmad_nt_dp_bf16
// (compute-bound bf16 GEMMs, whole K per call), present in the table "avx512"
// picks where CPUID reports avx512bf16 (and in the SIMDe table).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "block_prefetch.h"
#include "dtype.h"
#include "simd.h"

#if defined(ATB_SIMD_SIMDE)
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>
#include <simde/x86/f16c.h>
#include <simde/x86/fma.h>
#ifndef _MM_FROUND_NO_EXC
#define _MM_FROUND_NO_EXC SIMDE_MM_FROUND_NO_EXC
#endif
#define ATB_AVX512_TABLE kAvx512Simde
#define ATB_AVX512_NAME "avx512-simde"
#define ATB_AVX512_AMX_NAME "avx512-amx-simde"
#define ATB_AVX512_BUILT 1
#elif defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
// GCC's headers seed several intrinsics' unused lanes from a self-initialized
// variable (_mm512_undefined_*), which -Wall reports at every inlined use.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#define ATB_AVX512_TABLE kAvx512
#define ATB_AVX512_NAME "avx512"
#define ATB_AVX512_AMX_NAME "avx512-amx"
#define ATB_AVX512_BUILT 1
#define ATB_AVX512_NATIVE 1
#endif

#if defined(ATB_AVX512_BUILT)
// Vector-typed function pointers as template arguments (the load routines)
// drop the vector type's alignment attribute, which is harmless here.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wignored-attributes"
namespace AscendC {
namespace {

using V = __m512;

// Keeps a rounded product from being contracted with the following add into
// an FMA (HF rounds x*cos before adding). SIMDe's portable code has no FMA to
// contract into.
inline V NoFuse(V v) {
#if defined(ATB_AVX512_NATIVE)
  __asm__("" : "+v"(v));
#endif
  return v;
}

inline __mmask16 Tail(int64_t r) { return __mmask16((1u << r) - 1u); }

// Masked fp32 loads and stores touch only the selected lanes' memory. SIMDe
// (0.8.2) emulates them with a full 64-byte load and a full store of zeros in
// the unselected lanes, past the end of the caller's buffer: there, they go
// lane by lane.
inline V MaskLoad(__mmask16 m, const float* p) {
#if defined(ATB_AVX512_NATIVE)
  return _mm512_maskz_loadu_ps(m, p);
#else
  alignas(64) float buf[16] = {0};
  for (int j = 0; j < 16; ++j)
    if (m >> j & 1) buf[j] = p[j];
  return _mm512_load_ps(buf);
#endif
}
inline void MaskStore(float* p, __mmask16 m, V v) {
#if defined(ATB_AVX512_NATIVE)
  _mm512_mask_storeu_ps(p, m, v);
#else
  alignas(64) float buf[16];
  _mm512_store_ps(buf, v);
  for (int j = 0; j < 16; ++j)
    if (m >> j & 1) p[j] = buf[j];
#endif
}
// The same for 16 words.
inline void MaskStoreWords(uint16_t* p, __mmask16 m, __m256i v) {
#if defined(ATB_AVX512_NATIVE)
  _mm256_mask_storeu_epi16(p, m, v);
#else
  alignas(32) uint16_t buf[16];
  _mm256_store_si256(reinterpret_cast<__m256i*>(buf), v);
  for (int j = 0; j < 16; ++j)
    if (m >> j & 1) p[j] = buf[j];
#endif
}

// 8 lanes summed in the AVX2 table's order.
inline float HSum8(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
  return _mm_cvtss_f32(lo);
}
inline __m256 Fold(V v) { return _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1)); }
inline float HSum(V v) { return HSum8(Fold(v)); }

// The lane sums of up to 16 accumulators at once, in the AVX2 table's HSum4 tree (simd_hsum4.h, after lane i
// + lane i + 8: neighbours, then neighbours twice more), transposed as it goes: 45 shuffles and adds for 16
// sums, where four HSum4 (upper halves folded, then an hadd tree) took ~76 and each sum then its own
// extract and store. Lane j of the result holds the sum of a[kHSum16Order[j]] (accumulators past N count as
// zero). Same bits as HSum4, sum by sum: the few-row kernels' outputs did not change in any bit (63 outputs
// of the linears, paged and flash attention, against the build before).
constexpr int kHSum16Order[16] = {0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15};
template <int N>
inline V HSum16(const V* a) {
  auto at = [&](int i) { return i < N ? a[i] : _mm512_setzero_ps(); };
  // [lanes 0..7 + 8..15 of a[2j] | the same of a[2j + 1]]
  V f[8];
#pragma GCC unroll 8
  for (int j = 0; j < 8; ++j)
    f[j] = _mm512_add_ps(_mm512_shuffle_f32x4(at(2 * j), at(2 * j + 1), _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_f32x4(at(2 * j), at(2 * j + 1), _MM_SHUFFLE(3, 2, 3, 2)));
  // Neighbouring lanes of two vectors, added: [x0 + x1, x2 + x3, y0 + y1, y2 + y3] per 128-bit block.
  auto pairs = [](V x, V y) {
    return _mm512_add_ps(_mm512_shuffle_ps(x, y, _MM_SHUFFLE(2, 0, 2, 0)), _mm512_shuffle_ps(x, y, _MM_SHUFFLE(3, 1, 3, 1)));
  };
  V g[4], h[2];
#pragma GCC unroll 4
  for (int j = 0; j < 4; ++j) g[j] = pairs(f[2 * j], f[2 * j + 1]);
  h[0] = pairs(g[0], g[1]);
  h[1] = pairs(g[2], g[3]);
  // Each accumulator's two halves sit in blocks 0 and 1 (or 2 and 3) of h at the same position.
  return _mm512_add_ps(_mm512_shuffle_f32x4(h[0], h[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(h[0], h[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// Row r of a [R, CN] block of outputs, C[r * ldc + c] (+)= the lane sums of s[r * CN + c] (R * CN <= 32): the
// sums by HSum16, then one permute and one masked store per row instead of an extract and a store per sum.
template <int R, int CN>
inline void StoreLaneSums(float* C, int64_t ldc, const V* s, bool acc) {
  constexpr int kOut = R * CN;
  static_assert(kOut <= 32, "two HSum16 at most");
  struct Index {
    alignas(64) int32_t v[R][16];
  };
  static constexpr Index kIdx = [] {
    Index x{};
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < 16; ++c) {
        int e = r * CN + (c < CN ? c : 0), pos = 0;
        while (kHSum16Order[pos] != e % 16) ++pos;
        x.v[r][c] = 16 * (e / 16) + pos;
      }
    return x;
  }();
  const V lo = HSum16<std::min(kOut, 16)>(s);
  V hi = _mm512_setzero_ps();
  if constexpr (kOut > 16) hi = HSum16<kOut - 16>(s + 16);
  const __mmask16 m = Tail(CN);
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    V v = _mm512_permutex2var_ps(lo, _mm512_load_si512(kIdx.v[r]), hi);
    if (acc) v = _mm512_add_ps(MaskLoad(m, C + r * ldc), v);
    MaskStore(C + r * ldc, m, v);
  }
}

#include "simd_exp_poly.h"  // kExpCephesP, kExp2Deg6, Horner
constexpr auto Fma16 = [](V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); };
constexpr auto Set16 = [](float v) { return _mm512_set1_ps(v); };

// exp as in the AVX2 table (Cephes range reduction, degree-5 polynomial, the
// same fma steps), so both tables give the same bits; flushes to 0 below -87.3.
inline V Exp16(V x) {
  const V hiLim = _mm512_set1_ps(88.3762626647949f), loLim = _mm512_set1_ps(-87.3365447505531f);
  __mmask16 under = _mm512_cmp_ps_mask(x, loLim, _CMP_LT_OQ);
  x = _mm512_min_ps(_mm512_max_ps(x, loLim), hiLim);
  V fx = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(0.693359375f), x);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(-2.12194440e-4f), x);
  V y = Horner(x, kExpCephesP, Fma16, Set16);
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.0f)));
  __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(fx), _mm512_set1_epi32(127)), 23);
  y = _mm512_mul_ps(y, _mm512_castsi512_ps(e));
  return _mm512_maskz_mov_ps(__mmask16(~under), y);
}
// exp(x) for x <= 0 as the AVX2 table's ExpNonPositive8 computes it (the same steps, the same bits).
inline V ExpNonPositive16(V x) {
  V t = _mm512_max_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), _mm512_set1_ps(-127.0f));
  V n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  V f = _mm512_sub_ps(t, n);
  V p = Horner(f, kExp2Deg6, Fma16, Set16);
  __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}
inline V Silu16(V x) {
  V e = Exp16(_mm512_sub_ps(_mm512_setzero_ps(), x));
  // Exp16 clamps exp(+inf) to a finite value, so silu(-inf) would be -inf; torch gives
  // -inf * sigmoid(-inf) = -inf * 0 = NaN (as the AVX2 table): set those lanes to NaN.
  __mmask16 negInf = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-INFINITY), _CMP_EQ_OQ);
  return _mm512_mask_mov_ps(_mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0f), e)), negInf,
                            _mm512_set1_ps(NAN));
}

// Elementwise ops: the tail runs the same vector op on zero-padded (masked)
// lanes, so an element's result never depends on its position in the call.
template <typename Op>
inline void Map2(float* d, const float* a, const float* b, int64_t n, Op op) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(d + i, op(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i)));
  if (i < n) {
    __mmask16 m = Tail(n - i);
    MaskStore(d + i, m, op(MaskLoad(m, a + i), MaskLoad(m, b + i)));
  }
}
template <typename Op>
inline void Map1(float* d, const float* a, int64_t n, Op op) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(d + i, op(_mm512_loadu_ps(a + i)));
  if (i < n) {
    __mmask16 m = Tail(n - i);
    MaskStore(d + i, m, op(MaskLoad(m, a + i)));
  }
}

void Add(float* d, const float* a, const float* b, int64_t n) { Map2(d, a, b, n, [](V x, V y) { return _mm512_add_ps(x, y); }); }
void Sub(float* d, const float* a, const float* b, int64_t n) { Map2(d, a, b, n, [](V x, V y) { return _mm512_sub_ps(x, y); }); }
void Mul(float* d, const float* a, const float* b, int64_t n) { Map2(d, a, b, n, [](V x, V y) { return _mm512_mul_ps(x, y); }); }
// maxps returns its second operand when either is NaN: (b, a) keeps the AVX2 table's choice.
void Max(float* d, const float* a, const float* b, int64_t n) { Map2(d, a, b, n, [](V x, V y) { return _mm512_max_ps(y, x); }); }
void Muls(float* d, const float* a, float s, int64_t n) {
  V v = _mm512_set1_ps(s);
  Map1(d, a, n, [&](V x) { return _mm512_mul_ps(x, v); });
}
void Adds(float* d, const float* a, float s, int64_t n) {
  V v = _mm512_set1_ps(s);
  Map1(d, a, n, [&](V x) { return _mm512_add_ps(x, v); });
}
void Axpy(float* d, const float* a, float s, int64_t n) {
  V v = _mm512_set1_ps(s);
  Map2(d, a, d, n, [&](V x, V y) { return _mm512_fmadd_ps(x, v, y); });
}
void Exp(float* d, const float* a, int64_t n) { Map1(d, a, n, Exp16); }
void Silu(float* d, const float* a, int64_t n) { Map1(d, a, n, Silu16); }
void SiluMul(float* d, const float* g, const float* u, int64_t n) {
  Map2(d, g, u, n, [](V x, V y) { return _mm512_mul_ps(Silu16(x), y); });
}
void Duplicate(float* d, float v, int64_t n) {
  V x = _mm512_set1_ps(v);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(d + i, x);
  if (i < n) MaskStore(d + i, Tail(n - i), x);
}

// Reductions: 16 lanes (masked zero-padded tail), folded to 8, then the AVX2 tree.
template <typename F>
inline float Reduce16(const float* a, const float* b, int64_t n, F f) {
  V s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    s0 = f(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), s0);
    s1 = f(_mm512_loadu_ps(a + i + 16), _mm512_loadu_ps(b + i + 16), s1);
  }
  for (; i + 16 <= n; i += 16) s0 = f(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), s0);
  if (i < n) {
    __mmask16 m = Tail(n - i);
    s1 = f(MaskLoad(m, a + i), MaskLoad(m, b + i), s1);
  }
  return HSum(_mm512_add_ps(s0, s1));
}
float ReduceSum(const float* a, int64_t n) { return Reduce16(a, a, n, [](V x, V, V s) { return _mm512_add_ps(s, x); }); }
float SumSquares(const float* a, int64_t n) { return Reduce16(a, a, n, [](V x, V, V s) { return _mm512_fmadd_ps(x, x, s); }); }
float Dot(const float* a, const float* b, int64_t n) { return Reduce16(a, b, n, [](V x, V y, V s) { return _mm512_fmadd_ps(x, y, s); }); }
float ReduceMax(const float* a, int64_t n) {
  V m = _mm512_set1_ps(-INFINITY);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(a + i));
  if (i < n) m = _mm512_mask_max_ps(m, Tail(n - i), m, MaskLoad(Tail(n - i), a + i));
  __m256 h = _mm256_max_ps(_mm512_castps512_ps256(m), _mm512_extractf32x8_ps(m, 1));
  __m128 l = _mm_max_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  l = _mm_max_ps(l, _mm_movehl_ps(l, l));
  l = _mm_max_ss(l, _mm_shuffle_ps(l, l, 0xB1));
  return _mm_cvtss_f32(l);
}

// Storage loads of 16 elements to fp32 lanes; 16-bit data: 8 of them come
// from two places (LanesBlock's two weight rows), widened together.
inline V Widen16H(__m256i h) { return _mm512_cvtph_ps(h); }
inline V Widen16B(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }
inline __m256i LoadU256(const uint16_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline __m128i LoadU128(const uint16_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }
inline V Load16(const float* p) { return _mm512_loadu_ps(p); }
inline V Load16H(const uint16_t* p) { return Widen16H(LoadU256(p)); }
inline V Load16B(const uint16_t* p) { return Widen16B(LoadU256(p)); }
inline V Load16(const float* p, __mmask16 m) { return MaskLoad(m, p); }
// Masked 16-bit loads and stores touch only the selected lanes' memory: AVX512BW+VL's masked word moves
// (a copy through a zero-padded stack buffer, which SIMDe's table keeps for the reason MaskLoad gives,
// measured 2.5x slower for a whole bf16 silu_mul, whose every step runs this path).
template <V (*W)(__m256i)>
inline V LoadTail16(const uint16_t* p, __mmask16 m) {
#if defined(ATB_AVX512_NATIVE)
  return W(_mm256_maskz_loadu_epi16(m, p));
#else
  alignas(32) uint16_t buf[16] = {0};
  for (int j = 0; j < 16; ++j)
    if (m >> j & 1) buf[j] = p[j];
  return W(_mm256_load_si256(reinterpret_cast<const __m256i*>(buf)));
#endif
}
inline V Load16H(const uint16_t* p, __mmask16 m) { return LoadTail16<Widen16H>(p, m); }
inline V Load16B(const uint16_t* p, __mmask16 m) { return LoadTail16<Widen16B>(p, m); }
inline float Load1(const float* p) { return *p; }
inline float Load1H(const uint16_t* p) { return ToFloat(half{*p}); }
inline float Load1B(const uint16_t* p) { return BitsToFloat(uint32_t(*p) << 16); }

// fp32 -> fp16, 16 lanes (two F16C halves: the same rounding as the AVX2 table).
inline __m256i NarrowH(V v) {
  __m128i lo = _mm256_cvtps_ph(_mm512_castps512_ps256(v), _MM_FROUND_TO_NEAREST_INT);
  __m128i hi = _mm256_cvtps_ph(_mm512_extractf32x8_ps(v, 1), _MM_FROUND_TO_NEAREST_INT);
  return _mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1);
}
// fp32 -> bf16 bits in the low half of each 32-bit lane: round to nearest
// even at bit 16; a NaN becomes a quiet NaN (as FromFloat<bfloat16_t>).
inline __m512i Bf16Bits(V x) {
  __m512i u = _mm512_castps_si512(x);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
  __mmask16 isnan = _mm512_cmpgt_epi32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                           _mm512_set1_epi32(0x7f800000));
  __m512i qnan = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
  return _mm512_mask_blend_epi32(isnan, r, qnan);
}
inline __m128i Pack8(__m256i r) { return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)); }
inline __m256i NarrowB(V v) {
  __m512i r = Bf16Bits(v);
  return _mm256_inserti128_si256(_mm256_castsi128_si256(Pack8(_mm512_castsi512_si256(r))),
                                 Pack8(_mm512_extracti64x4_epi64(r, 1)), 1);
}
inline void StoreU256(uint16_t* p, __m256i v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v); }
template <__m256i (*N)(V)>
inline void StoreTail16(uint16_t* p, V v, int64_t n) {
#if defined(ATB_AVX512_NATIVE)
  _mm256_mask_storeu_epi16(p, Tail(n), N(v));
#else
  alignas(32) uint16_t buf[16];
  _mm256_store_si256(reinterpret_cast<__m256i*>(buf), N(v));
  std::memcpy(p, buf, size_t(n) * sizeof(uint16_t));
#endif
}

void F16ToF32(float* d, const uint16_t* s, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(d + i, Load16H(s + i));
  if (i < n) MaskStore(d + i, Tail(n - i), Load16H(s + i, Tail(n - i)));
}
void Bf16ToF32(float* d, const uint16_t* s, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(d + i, Load16B(s + i));
  if (i < n) MaskStore(d + i, Tail(n - i), Load16B(s + i, Tail(n - i)));
}
void F32ToF16(uint16_t* d, const float* s, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) StoreU256(d + i, NarrowH(_mm512_loadu_ps(s + i)));
  if (i < n) StoreTail16<NarrowH>(d + i, MaskLoad(Tail(n - i), s + i), n - i);
}
void F32ToBf16(uint16_t* d, const float* s, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) StoreU256(d + i, NarrowB(_mm512_loadu_ps(s + i)));
  if (i < n) StoreTail16<NarrowB>(d + i, MaskLoad(Tail(n - i), s + i), n - i);
}

// Storage traits: 16 lanes in, 16 out (masked forms for tails), and Round16 =
// round to the storage precision but stay in fp32 (the value HF's
// intermediate tensor holds).
struct F32T {
  using T = float;
  static V L(const float* p) { return _mm512_loadu_ps(p); }
  static V L(const float* p, __mmask16 m) { return MaskLoad(m, p); }
  static void S(float* p, V v) { _mm512_storeu_ps(p, v); }
  static void S(float* p, V v, __mmask16 m) { MaskStore(p, m, v); }
  static V Round(V v) { return NoFuse(v); }
};
template <V (*W)(__m256i), __m256i (*N)(V)>
struct Half16T {
  using T = uint16_t;
  static V L(const uint16_t* p) { return W(LoadU256(p)); }
  static V L(const uint16_t* p, __mmask16 m) { return LoadTail16<W>(p, m); }
  static void S(uint16_t* p, V v) { StoreU256(p, N(v)); }
  static void S(uint16_t* p, V v, __mmask16 m) { StoreTail16<N>(p, v, __builtin_popcount(unsigned(m))); }
};
struct F16T : Half16T<Widen16H, NarrowH> {
  static V Round(V v) { return Widen16H(NarrowH(v)); }
};
struct Bf16T : Half16T<Widen16B, NarrowB> {
  // Rounded in the fp32 lanes (no pack/unpack); a NaN stays a quiet NaN.
  static V Round(V v) {
    __m512i u = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb);
    __m512i nan = _mm512_or_si512(u, _mm512_set1_epi32(0x00400000));
    __mmask16 isnan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    return _mm512_castsi512_ps(_mm512_and_si512(_mm512_mask_blend_epi32(isnan, r, nan),
                                                _mm512_set1_epi32(int32_t(0xffff0000u))));
  }
};

// No FMA on purpose (see the AVX2 table): HF rounds each product first.
template <class S>
void Rope(typename S::T* dst, const typename S::T* src, const float* cos, const float* sin, int64_t rows,
          int64_t pitch, int64_t headDim, int64_t rotary, bool interleave) {
  using T = typename S::T;
  const __m512i negEvenBits = _mm512_set_epi32(0, INT32_MIN, 0, INT32_MIN, 0, INT32_MIN, 0, INT32_MIN, 0, INT32_MIN, 0,
                                               INT32_MIN, 0, INT32_MIN, 0, INT32_MIN);
  const V negEven = _mm512_castsi512_ps(negEvenBits);
  for (int64_t r = 0; r < rows; ++r) {
    const T* x = src + r * pitch;
    T* y = dst + r * pitch;
    if (!interleave) {
      int64_t h = rotary / 2;
      for (int64_t i = 0; i < h; i += 16) {
        __mmask16 m = Tail(std::min<int64_t>(16, h - i));
        V x1 = S::L(x + i, m), x2 = S::L(x + h + i, m);
        V a1 = S::Round(_mm512_mul_ps(x1, MaskLoad(m, cos + i)));
        V b1 = S::Round(_mm512_mul_ps(x2, MaskLoad(m, sin + i)));
        V a2 = S::Round(_mm512_mul_ps(x2, MaskLoad(m, cos + h + i)));
        V b2 = S::Round(_mm512_mul_ps(x1, MaskLoad(m, sin + h + i)));
        // Results are computed before storing: dst may alias src.
        V o1 = _mm512_sub_ps(a1, b1), o2 = _mm512_add_ps(a2, b2);
        S::S(y + i, o1, m);
        S::S(y + h + i, o2, m);
      }
    } else {
      for (int64_t i = 0; i < rotary; i += 16) {
        __mmask16 m = Tail(std::min<int64_t>(16, rotary - i));
        V v = S::L(x + i, m);
        // (x0, x1, x2, x3, ...) -> (-x1, x0, -x3, x2, ...)
        V rot = _mm512_xor_ps(_mm512_shuffle_ps(v, v, 0xB1), negEven);
        V a = S::Round(_mm512_mul_ps(v, MaskLoad(m, cos + i)));
        V b = S::Round(_mm512_mul_ps(rot, MaskLoad(m, sin + i)));
        S::S(y + i, _mm512_add_ps(a, b), m);
      }
    }
    if (y != x && rotary < headDim) std::memcpy(y + rotary, x + rotary, size_t(headDim - rotary) * sizeof(T));
  }
}

template <class S>
void SiluMulT(uint16_t* d, const uint16_t* g, const uint16_t* u, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) S::S(d + i, _mm512_mul_ps(S::Round(Silu16(S::L(g + i))), S::L(u + i)));
  if (i < n) {
    __mmask16 m = Tail(n - i);
    S::S(d + i, _mm512_mul_ps(S::Round(Silu16(S::L(g + i, m))), S::L(u + i, m)), m);
  }
}

// swiglu_out / residual_out (simd.h): SiluMulT's and add's steps on the sums rounded in the lanes (S::Round
// is S::L of S::S, the value a stored and reloaded T holds).
template <class S>
void SwigluOut(uint16_t* d, const float* g, const float* u, int64_t n) {
  auto out = [](V gv, V uv) { return _mm512_mul_ps(S::Round(Silu16(S::Round(gv))), S::Round(uv)); };
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) S::S(d + i, out(_mm512_loadu_ps(g + i), _mm512_loadu_ps(u + i)));
  if (i < n) {
    __mmask16 m = Tail(n - i);
    S::S(d + i, out(MaskLoad(m, g + i), MaskLoad(m, u + i)), m);
  }
}
template <class S>
void ResidualOut(uint16_t* d, const float* a, const uint16_t* r, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) S::S(d + i, _mm512_add_ps(S::Round(_mm512_loadu_ps(a + i)), S::L(r + i)));
  if (i < n) {
    __mmask16 m = Tail(n - i);
    S::S(d + i, _mm512_add_ps(S::Round(MaskLoad(m, a + i)), S::L(r + i, m)), m);
  }
}

template <class S>
void RmsScaleOut(uint16_t* d, const float* h, const float* w, float rstd, int64_t n) {
  const V r = _mm512_set1_ps(rstd);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    S::S(d + i, _mm512_mul_ps(S::Round(_mm512_mul_ps(_mm512_loadu_ps(h + i), r)), _mm512_loadu_ps(w + i)));
  if (i < n) {
    __mmask16 m = Tail(n - i);
    S::S(d + i, _mm512_mul_ps(S::Round(_mm512_mul_ps(MaskLoad(m, h + i), r)), MaskLoad(m, w + i)), m);
  }
}

// NC 16-column chunks from c0 at once: a chunk's max is a chain of dependent vmaxps, so NC chains overlap
// their latency (the max of the same values in any order: the same result).
template <int NC>
inline __mmask16 ColMaxChunks(float* m, const float* S, int64_t ld, int64_t rows, int64_t n, int64_t c0) {
  __mmask16 nan = 0, mask[NC];
  V mc[NC];
#pragma GCC unroll 4
  for (int i = 0; i < NC; ++i) {
    mask[i] = Tail(std::min<int64_t>(16, n - c0 - 16 * i));
    mc[i] = MaskLoad(mask[i], m + c0 + 16 * i);
  }
  for (int64_t r = 0; r < rows; ++r) {
#pragma GCC unroll 4
    for (int i = 0; i < NC; ++i) {
      V v = MaskLoad(mask[i], S + r * ld + c0 + 16 * i);
      nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      mc[i] = _mm512_max_ps(v, mc[i]);  // a NaN v gives mc (maxps returns its second operand)
    }
  }
#pragma GCC unroll 4
  for (int i = 0; i < NC; ++i) MaskStore(m + c0 + 16 * i, mask[i], mc[i]);
  return nan;
}

bool ColMax(float* m, const float* S, int64_t ld, int64_t rows, int64_t n) {
  __mmask16 nan = 0;
  int64_t c = 0;
  for (; c + 64 <= n; c += 64) nan |= ColMaxChunks<4>(m, S, ld, rows, n, c);
  for (; c < n; c += 16) nan |= ColMaxChunks<1>(m, S, ld, rows, n, c);
  return nan != 0;
}

void ExpSubAcc(float* d, const float* S, int64_t ld, const float* b, float* sum, int64_t rows, int64_t n) {
  for (int64_t c = 0; c < n; c += 16) {
    __mmask16 mask = Tail(std::min<int64_t>(16, n - c));
    V bc = MaskLoad(mask, b + c), sc = MaskLoad(mask, sum + c);
    for (int64_t r = 0; r < rows; ++r) {
      V e = ExpNonPositive16(_mm512_sub_ps(MaskLoad(mask, S + r * ld + c), bc));
      MaskStore(d + r * ld + c, mask, e);
      sc = _mm512_add_ps(sc, e);
    }
    MaskStore(sum + c, mask, sc);
  }
}

// ---- Lane-accumulating NT Mmad (decode linears) -----------------------------
// One zmm holds k..k+7 of two weight rows side by side and A's 8 values are
// broadcast to both halves, so each 32-bit lane runs exactly the AVX2 table's
// 8-lane fma chain: bit-identical lanes, at half the instructions. Pair loads:
inline V PairF(const float* p, int64_t ld) { return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(p)), _mm256_loadu_ps(p + ld), 1); }
inline __m256i Pair16(const uint16_t* p, int64_t ld) {
  return _mm256_inserti128_si256(_mm256_castsi128_si256(LoadU128(p)), LoadU128(p + ld), 1);
}
inline V PairH(const uint16_t* p, int64_t ld) { return Widen16H(Pair16(p, ld)); }
inline V PairB(const uint16_t* p, int64_t ld) { return Widen16B(Pair16(p, ld)); }
// A single weight row (odd N): the upper half is zero and never stored.
inline V SingleF(const float* p) { return _mm512_insertf32x8(_mm512_setzero_ps(), _mm256_loadu_ps(p), 0); }
inline V SingleH(const uint16_t* p) { return Widen16H(_mm256_castsi128_si256(LoadU128(p))); }
inline V SingleB(const uint16_t* p) { return Widen16B(_mm256_castsi128_si256(LoadU128(p))); }

template <typename TB, V (*LP)(const TB*, int64_t), V (*LS)(const TB*)>
struct LaneLoads {
  static V Pair(const TB* p, int64_t ld) { return LP(p, ld); }
  static V Single(const TB* p) { return LS(p); }
};
using LanesF = LaneLoads<float, PairF, SingleF>;
using LanesH = LaneLoads<uint16_t, PairH, SingleH>;
using LanesB = LaneLoads<uint16_t, PairB, SingleB>;

// Where a block's weight rows lie and where their lanes go. Adjacent: pair c is rows 2c and 2c + 1 (lanes side by
// side); runs (MmadNTLanes' few-row form): every row of the block in its own run of the N rows.
struct LanesLayout {
  int64_t pairLd;     // weight elements from a pair's first row to its second
  int64_t pairStep;   // weight elements from pair c's first row to pair c + 1's
  int64_t laneHi;     // floats from a pair's first row's lanes to its second's
  int64_t lanePair;   // floats from pair c's lanes to pair c + 1's
  int64_t aheadRows;  // rows from each of the block's rows to the one prefetched (0: two blocks ahead, 4 * P)
};
inline LanesLayout AdjacentLanes(int64_t ldb) { return {ldb, 2 * ldb, 8, 16, 0}; }
// Runs of `run` rows: pair c is rows 2c * run and (2c + 1) * run; each run's row two ahead is prefetched.
inline LanesLayout RunLanes(int64_t ldb, int64_t run) { return {run * ldb, 2 * run * ldb, 8 * run, 16 * run, 2}; }

// The lanes blocks' software prefetch, one 64-byte line of each of a block's 2 * Pairs weight rows per 64 bytes
// of k, aheadRows on (adjacent rows: two blocks, 4 * Pairs rows), for rows up to this many bytes; the hardware
// prefetcher follows longer ones.
constexpr int64_t kLanesPrefetchMaxRowBytes = 4096;
template <int Pairs, typename TB>
inline const TB* LanesAhead(const TB* B, int64_t ldb, const LanesLayout& lay) {
  return B + (lay.aheadRows ? lay.aheadRows : 4 * Pairs) * ldb;
}
// Inlined always: GCC drops an out-of-line function that only prefetches.
template <int Pairs, typename TB>
__attribute__((always_inline)) inline void PrefetchLanesLine(const TB* ahead, const LanesLayout& lay, int64_t k) {
#pragma GCC unroll 16
  for (int c = 0; c < 2 * Pairs; ++c)
    _mm_prefetch(reinterpret_cast<const char*>(ahead + (c / 2) * lay.pairStep + (c % 2) * lay.pairLd + k), _MM_HINT_T1);
}

// R rows of A against P pairs of weight rows (or one single row, P == 0):
// R*P accumulators, every weight vector loaded once per k step for all R rows.
// Accumulators start from (and return to) the lanes buffer, so K may be split
// anywhere on a multiple of 8.
template <typename TB, class L, int R, int P>
__attribute__((noinline)) void LanesBlock(float* lanes, int64_t N, const float* A, int64_t lda, const TB* B,
                                          int64_t ldb, int64_t K, bool acc, LanesLayout lay) {
  constexpr int kP = P == 0 ? 1 : P;
  V s[R][kP];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < kP; ++c) {
      const float* l = lanes + r * N * 8 + c * lay.lanePair;
      s[r][c] = !acc ? _mm512_setzero_ps()
                     : _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(l)),
                                          P == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(l + lay.laneHi), 1);
    }
  // Short weight rows end before the hardware prefetcher ramps up: fetch the
  // rows two blocks ahead while these are used (as the AVX2 table does), into
  // L2, not L1: a T0 prefetch holds one of L1's few miss buffers until DRAM
  // answers, which capped one Zen 4 core's bf16 K=576 GEMV at ~6 GB/s; into L2
  // it streams at the plain read's rate (~12-17 GB/s on the same cold rows).
  constexpr int64_t kLine = 64 / int64_t(sizeof(TB));
  const bool prefetch = P > 0 && ldb * int64_t(sizeof(TB)) <= kLanesPrefetchMaxRowBytes;
  const TB* next = LanesAhead<kP>(B, ldb, lay);
  for (int64_t k = 0; k < K; k += 8) {
    if (prefetch && k % kLine == 0) PrefetchLanesLine<kP>(next, lay, k);
    V b[kP];
#pragma GCC unroll 8
    for (int c = 0; c < kP; ++c) b[c] = P == 0 ? L::Single(B + k) : L::Pair(B + c * lay.pairStep + k, lay.pairLd);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      V a = _mm512_broadcast_f32x8(_mm256_loadu_ps(A + r * lda + k));
#pragma GCC unroll 8
      for (int c = 0; c < kP; ++c) s[r][c] = _mm512_fmadd_ps(a, b[c], s[r][c]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < kP; ++c) {
      float* l = lanes + r * N * 8 + c * lay.lanePair;
      _mm256_storeu_ps(l, _mm512_castps512_ps256(s[r][c]));
      if (P > 0) _mm256_storeu_ps(l + lay.laneHi, _mm512_extractf32x8_ps(s[r][c], 1));
    }
}

// LanesBlock for bf16 weights, 2 pairs (4 weight rows), 2 rows of A (batch-2 decode): the same lanes, widened by
// one unpack per half instead of a zero-extension and a shift per pair. A pair's 8 + 8 values sit in a ymm (first
// row low, second high); unpacking the words against zero puts each one in the top half of a dword, its fp32
// value: the low unpack gives both rows' k..k+3, the high one k+4..k+7. So a pair's lanes live in two ymm
// accumulators, lanes 0-3 of both rows and lanes 4-7, each lane still the contract's one fma chain over its k
// (x's k..k+3 or k+4..k+7 broadcast to both halves): the same bits. Per 8 k of 4 weight rows that is 4 unpacks
// where LanesBlock issues 2 zero-extensions and 2 shifts of zmm (two 256-bit halves each on Zen 4), and the k
// loop is unrolled by a cache line with its prefetch hoisted. Zen 4, 2 threads, bf16 over 256 MiB from DRAM
// against the read probe in the same round, medians over ~2000 interleaved rounds bucketed by the probe's rate:
// M = 2, K = 576: 0.68-0.69 -> 0.75-0.76 of a 42+ GB/s probe, 0.87-0.88 -> 0.90-0.91 at 30-42 GB/s; K = 1536:
// 0.73 -> 0.81 and 0.88-0.89 -> 0.91. Not taken for 1, 3 or 4 rows, which measured 3-5% slower from DRAM with
// it (1 row: 0.757 -> 0.728-0.735 of a 42+ GB/s probe) though 1.5x faster on weights in L3 (4.7 MB, 54 -> 80
// GB/s): a streaming row reads faster with fewer instructions per byte in flight, so only where the zmm form's
// vector work bounds the rate (2 rows) does the unpack win.
__attribute__((noinline)) void LanesBlockBf16Rows2(float* lanes, int64_t N, const float* A, int64_t lda,
                                                   const uint16_t* B, int64_t ldb, int64_t K, bool acc,
                                                   LanesLayout lay) {
  constexpr int R = 2;
  __m256 lo[R][2], hi[R][2];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int c = 0; c < 2; ++c) {
      const float* l = lanes + r * N * 8 + c * lay.lanePair;
      const __m256 first = acc ? _mm256_loadu_ps(l) : _mm256_setzero_ps();
      const __m256 second = acc ? _mm256_loadu_ps(l + lay.laneHi) : _mm256_setzero_ps();
      lo[r][c] = _mm256_permute2f128_ps(first, second, 0x20);
      hi[r][c] = _mm256_permute2f128_ps(first, second, 0x31);
    }
  const __m256i zero = _mm256_setzero_si256();
  auto step = [&](int64_t k) {
    __m256 wl[2], wh[2];
#pragma GCC unroll 2
    for (int c = 0; c < 2; ++c) {
      const __m256i w = Pair16(B + c * lay.pairStep + k, lay.pairLd);
      wl[c] = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, w));
      wh[c] = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, w));
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m256 xl = _mm256_broadcast_ps(reinterpret_cast<const __m128*>(A + r * lda + k));
      const __m256 xh = _mm256_broadcast_ps(reinterpret_cast<const __m128*>(A + r * lda + k + 4));
#pragma GCC unroll 2
      for (int c = 0; c < 2; ++c) {
        lo[r][c] = _mm256_fmadd_ps(xl, wl[c], lo[r][c]);
        hi[r][c] = _mm256_fmadd_ps(xh, wh[c], hi[r][c]);
      }
    }
  };
  // LanesBlock's prefetch, once per unrolled line of k.
  constexpr int64_t kLine = 32;
  const bool prefetch = ldb * 2 <= kLanesPrefetchMaxRowBytes;
  const uint16_t* next = LanesAhead<2>(B, ldb, lay);
  int64_t k = 0;
  for (; k + kLine <= K; k += kLine) {
    if (prefetch) PrefetchLanesLine<2>(next, lay, k);
#pragma GCC unroll 4
    for (int64_t u = 0; u < kLine; u += 8) step(k + u);
  }
  if (prefetch && k < K) PrefetchLanesLine<2>(next, lay, k);
  for (; k < K; k += 8) step(k);
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int c = 0; c < 2; ++c) {
      float* l = lanes + r * N * 8 + c * lay.lanePair;
      _mm256_storeu_ps(l, _mm256_permute2f128_ps(lo[r][c], hi[r][c], 0x20));
      _mm256_storeu_ps(l + lay.laneHi, _mm256_permute2f128_ps(lo[r][c], hi[r][c], 0x31));
    }
}

// fn(rows, m) over M in tiles of Max rows, rows a compile-time constant for the last, shorter tile too.
template <int R, typename Fn>
inline void RowTail(int64_t left, int64_t m, Fn& fn) {
  if constexpr (R > 0) {
    if (left == R) return fn(std::integral_constant<int, R>{}, m);
    RowTail<R - 1>(left, m, fn);
  }
}
template <int Max, typename Fn>
inline void ForRowTiles(int64_t M, Fn&& fn) {
  int64_t m = 0;
  for (; m + Max <= M; m += Max) fn(std::integral_constant<int, Max>{}, m);
  RowTail<Max - 1>(M - m, m, fn);
}
template <typename Fn>
inline void ForRowBlocks(int64_t M, Fn&& fn) { ForRowTiles<8>(M, fn); }

// Up to 4 rows of A take 2 pairs (4 weight rows, below); more rows take 3 pairs (6 weight rows; with 8 rows of
// A 24 accumulators, 3 weight vectors, one broadcast: 6 weight loads and 8 broadcasts per 24 FMAs, where 2
// pairs had 4 and 8 per 16). Zen 4, 2 threads, SmolLM2's gate+up and
// down+residual over 30 layers, medians of 15 (4 alternating processes each),
// ms, 2 -> 3 pairs, cold / hot weights: fp32 M = 16 23.4-25.8 -> 21.8-23.9 /
// 19.8-24.2 -> 18.4-21.7, M = 24 35.5-37.8 -> 33.6-35.0 / 33.6-33.9 ->
// 31.1-32.5, M = 5 14.9-15.1 -> 14.2-14.6 / 7.3-8.2 -> 6.5-6.7; fp16 M = 16
// 19.3-19.9 -> 18.0-18.1 hot; bf16 M = 5 10.1-10.6 -> 9.1-9.8 cold; M = 6, 8,
// 12 within noise. A batch-16 decode runs two 8-row passes per weight block,
// the block (6 rows x kb) staying in L1 between them.
// Few rows are bound by the weight stream, not the FMAs, and it runs faster with 4 weight rows in flight than
// with 8 (the 8 interleaved row streams of 4 pairs used to be the choice here). AMX Xeon, 2 threads, SmolLM2's
// 30 layers' projections and LM head back to back from DRAM (weights in 2 MiB pages), alternating runs, ms,
// 4 -> 2 pairs: bf16 M = 1 8.80-9.16 -> 8.18-8.42, M = 2 9.48-10.13 -> 9.31-9.33, M = 4 11.36-11.47 ->
// 10.43-10.87; fp32 M = 1 17.75-18.12 -> 16.76-16.92, M = 4 20.49-20.89 -> 19.17-19.34. One pair is slower
// again (its single fma chain per row of A bounds it).

#include "simd_lanes_block8.h"  // LanesBlock8

inline __m256 Load8F(const float* p) { return _mm256_loadu_ps(p); }

template <typename TB, class L>
void MmadNTLanes(float* lanes, const float* A, int64_t lda, const TB* B, int64_t ldb, int64_t M, int64_t N, int64_t K,
                 bool acc) {
  if (K == 0) {  // an all-tail K (< 8): the lanes still start from zero
    if (!acc) std::fill(lanes, lanes + M * N * 8, 0.0f);
    return;
  }
  // With more than one pass of A rows over the same weight rows, walk K in
  // blocks so those rows stay in L1 between passes; one pass streams each
  // weight row exactly once. The blocks split K evenly, at most 256 each (a multiple of 8): on an AMX Xeon,
  // fp32 M = 16, SmolLM2's 30 MLPs and LM head, medians of 9 alternating runs in one process, ms: 512-k
  // blocks (576 = 512 + 64) 28.8-29.7, 256 27.4-27.8, 192 (576 = 3 x 192) 27.2-27.3, 128 27.9-28.1, all of K
  // 29.7-29.8.
  const int64_t blocks = (K + 255) / 256;
  const int64_t kb = M <= 8 ? K : (K + 8 * blocks - 1) / (8 * blocks) * 8;
  int64_t n = 0;
  const LanesLayout adjacent = AdjacentLanes(ldb);
  auto block = [&](auto rows, int64_t m, auto pairs, int64_t n0, int64_t k, const LanesLayout& lay) {
    constexpr int R = decltype(rows)::value, P = decltype(pairs)::value;
    if constexpr (std::is_same_v<L, LanesB> && P == 2 && R == 2)
      LanesBlockBf16Rows2(lanes + (m * N + n0) * 8, N, A + m * lda + k, lda, B + n0 * ldb + k, ldb,
                          std::min(kb, K - k), acc || k > 0, lay);
    else
      LanesBlock<TB, L, R, P>(lanes + (m * N + n0) * 8, N, A + m * lda + k, lda, B + n0 * ldb + k, ldb,
                              std::min(kb, K - k), acc || k > 0, lay);
  };
  // Up to 4 rows of A (bound by the weight stream): the block's 4 weight rows come from 4 runs of N / 4 rows,
  // each run read front to back, row after row, so the hardware prefetcher follows 4 long streams (the
  // software prefetch still requests each run's row two ahead). Adjacent rows read side by side are 4 short
  // interleaved streams it does not follow. Zen 4, 2 threads, loads only of 256 MiB of 1152-byte rows in the
  // kernel's order (16 bytes of each row per step), against a front-to-back read, medians of 11-15 interleaved
  // rounds: adjacent rows with the prefetch 0.69-0.90, 4 runs over each thread's rows 0.86-1.00, adjacent rows
  // without the prefetch 0.40-0.59. The bf16 M = 1 linear over 256 MiB against the read probe, alternating
  // processes: 0.84-0.85 -> 0.91-0.92 (runs without the prefetch: 0.87-0.93 at ~35 GB/s, but 0.66 at ~48);
  // SmolLM2's bf16 batch-1 decode graph step, 7 alternating pairs: median 9.75 -> 8.87 ms (5 of 7 faster).
  if (M <= 4 && N >= 4 * kLanesRunMinRows) {
    const int64_t run = N / 4;
    const LanesLayout runs = RunLanes(ldb, run);
    if (std::is_same_v<TB, float> && M <= 2 && !Fp32DecodeReadsCopy()) {
      // fp32 decode weights read as they lie: the AVX2 table's rows, each run's row two ahead into L1 (simd.h).
      const float* W = reinterpret_cast<const float*>(B);
      for (int64_t i = 0; i < run; ++i) {
        if (M == 2) LanesBlock8<float, Load8F, 2, 4>(lanes + i * 8, N, A, lda, W + i * ldb, ldb, K, acc, run);
        else LanesBlock8<float, Load8F, 1, 4>(lanes + i * 8, N, A, lda, W + i * ldb, ldb, K, acc, run);
      }
    } else {
      for (int64_t i = 0; i < run; ++i)
        ForRowBlocks(M, [&](auto rows, int64_t m) { block(rows, m, std::integral_constant<int, 2>{}, i, 0, runs); });
    }
    // The rows past 4 runs (N % 4 of them) in adjacent pairs and the odd row, below.
    n = 4 * run;
  }
  using std::integral_constant;
  auto panel = [&](auto pairs, int64_t n0) {
    for (int64_t k = 0; k < K; k += kb)
      ForRowBlocks(M, [&](auto rows, int64_t m) { block(rows, m, pairs, n0, k, adjacent); });
  };
  // Wide panels (3 pairs from 5 rows of A on), then pairs of pairs, single pairs and the odd row.
  if (M > 4)
    for (; n + 6 <= N; n += 6) panel(integral_constant<int, 3>{}, n);
  for (; n + 4 <= N; n += 4) panel(integral_constant<int, 2>{}, n);
  for (; n + 2 <= N; n += 2) panel(integral_constant<int, 1>{}, n);
  if (n < N) panel(integral_constant<int, 0>{}, n);
}

// ---- mmad_nt_lanes over rows4 weights (kernels/linear/linear_rows4.h) ---------
// A group's chunk of 8 k becomes two zmm of fp32: lanes 0-3 of its 4 rows (one 128-bit lane per row), then
// lanes 4-7, from one 64-byte line (bf16: each row's 8 words unpacked against zero, low and high half, as
// LanesBlockBf16Rows2 widens) or two (fp32, stored that way). x's k..k+3 and k+4..k+7 are broadcast to every
// 128-bit lane, so each lane is the contract's one fma chain over its k: MmadNTLanes' bits.
struct Rows4LoadF {
  static void Chunk(const float* c, V& lo, V& hi) {
    lo = _mm512_loadu_ps(c);
    hi = _mm512_loadu_ps(c + 16);
  }
};
struct Rows4LoadB {
  static void Chunk(const uint16_t* c, V& lo, V& hi) {
    const __m512i w = _mm512_loadu_si512(c), zero = _mm512_setzero_si512();
    lo = _mm512_castsi512_ps(_mm512_unpacklo_epi16(zero, w));
    hi = _mm512_castsi512_ps(_mm512_unpackhi_epi16(zero, w));
  }
};

// R rows of A against one group (`rows` of its 4 rows stored). A core's groups lie front to back, one stream;
// `ahead` elements past each chunk are requested into L2 (StreamPrefetchBytes in simd.h; 0: none).
template <typename TB, class L, int R>
__attribute__((noinline)) void LanesRows4Block(float* lanes, int64_t N, const float* A, int64_t lda, const TB* G,
                                               int64_t K, bool acc, int64_t rows, int64_t ahead) {
  V lo[R], hi[R];
  alignas(64) float part[32];  // a last group's rows (rows < 4), staged
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    if (!acc) {
      lo[r] = hi[r] = _mm512_setzero_ps();
      continue;
    }
    // [row][8 lanes] x 4 rows -> lanes 0-3 of each row, then 4-7.
    const float* l = lanes + r * N * 8;
    if (rows < 4) {
      std::fill(std::copy(l, l + rows * 8, part), part + 32, 0.0f);
      l = part;
    }
    const V v0 = _mm512_loadu_ps(l), v1 = _mm512_loadu_ps(l + 16);
    lo[r] = _mm512_shuffle_f32x4(v0, v1, 0x88);
    hi[r] = _mm512_shuffle_f32x4(v0, v1, 0xDD);
  }
  for (int64_t k = 0; k < K; k += 8) {
    if (ahead) PrefetchChunk(G + 4 * k + ahead);
    V wl, wh;
    L::Chunk(G + 4 * k, wl, wh);  // chunk k / 8: 32 elements each
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      lo[r] = _mm512_fmadd_ps(_mm512_broadcast_f32x4(_mm_loadu_ps(A + r * lda + k)), wl, lo[r]);
      hi[r] = _mm512_fmadd_ps(_mm512_broadcast_f32x4(_mm_loadu_ps(A + r * lda + k + 4)), wh, hi[r]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    const V t0 = _mm512_shuffle_f32x4(lo[r], hi[r], 0x44), t1 = _mm512_shuffle_f32x4(lo[r], hi[r], 0xEE);
    float* l = lanes + r * N * 8;
    float* dst = rows < 4 ? part : l;
    _mm512_storeu_ps(dst, _mm512_shuffle_f32x4(t0, t0, 0xD8));
    _mm512_storeu_ps(dst + 16, _mm512_shuffle_f32x4(t1, t1, 0xD8));
    if (rows < 4) std::memcpy(l, part, size_t(rows * 8) * sizeof(float));
  }
}

#include "simd_rows4.h"  // MmadNTLanesRows4

// ---- Few-row NT Mmad (decode attention's Q K^T) ------------------------------
// All R (<= 8) A rows against CN B rows per block: a B row is widened once.
// Each element: 16 fp32 lanes over k (the k tail masked into the last step),
// then a fixed reduction tree; independent of M, N and blocking.
template <int R> constexpr int kPanelsForRows = R <= 2 ? 8 : R <= 4 ? 5 : R <= 6 ? 4 : 3;

template <typename TB, V (*L16)(const TB*), V (*L16M)(const TB*, __mmask16), int R, int CN>
void BlockNTRows(float* C, int64_t ldc, const float* A, int64_t lda, const TB* B, int64_t ldb, int64_t K, bool acc) {
  constexpr int kOut = R * CN;
  V s[kOut];
#pragma GCC unroll 32
  for (int i = 0; i < kOut; ++i) s[i] = _mm512_setzero_ps();
  auto step = [&](int64_t k, auto loadB, auto loadA) {
    V b[CN];
#pragma GCC unroll 8
    for (int c = 0; c < CN; ++c) b[c] = loadB(B + c * ldb + k);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      V a = loadA(A + r * lda + k);
#pragma GCC unroll 8
      for (int c = 0; c < CN; ++c) s[r * CN + c] = _mm512_fmadd_ps(a, b[c], s[r * CN + c]);
    }
  };
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) step(k, [](const TB* p) { return L16(p); }, [](const float* p) { return _mm512_loadu_ps(p); });
  if (k < K) {
    __mmask16 m = Tail(K - k);
    step(k, [m](const TB* p) { return L16M(p, m); }, [m](const float* p) { return MaskLoad(m, p); });
  }
  StoreLaneSums<R, CN>(C, ldc, s, acc);
}

template <typename TB, V (*L16)(const TB*), V (*L16M)(const TB*, __mmask16)>
void MmadNTRows(float* C, int64_t ldc, const float* A, int64_t lda, const TB* B, int64_t ldb, int64_t M, int64_t N,
                int64_t K, bool acc) {
  ForRowBlocks(M, [&](auto rows, int64_t m) {
    constexpr int R = decltype(rows)::value, CN = kPanelsForRows<R>;
    float* c = C + m * ldc;
    const float* a = A + m * lda;
    int64_t n = 0;
    for (; n + CN <= N; n += CN) BlockNTRows<TB, L16, L16M, R, CN>(c + n, ldc, a, lda, B + n * ldb, ldb, K, acc);
    for (; n < N; ++n) BlockNTRows<TB, L16, L16M, R, 1>(c + n, ldc, a, lda, B + n * ldb, ldb, K, acc);
  });
}

// General NT Mmad: the few-row kernel over blocks of 8 A rows.
template <typename TB, V (*L16)(const TB*), V (*L16M)(const TB*, __mmask16)>
void MmadNT(float* C, int64_t ldc, const float* A, int64_t lda, const TB* B, int64_t ldb, int64_t M, int64_t N,
            int64_t K, bool acc) {
  MmadNTRows<TB, L16, L16M>(C, ldc, A, lda, B, ldb, M, N, K, acc);
}

// ---- NN / TN Mmad: register-blocked cube tile --------------------------------
// R rows of C by 16*NV columns in R*NV accumulators; per k step B is loaded
// once (NV vectors, masked for the last columns) for all R rows and each A
// element is one broadcast. Every element of C is one fma chain over k in
// order, whatever block it falls in, as in the AVX2 table (same bits).
// TA: A[m][k] at A + m*lda + k (NN) or A + k*lda + m (TN).
template <typename TB, V (*L16M)(const TB*, __mmask16), bool TA, int R, int NV>
__attribute__((noinline)) void TileNN(float* C, int64_t ldc, const float* A, int64_t lda, const TB* B, int64_t ldb,
                                      int64_t K, bool acc, __mmask16 last) {
  V c[R][NV];
  auto mask = [last](int v) { return v == NV - 1 ? last : __mmask16(0xffff); };
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v)
      c[r][v] = acc ? MaskLoad(mask(v), C + r * ldc + 16 * v) : _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const TB* b = B + k * ldb;
    V bv[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) bv[v] = L16M(b + 16 * v, mask(v));
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      V a = _mm512_set1_ps(TA ? A[k * lda + r] : A[r * lda + k]);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) c[r][v] = _mm512_fmadd_ps(a, bv[v], c[r][v]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) MaskStore(C + r * ldc + 16 * v, mask(v), c[r][v]);
}

// 12 rows x 2 vectors: 24 accumulators + 2 B + 1 broadcast of the 32 zmm
// registers; 14 loads per 24 FMAs, so the FMA ports set the pace.
constexpr int kTileRows = 12;

template <typename TB, V (*L16M)(const TB*, __mmask16), bool TA, int NV>
void RowsNN(float* C, int64_t ldc, const float* A, int64_t lda, const TB* B, int64_t ldb, int64_t M, int64_t K,
            bool acc, __mmask16 last) {
  ForRowTiles<kTileRows>(M, [&](auto rows, int64_t m) {
    TileNN<TB, L16M, TA, decltype(rows)::value, NV>(C + m * ldc, ldc, TA ? A + m : A + m * lda, lda, B, ldb, K, acc,
                                                    last);
  });
}

// Column panels of 32, then 16, then the masked last columns.
template <typename TB, V (*L16M)(const TB*, __mmask16), bool TA>
void MmadBlocked(float* C, int64_t ldc, const float* A, int64_t lda, const TB* B, int64_t ldb, int64_t M, int64_t N,
                 int64_t K, bool acc) {
  int64_t n = 0;
  for (; n + 32 <= N; n += 32) RowsNN<TB, L16M, TA, 2>(C + n, ldc, A, lda, B + n, ldb, M, K, acc, 0xffff);
  for (; n < N; n += 16) RowsNN<TB, L16M, TA, 1>(C + n, ldc, A, lda, B + n, ldb, M, K, acc, Tail(std::min<int64_t>(16, N - n)));
}

template <typename TB, V (*L16M)(const TB*, __mmask16)>
void MmadNN(float* C, int64_t ldc, const float* A, int64_t lda, const TB* B, int64_t ldb, int64_t M, int64_t N,
            int64_t K, bool acc) {
  MmadBlocked<TB, L16M, false>(C, ldc, A, lda, B, ldb, M, N, K, acc);
}
void MmadTN(float* C, int64_t ldc, const float* A, int64_t lda, const float* B, int64_t ldb, int64_t M, int64_t N,
            int64_t K, bool acc) {
  MmadBlocked<float, Load16, true>(C, ldc, A, lda, B, ldb, M, N, K, acc);
}

// ---- Few-row NN Mmad (decode attention's P x V) -------------------------------
// R rows x 16*NV columns of C in registers; per k the B panel is widened once
// and each A element is one broadcast. One fma chain per element over k in
// order, so the same bits as the AVX2 table.
template <int R> constexpr int kVecsForRows = R <= 6 ? 4 : 3;

template <typename TB, V (*L16M)(const TB*, __mmask16)>
void MmadNNRows(float* C, int64_t ldc, const float* A, int64_t lda, const TB* B, int64_t ldb, int64_t M, int64_t N,
                int64_t K, bool acc) {
  ForRowBlocks(M, [&](auto rows, int64_t m) {
    constexpr int R = decltype(rows)::value, NV = kVecsForRows<R>;
    float* c = C + m * ldc;
    const float* a = A + m * lda;
    int64_t n = 0;
    for (; n + 16 * NV <= N; n += 16 * NV) TileNN<TB, L16M, false, R, NV>(c + n, ldc, a, lda, B + n, ldb, K, acc, 0xffff);
    for (; n < N; n += 16)
      TileNN<TB, L16M, false, R, 1>(c + n, ldc, a, lda, B + n, ldb, K, acc, Tail(std::min<int64_t>(16, N - n)));
  });
}

// Two groups per zmm: swap 128-bit halves and add (l_j + l_j+4), swap 64-bit
// pairs and add, swap neighbours and add; lanes 0 and 8 then hold the two sums,
// each formed by exactly sum_lanes8's tree (fp32 addition commutes bitwise).
void SumLanes8(float* d, const float* l, int64_t n) {
  int64_t i = 0;
  for (; i + 2 <= n; i += 2) {
    V z = _mm512_loadu_ps(l + 8 * i);
    z = _mm512_add_ps(z, _mm512_shuffle_f32x4(z, z, 0xB1));
    z = _mm512_add_ps(z, _mm512_shuffle_ps(z, z, 0x4E));
    z = _mm512_add_ps(z, _mm512_shuffle_ps(z, z, 0xB1));
    d[i] = _mm_cvtss_f32(_mm512_castps512_ps128(z));
    d[i + 1] = _mm_cvtss_f32(_mm512_extractf32x4_ps(z, 2));
  }
  if (i < n) d[i] = HSum8(_mm256_loadu_ps(l + 8 * i));
}

#include "simd_transpose8.h"  // TransposeWiden

// t = r transposed as 16 x 16 32-bit elements (r is clobbered). The result goes to its own array, and the
// callers store whole tiles with constant indices: a copy back into r, or a store loop over a runtime count,
// kept the 16 registers on the stack (a 1 KiB rep movsq per tile: a fifth of pack_q4_pairs_dequant's time).
inline void Transpose16x16(__m512i r[16], __m512i t[16]) {
#pragma GCC unroll 8
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
#pragma GCC unroll 4
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  // r[4q + c] now holds, per 128-bit lane L, rows 4q..4q+3 of column 4L + c.
#pragma GCC unroll 4
  for (int c = 0; c < 4; ++c) {
    __m512i a = _mm512_shuffle_i32x4(r[c], r[4 + c], 0x88), b = _mm512_shuffle_i32x4(r[c], r[4 + c], 0xDD);
    __m512i d = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0x88), e = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0xDD);
    t[c] = _mm512_shuffle_i32x4(a, d, 0x88);       // column c
    t[8 + c] = _mm512_shuffle_i32x4(a, d, 0xDD);   // column 8 + c
    t[4 + c] = _mm512_shuffle_i32x4(b, e, 0x88);   // column 4 + c
    t[12 + c] = _mm512_shuffle_i32x4(b, e, 0xDD);  // column 12 + c
  }
}

// ---- GEMM over packed x (batch decode) ----------------------------------------------------------------------
// C[m][n] (+)= x[m] . W[n] with x packed in panels of 16 rows so that one 64-byte load holds the 16 rows' next
// unit of k (bf16: a k pair, pack_bf16_pairs; fp32: one k, k-major) and a weight row's unit is 4 bytes where it
// lies (its pair, or its value). An accumulator holds one weight row's outputs for the panel's 16 rows (a
// column of C), so per unit one load of x feeds 16 weight rows, each row's unit a 32-bit broadcast folded into
// the multiply-add as its memory operand ({1to16}): no horizontal sums (the row kernels sum 16 lanes per
// output), no reload of x per few weight rows, and each element is one chain over k in order: the bits of the
// prefill GEMM's kernels (mmad_dp_bf16_packed; the fp32 MmadTN). One core, hot weights, bf16, M = 16, SmolLM2's
// gate (576 x 1536) and down (1536 x 576) projections, us, mmad_nt_dp_bf16 -> this: 189-197 -> 137-138 and
// 142-143 -> 134, at M = 64 577-728 -> 519-523 (~90% of vdpbf16ps' peak).
constexpr int kXPanelRows = 16;  // rows of x per panel: one accumulator's lanes
constexpr int kWBlockRows = 16;  // weight rows per block: 16 accumulators, C's columns by one 16 x 16 transpose

// c += x * (the 4-byte unit at w, broadcast): vdpbf16ps (bf16 pairs) or vfmadd231ps (fp32). Natively one
// instruction with the broadcast as its memory operand (inline assembly: the intrinsics' form takes a
// vpbroadcastd per unit, and the asm needs no target attribute, so the block below serves the tables with and
// without AVX512-BF16); on SIMDe the intrinsics.
struct PackedXDpBf16 {
  static constexpr int64_t kUnitValues = 2;  // k values per unit
  static void Acc(V& c, V x, const char* w) {
#if defined(ATB_AVX512_NATIVE)
    asm("vdpbf16ps %1%{1to16%}, %2, %0" : "+v"(c) : "m"(*reinterpret_cast<const int32_t*>(w)), "v"(x));
#else
    int32_t v;
    std::memcpy(&v, w, 4);
    __m512bh a, b;
    const __m512i vi = _mm512_set1_epi32(v), xi = _mm512_castps_si512(x);
    std::memcpy(&a, &vi, sizeof(a));
    std::memcpy(&b, &xi, sizeof(b));
    c = _mm512_dpbf16_ps(c, a, b);
#endif
  }
};
struct PackedXFmaF32 {
  static constexpr int64_t kUnitValues = 1;
  static void Acc(V& c, V x, const char* w) {
#if defined(ATB_AVX512_NATIVE)
    asm("vfmadd231ps %1%{1to16%}, %2, %0" : "+v"(c) : "m"(*reinterpret_cast<const float*>(w)), "v"(x));
#else
    float v;
    std::memcpy(&v, w, 4);
    c = _mm512_fmadd_ps(x, _mm512_set1_ps(v), c);
#endif
  }
};

// A packed-x block's accumulators, one per weight row (C's column) over the panel's rows: C's columns
// transposed in (the chain goes on from C) or zero.
inline void BlockAccIn(__m512i t[16], const float* C, int64_t ldc, int64_t rows, __mmask16 colMask, bool acc) {
  if (!acc) {
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) t[i] = _mm512_setzero_si512();
    return;
  }
  __m512i r[16];
#pragma GCC unroll 16
  for (int m = 0; m < 16; ++m)
    r[m] = m < rows ? _mm512_castps_si512(MaskLoad(colMask, C + m * ldc)) : _mm512_setzero_si512();
  Transpose16x16(r, t);
}
// ... and back out, transposed to C's rows.
inline void BlockAccOut(const V c[16], float* C, int64_t ldc, int64_t rows, __mmask16 colMask) {
  __m512i r[16], t[16];
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) r[i] = _mm512_castps_si512(c[i]);
  Transpose16x16(r, t);
#pragma GCC unroll 16
  for (int m = 0; m < 16; ++m)
    if (m < rows) MaskStore(C + m * ldc, colMask, _mm512_castsi512_ps(t[m]));
}

// C[r][c] (+)= x row r . W row c for r < rows (<= 16, one panel at Xp) and c < cols (<= 16, W rows ldwBytes
// apart; the caller pads a short block, so 16 rows are always there to read), over `units` 4-byte units of k.
// bf16 with an odd K: the last unit is a lone value (loneLast), never read past.
template <class Op>
__attribute__((noinline)) void BlockPackedX(float* C, int64_t ldc, const float* Xp, const char* W, int64_t ldwBytes,
                                            int64_t rows, int64_t cols, int64_t units, bool loneLast, bool acc) {
  const __mmask16 colMask = Tail(cols);
  __m512i t[16];
  BlockAccIn(t, C, ldc, rows, colMask, acc);
  // Sixteen named accumulators: as an array under the inline asm they went to the stack every unit.
  V c0 = _mm512_castsi512_ps(t[0]), c1 = _mm512_castsi512_ps(t[1]), c2 = _mm512_castsi512_ps(t[2]),
    c3 = _mm512_castsi512_ps(t[3]), c4 = _mm512_castsi512_ps(t[4]), c5 = _mm512_castsi512_ps(t[5]),
    c6 = _mm512_castsi512_ps(t[6]), c7 = _mm512_castsi512_ps(t[7]), c8 = _mm512_castsi512_ps(t[8]),
    c9 = _mm512_castsi512_ps(t[9]), c10 = _mm512_castsi512_ps(t[10]), c11 = _mm512_castsi512_ps(t[11]),
    c12 = _mm512_castsi512_ps(t[12]), c13 = _mm512_castsi512_ps(t[13]), c14 = _mm512_castsi512_ps(t[14]),
    c15 = _mm512_castsi512_ps(t[15]);
  // Row i through one of four pointers (rows 0, 5, 8, 13) plus the row stride L or 3L scaled by 1, 2 or 4: one
  // addressing mode per load, where 16 row pointers spilled to the stack.
  const int64_t L = ldwBytes, L3 = 3 * L;
  const char *p0 = W, *p5 = W + 5 * L, *p8 = W + 8 * L, *p13 = W + 13 * L;
  auto unit = [&](V x) {
    Op::Acc(c0, x, p0), Op::Acc(c1, x, p0 + L), Op::Acc(c2, x, p0 + 2 * L), Op::Acc(c3, x, p0 + L3);
    Op::Acc(c4, x, p0 + 4 * L), Op::Acc(c5, x, p5), Op::Acc(c6, x, p0 + 2 * L3), Op::Acc(c7, x, p5 + 2 * L);
    Op::Acc(c8, x, p8), Op::Acc(c9, x, p8 + L), Op::Acc(c10, x, p8 + 2 * L), Op::Acc(c11, x, p8 + L3);
    Op::Acc(c12, x, p8 + 4 * L), Op::Acc(c13, x, p13), Op::Acc(c14, x, p8 + 2 * L3), Op::Acc(c15, x, p13 + 2 * L);
    p0 += 4, p5 += 4, p8 += 4, p13 += 4;
  };
  // The weights stream from DRAM in rows too short for the hardware prefetcher to ramp up (as in
  // mmad_nt_dp_bf16): the next block's rows into L2, one cache line of one row per unit (16 units per line, so
  // each row's next line once per 16 units). Past the tile's last row they are the next tile's rows; a
  // prefetch never faults. Two blocks ahead measured the same (Zen 4, batch-16 decode graph). Zen 4, 2 threads,
  // 30 SmolLM2 MLPs at M = 16 from DRAM (64 MiB written between runs), alternating processes, ms: this
  // 8.9-11.7; none 15.0-17.1; into L1 (prefetcht0) 10.6-12.5; the next block as one front-to-back span 11.3-13.3
  // (rows as 16 interleaved streams are what the loop reads; the span order is not); prefetcht2 and this plus
  // the block after within the spread. With the weights in L3 the same MLPs take 6.9-9.4 ms. A layout with each
  // unit's 16 weight pairs in one line (read as one stream, x broadcast instead) ran slower in a C model of
  // this loop from DRAM: 180 against 283-303 GFLOP/s.
  const char* ahead = W + kWBlockRows * L;
  const int64_t whole = units - (loneLast ? 1 : 0);
  for (int64_t j = 0; j < whole; ++j) {
    _mm_prefetch(ahead + (j & 15) * L + (j & ~int64_t(15)) * 4, _MM_HINT_T1);
    unit(_mm512_loadu_ps(Xp + j * 16));
  }
  V c[16] = {c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15};
  if (loneLast) {  // its partner in x's packing is a zero; the weight's is taken as zero, not read
    const V x = _mm512_loadu_ps(Xp + whole * 16);
#pragma GCC unroll 16
    for (int i = 0; i < kWBlockRows; ++i) {
      uint16_t lone[2] = {0, 0};
      std::memcpy(lone, W + i * L + whole * 4, 2);
      Op::Acc(c[i], x, reinterpret_cast<const char*>(lone));
    }
  }
  BlockAccOut(c, C, ldc, rows, colMask);
}

// The packed-x GEMMs' walk: per panel of x (16 rows, panelFloats apart), every block of 16 of the N weight
// rows in order, block(c, xp, n, rows, cols) for the one at weight row n (cols < 16 only for the last one). Per
// panel of x, every block: the caller's tile of weights (a few dozen rows) stays in L2 for the next panel.
template <class Block>
void ForPackedXBlocks(float* C, int64_t ldc, const float* Xp, int64_t panelFloats, int64_t M, int64_t N,
                      Block&& block) {
  for (int64_t m = 0; m < M; m += kXPanelRows) {
    const int64_t rows = std::min<int64_t>(kXPanelRows, M - m);
    const float* xp = Xp + (m / kXPanelRows) * panelFloats;
    for (int64_t n = 0; n < N; n += kWBlockRows)
      block(C + m * ldc + n, xp, n, rows, std::min<int64_t>(kWBlockRows, N - n));
  }
}

// Every panel of x against every block of W's N rows (elt-byte values, K per row): the packed-x GEMM both
// entries share. A short last block runs on a copy of its rows padded with zero rows (N a multiple of 16 never
// takes it), so the block reads 16 rows at a fixed stride.
template <class Op>
void MmadPackedX(float* C, int64_t ldc, const float* Xp, const char* W, int64_t ldwBytes, int64_t M, int64_t N,
                 int64_t K, int64_t elt, bool acc) {
  const int64_t units = (K + Op::kUnitValues - 1) / Op::kUnitValues;
  const bool loneLast = K % Op::kUnitValues != 0;
  const int64_t panelFloats = 16 * units;
  const int64_t whole = N - N % kWBlockRows;
  thread_local std::vector<char> pad;
  if (whole < N) {
    pad.assign(size_t(kWBlockRows * K * elt), 0);
    for (int64_t n = whole; n < N; ++n) std::memcpy(pad.data() + (n - whole) * K * elt, W + n * ldwBytes, size_t(K * elt));
  }
  ForPackedXBlocks(C, ldc, Xp, panelFloats, M, N,
                   [&](float* c, const float* xp, int64_t n, int64_t rows, int64_t cols) {
    if (cols == kWBlockRows)
      BlockPackedX<Op>(c, ldc, xp, W + n * ldwBytes, ldwBytes, rows, cols, units, loneLast, acc);
    else
      BlockPackedX<Op>(c, ldc, xp, pad.data(), K * elt, rows, cols, units, loneLast, acc);
  });
}

// The packed-x GEMM over a rows4 copy (kernels/linear/linear_rows4.h): the same units, accumulators and chains
// (so the same bits), but a block's 16 weight rows are 4 groups of 4 rows, each group one run in which every
// 64-byte line holds 4 units of its 4 rows (row r's unit j at (j / 4) * 64 + r * 16 + (j % 4) * 4; bf16: a k
// pair, fp32: one k), and a block's groups lie back to back: it streams as 4 runs front to back, where rows as
// they lie are 16 rows' lines at a time. Units past K are the copy's zero padding (bf16 with an odd K: its
// last unit's partner is such a zero, the lone weight's zero in BlockPackedX), but x holds only `units`.
template <class Op>
__attribute__((noinline)) void BlockPackedXRows4(float* C, int64_t ldc, const float* Xp, const char* G,
                                                 int64_t ldgBytes, int64_t rows, int64_t cols, int64_t units) {
  V c0 = _mm512_setzero_ps(), c1 = c0, c2 = c0, c3 = c0, c4 = c0, c5 = c0, c6 = c0, c7 = c0, c8 = c0, c9 = c0,
    c10 = c0, c11 = c0, c12 = c0, c13 = c0, c14 = c0, c15 = c0;
  // Groups 0 and 2 through their own pointers, 1 and 3 at + L: one addressing mode per load.
  const int64_t L = ldgBytes;
  const char *g0 = G, *g2 = G + 2 * L;
  auto unit = [&](V x, int64_t u) {  // unit u of the current line
    Op::Acc(c0, x, g0 + u * 4), Op::Acc(c1, x, g0 + 16 + u * 4), Op::Acc(c2, x, g0 + 32 + u * 4),
        Op::Acc(c3, x, g0 + 48 + u * 4);
    Op::Acc(c4, x, g0 + L + u * 4), Op::Acc(c5, x, g0 + L + 16 + u * 4), Op::Acc(c6, x, g0 + L + 32 + u * 4),
        Op::Acc(c7, x, g0 + L + 48 + u * 4);
    Op::Acc(c8, x, g2 + u * 4), Op::Acc(c9, x, g2 + 16 + u * 4), Op::Acc(c10, x, g2 + 32 + u * 4),
        Op::Acc(c11, x, g2 + 48 + u * 4);
    Op::Acc(c12, x, g2 + L + u * 4), Op::Acc(c13, x, g2 + L + 16 + u * 4), Op::Acc(c14, x, g2 + L + 32 + u * 4),
        Op::Acc(c15, x, g2 + L + 48 + u * 4);
  };
  // The next block (4 L on) into L2 as this one is read: one line of each group per line of this one's.
  const int64_t lines = units / 4;
  for (int64_t j = 0; j < lines; ++j, g0 += 64, g2 += 64) {
    _mm_prefetch(g0 + 4 * L, _MM_HINT_T1);
    _mm_prefetch(g0 + 5 * L, _MM_HINT_T1);
    _mm_prefetch(g2 + 4 * L, _MM_HINT_T1);
    _mm_prefetch(g2 + 5 * L, _MM_HINT_T1);
    const float* x = Xp + j * 64;
    unit(_mm512_loadu_ps(x), 0);
    unit(_mm512_loadu_ps(x + 16), 1);
    unit(_mm512_loadu_ps(x + 32), 2);
    unit(_mm512_loadu_ps(x + 48), 3);
  }
  for (int64_t u = 0; u < units % 4; ++u) unit(_mm512_loadu_ps(Xp + (lines * 4 + u) * 16), u);
  const V c[16] = {c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15};
  BlockAccOut(c, C, ldc, rows, Tail(cols));
}

// MmadPackedX over a rows4 copy: N weight rows from the group at G (ldg elements of elt bytes from one group to
// the next). A short last block reads a copy of its groups followed by zero groups, never past the rows' own.
template <class Op>
void MmadPackedXRows4(float* C, int64_t ldc, const float* Xp, const char* G, int64_t ldg, int64_t M, int64_t N,
                      int64_t K, int64_t elt) {
  const int64_t units = (K + Op::kUnitValues - 1) / Op::kUnitValues;
  const int64_t panelFloats = 16 * units, L = ldg * elt;
  const int64_t whole = N - N % kWBlockRows;
  thread_local std::vector<char> pad;
  if (whole < N) {
    pad.assign(size_t(4 * L), 0);
    std::memcpy(pad.data(), G + whole / 4 * L, size_t((N - whole + 3) / 4 * L));
  }
  ForPackedXBlocks(C, ldc, Xp, panelFloats, M, N,
                   [&](float* c, const float* xp, int64_t n, int64_t rows, int64_t cols) {
    BlockPackedXRows4<Op>(c, ldc, xp, cols == kWBlockRows ? G + n / 4 * L : pad.data(), L, rows, cols, units);
  });
}

void MmadDpBf16PackedXRows4(float* C, int64_t ldc, const uint16_t* Xp, const uint16_t* B4, int64_t ldg, int64_t M,
                            int64_t N, int64_t K) {
  MmadPackedXRows4<PackedXDpBf16>(C, ldc, reinterpret_cast<const float*>(Xp), reinterpret_cast<const char*>(B4),
                                  ldg, M, N, K, 2);
}
void MmadPackedXF32Rows4(float* C, int64_t ldc, const float* Xt, const float* B4, int64_t ldg, int64_t M, int64_t N,
                         int64_t K) {
  MmadPackedXRows4<PackedXFmaF32>(C, ldc, Xt, reinterpret_cast<const char*>(B4), ldg, M, N, K, 4);
}

// mmad_packed_x_f32 (contract: simd.h).
void MmadPackedXF32(float* C, int64_t ldc, const float* Xt, const float* W, int64_t ldw, int64_t M, int64_t N,
                    int64_t K, bool acc) {
  MmadPackedX<PackedXFmaF32>(C, ldc, Xt, reinterpret_cast<const char*>(W), ldw * 4, M, N, K, 4, acc);
}

// ---- bf16 dot-product NT Mmad (AVX512-BF16: prefill GEMM, batch decode) -------
// R (<= 8) rows of A against CN (<= 3) rows of B per block: R*CN accumulators,
// R + CN loads per R*CN vdpbf16ps (32 multiply-adds each), x and the weights
// read where they lie in their storage type. Each element: 16 lanes over k in
// steps of 32, the tail zero-padded, then HSum4's fixed tree (HSum16).
#if defined(ATB_AVX512_NATIVE)
#pragma GCC push_options
#pragma GCC target("avx512bf16")
#endif
inline __m512bh LoadBh(const uint16_t* p) {
  __m512bh v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
// The last n (< 32) values of a row, zero-padded; never reads past them.
inline __m512bh LoadBhTail(const uint16_t* p, int64_t n) {
  alignas(64) uint16_t buf[32] = {0};
  std::memcpy(buf, p, n * sizeof(uint16_t));
  return LoadBh(buf);
}

constexpr int kDpCols = 3;

template <int R, int CN>
void BlockDpBf16(float* C, int64_t ldc, const uint16_t* A, int64_t lda, const uint16_t* B, int64_t ldb, int64_t K,
                 bool acc) {
  constexpr int kOut = R * CN;
  V s[kOut];
#pragma GCC unroll 32
  for (int i = 0; i < kOut; ++i) s[i] = _mm512_setzero_ps();
  auto step = [&](int64_t k, auto load) {
    __m512bh b[CN];
#pragma GCC unroll 4
    for (int c = 0; c < CN; ++c) b[c] = load(B + c * ldb + k);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      __m512bh a = load(A + r * lda + k);
#pragma GCC unroll 4
      for (int c = 0; c < CN; ++c) s[r * CN + c] = _mm512_dpbf16_ps(s[r * CN + c], a, b[c]);
    }
  };
  // Batch decode streams the weights (B) from DRAM in rows too short for the
  // hardware prefetcher to ramp up: fetch the rows four panels ahead, one cache
  // line (32 k) per row per step, into L2 (T1). Into L1 (T0) each request holds
  // one of L1's few miss buffers until DRAM answers, as in the lanes GEMV above:
  // Zen 4, 2 threads, M = 16, cold weights, us per call T0 -> T1 (two panels
  // ahead): 3072x576 434 -> 250, 576x1536 192 -> 114, 960x576 116 -> 77,
  // 49152x576 5114 -> 4231; four panels ahead measured within noise of two.
  // Past the tile's last row they are the next tile's rows; a prefetch never
  // faults.
  const char* ahead = reinterpret_cast<const char*>(B + 4 * kDpCols * ldb);
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
#pragma GCC unroll 4
    for (int c = 0; c < kDpCols; ++c) _mm_prefetch(ahead + (c * ldb + k) * 2, _MM_HINT_T1);
    step(k, [](const uint16_t* p) { return LoadBh(p); });
  }
  if (k < K) {
    int64_t n = K - k;
    step(k, [n](const uint16_t* p) { return LoadBhTail(p, n); });
  }
  StoreLaneSums<R, CN>(C, ldc, s, acc);
}

// Per block of 8 A rows (kept in L1), every panel of kDpCols B rows, then the
// last one or two: 8 of the 11 loads per step hit L1, the B panel's 3 come from
// L2 (the caller's B tile, e.g. 48 weight rows, stays there across the blocks).
// Batch decode (9 to kDpPanelFirstMaxRows rows) turns the loops around: per
// panel, every block of A rows. Block by block, the first block's pass waits on
// DRAM for the weights and the second computes from L2 while DRAM idles; panel
// by panel, the weights stream from DRAM at the pace of both blocks' multiplies
// and the second block reads the panel from L1. Zen 4, 2 threads, SmolLM2's
// projections over 30 layers' weights from DRAM plus its LM head, ms, blocks
// first -> panels first (interleaved runs): M = 12 22.9 -> 16.8, 17.6 -> 15.8;
// M = 16 20.9 -> 19.2, 23.2 -> 19.0, 22.3 -> 21.3. In the engine's decode graph
// (per-node profile, alternating builds): batch 12 MLP 9.8/10.2 -> 8.8/9.7 ms
// per step; batch 16 within noise (10.4 -> 10.3). The same sums either way.
constexpr int64_t kDpPanelFirstMaxRows = 16;

// Panels of kDpCols B rows, then the last one or two.
template <class Panel>
inline void ForDpPanels(int64_t N, Panel&& panel) {
  int64_t n = 0;
  for (; n + kDpCols <= N; n += kDpCols) panel(std::integral_constant<int, kDpCols>{}, n);
  if (N - n == 2) panel(std::integral_constant<int, 2>{}, n);
  if (N - n == 1) panel(std::integral_constant<int, 1>{}, n);
}

void MmadNTDpBf16(float* C, int64_t ldc, const uint16_t* A, int64_t lda, const uint16_t* B, int64_t ldb, int64_t M,
                  int64_t N, int64_t K, bool acc) {
  auto block = [&](auto rows, int64_t m, auto cols, int64_t n) {
    BlockDpBf16<decltype(rows)::value, decltype(cols)::value>(C + m * ldc + n, ldc, A + m * lda, lda, B + n * ldb,
                                                              ldb, K, acc);
  };
  if (M > 8 && M <= kDpPanelFirstMaxRows) {
    ForDpPanels(N, [&](auto cols, int64_t n) {
      ForRowBlocks(M, [&](auto rows, int64_t m) { block(rows, m, cols, n); });
    });
  } else {
    ForRowBlocks(M, [&](auto rows, int64_t m) {
      ForDpPanels(N, [&](auto cols, int64_t n) { block(rows, m, cols, n); });
    });
  }
}

// ---- bf16 dot-product GEMM over k-pair-packed weights (prefill) --------------
// Layout and contract: simd.h (pack_bf16_pairs). Packing is a 16 x 16 transpose of 32-bit pairs: 16 weight
// rows' next 16 pairs (one zmm each) become 16 pair-columns of 16 rows.
constexpr int64_t kPairPanel = 16;  // weight rows per panel (one zmm of fp32 outputs)

inline __m512bh AsBh(__m512i v) {
  __m512bh r;
  std::memcpy(&r, &v, sizeof(r));
  return r;
}


// The k-pair panels of N rows of K values, 32 values of a row at a time: chunk(n, k, kl) gives row n's
// values [k, k + kl) as 32 bf16 words (zero past kl).
template <class Chunk>
void PackPairsOf(uint16_t* dst, int64_t N, int64_t K, Chunk chunk) {
  const int64_t pairs = (K + 1) / 2;
  for (int64_t p = 0; p < N; p += kPairPanel) {
    uint16_t* panel = dst + p * 2 * pairs;
    const int64_t rows = std::min(kPairPanel, N - p);
    for (int64_t k = 0; k < K; k += 32) {  // 16 pairs per step
      const int64_t kl = std::min<int64_t>(32, K - k);
      __m512i r[16], c[16];
      if (rows == 16 && kl == 32) {  // whole chunks of a whole panel: the chunk's tests fold away
#pragma GCC unroll 16
        for (int n = 0; n < 16; ++n) r[n] = chunk(p + n, k, int64_t(32));
      } else {
#pragma GCC unroll 16
        for (int n = 0; n < 16; ++n) r[n] = n < rows ? chunk(p + n, k, kl) : _mm512_setzero_si512();
      }
      Transpose16x16(r, c);
      if (kl == 32) {
#pragma GCC unroll 16
        for (int j = 0; j < 16; ++j) _mm512_storeu_si512(panel + (k / 2 + j) * 32, c[j]);
      } else {
        for (int64_t j = 0; j < (kl + 1) / 2; ++j) _mm512_storeu_si512(panel + (k / 2 + j) * 32, c[j]);
      }
    }
  }
}

inline __mmask32 Tail32(int64_t r) { return r >= 32 ? ~__mmask32(0) : __mmask32((1u << r) - 1u); }

void PackBf16Pairs(uint16_t* dst, const uint16_t* W, int64_t ldw, int64_t N, int64_t K) {
  PackPairsOf(dst, N, K, [&](int64_t n, int64_t k, int64_t kl) {
    return _mm512_maskz_loadu_epi16(Tail32(kl), W + n * ldw + k);
  });
}

// The `bytes` bytes at q, zero-extended to 16 (a row's last chunk: no read past its last value).
inline __m128i LoadBytes(const void* q, int64_t bytes) {
  if (bytes >= 16) return _mm_loadu_si128(static_cast<const __m128i*>(q));
  alignas(16) uint8_t b[16] = {};
  std::memcpy(b, q, size_t(bytes));
  return _mm_load_si128(reinterpret_cast<const __m128i*>(b));
}

// Two fp32 vectors as 32 bf16 words, lo's in the low half: vcvtne2ps2bf16, one instruction (round to nearest
// even; a NaN stays a quiet NaN; denormal inputs read as zero, which the dp products would also do with the
// bf16 denormal torch's cast gives them). The SIMDe build computes the same bits with integer steps.
inline __m512i Bf16PairsOf(V lo, V hi) {
#if defined(ATB_AVX512_NATIVE)
  __m512bh r = _mm512_cvtne2ps_pbh(hi, lo);
  __m512i bits;
  std::memcpy(&bits, &r, sizeof(bits));
  return bits;
#else
  auto daz = [](V v) {  // denormals to zero of their sign
    const __m512i u = _mm512_castps_si512(v), expBits = _mm512_set1_epi32(0x7f800000);
    const __mmask16 denormal = _mm512_cmpeq_epi32_mask(_mm512_and_si512(u, expBits), _mm512_setzero_si512());
    return _mm512_castsi512_ps(_mm512_mask_and_epi32(u, denormal, u, _mm512_set1_epi32(int(0x80000000u))));
  };
  // Each 32-bit lane's low word: lo's lanes, then hi's (index 32 + i is hi's word i).
  const __m512i lowWords = _mm512_setr_epi32(0x20000, 0x60004, 0xA0008, 0xE000C, 0x120010, 0x160014, 0x1A0018,
                                             0x1E001C, 0x220020, 0x260024, 0x2A0028, 0x2E002C, 0x320030, 0x360034,
                                             0x3A0038, 0x3E003C);
  return _mm512_permutex2var_epi16(Bf16Bits(daz(lo)), lowWords, Bf16Bits(daz(hi)));
#endif
}

// Row n's 32-value chunk at k (kl of its values below K, the rest zero) as the 32 bf16 weights it stands for,
// in k order: W4 fma(q, scale, min), W8 q * scale, each in fp32 with one rounding (as dequant_w4 / dequant_w8),
// then to bf16 (Bf16PairsOf). Scales: row n's group g at scale[n * lds + g], the group of k being k >> shift
// (GroupShift: G a power of two, or per channel any G at least K; a 64-bit division per chunk is avoided).
inline int GroupShift(int64_t G, int64_t K) { return G >= K ? 62 : __builtin_ctzll(uint64_t(G)); }
// W4: [low | high] nibbles of the chunk's 16 bytes are values [0..15 | 16..31] (groups of 32 or more).
inline __m512i Q4ChunkBf16(const uint8_t* q, int64_t ldq, int64_t n, int64_t k, int64_t kl, const float* scale,
                           const float* min, int64_t lds, int shift) {
  const __m512i b =
      _mm512_cvtepu16_epi32(_mm256_cvtepu8_epi16(LoadBytes(q + n * ldq + k / 2, std::min<int64_t>(kl, 16))));
  const int64_t g = n * lds + (k >> shift);
  const V s = _mm512_set1_ps(scale[g]), m = _mm512_set1_ps(min[g]);
  auto weights = [&](__m512i v) { return _mm512_fmadd_ps(_mm512_cvtepi32_ps(v), s, m); };
  const __m512i w = Bf16PairsOf(weights(_mm512_and_si512(b, _mm512_set1_epi32(0xF))), weights(_mm512_srli_epi32(b, 4)));
  return _mm512_maskz_mov_epi16(Tail32(kl), w);
}
// W8: int8 values; G = 16 (shift 4) gives the chunk's two halves their own groups.
inline __m512i Q8ChunkBf16(const int8_t* q, int64_t ldq, int64_t n, int64_t k, int64_t kl, const float* scale,
                           int64_t lds, int shift) {
  const int8_t* row = q + n * ldq + k;
  const float* sc = scale + n * lds + (k >> shift);
  const V s0 = _mm512_set1_ps(sc[0]), s1 = shift == 4 ? _mm512_set1_ps(sc[1]) : s0;
  auto weights = [](__m128i b, V s) {
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm256_cvtepi8_epi16(b))), s);
  };
  const V lo = weights(LoadBytes(row, std::min<int64_t>(kl, 16)), s0);
  const V hi = kl > 16 ? weights(LoadBytes(row + 16, kl - 16), s1) : _mm512_setzero_ps();
  return _mm512_maskz_mov_epi16(Tail32(kl), Bf16PairsOf(lo, hi));
}

void PackQ4PairsDequant(uint16_t* dst, const uint8_t* q, int64_t ldq, int64_t N, int64_t K, const float* scale,
                        const float* min, int64_t lds, int64_t G) {
  const int shift = GroupShift(G, K);
  PackPairsOf(dst, N, K, [&](int64_t n, int64_t k, int64_t kl) {
    return Q4ChunkBf16(q, ldq, n, k, kl, scale, min, lds, shift);
  });
}
void PackQ8PairsDequant(uint16_t* dst, const int8_t* q, int64_t ldq, int64_t N, int64_t K, const float* scale,
                        int64_t lds, int64_t G) {
  const int shift = GroupShift(G, K);
  PackPairsOf(dst, N, K, [&](int64_t n, int64_t k, int64_t kl) {
    return Q8ChunkBf16(q, ldq, n, k, kl, scale, lds, shift);
  });
}

// acc[r][v] += the K values of A's R rows (lda apart) against NV panels (panelStride apart), pair by pair; an
// odd K's last pair is half (its second value is not read: the packing's zero takes its place). A's rows as
// they lie: pair j of row r is at A + r * lda + 2 * j.
template <int R, int NV>
inline void DpPairs(V (&acc)[R][NV], const uint16_t* A, int64_t lda, const uint16_t* Bp, int64_t panelStride,
                    int64_t K) {
  auto step = [&](int64_t j, auto pairOf) {
    __m512bh b[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) b[v] = LoadBh(Bp + v * panelStride + j * 32);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      __m512bh a = AsBh(_mm512_set1_epi32(pairOf(A + r * lda + 2 * j)));
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], a, b[v]);
    }
  };
  for (int64_t j = 0; j < K / 2; ++j) step(j, [](const uint16_t* p) {
      int32_t v;
      std::memcpy(&v, p, 4);
      return v;
    });
  if (K % 2) step(K / 2, [](const uint16_t* p) { return int32_t(*p); });
}

// The R x NV accumulators of a packed-dp tile: C's rows (ldc apart), 16 columns per panel, the last panel's
// columns masked by `last`; from zero unless accumulating.
template <int R, int NV>
struct PanelAcc {
  static __mmask16 Mask(int v, __mmask16 last) { return v == NV - 1 ? last : __mmask16(0xffff); }
  static void Load(V (&c)[R][NV], const float* C, int64_t ldc, bool acc, __mmask16 last) {
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) c[r][v] = acc ? MaskLoad(Mask(v, last), C + r * ldc + 16 * v) : _mm512_setzero_ps();
  }
  static void Store(V (&c)[R][NV], float* C, int64_t ldc, __mmask16 last) {
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) MaskStore(C + r * ldc + 16 * v, Mask(v, last), c[r][v]);
  }
};

// R rows of C by NV panels (16 * NV columns, the last panel's stores masked by `last`), over `pairs` k pairs
// of which the last is half (odd K: its second value is not read, the packing's zero takes its place).
template <int R, int NV>
__attribute__((noinline)) void TileDpPacked(float* C, int64_t ldc, const uint16_t* A, int64_t lda,
                                            const uint16_t* Bp, int64_t panelStride, int64_t K, bool acc,
                                            __mmask16 last) {
  V c[R][NV];
  PanelAcc<R, NV>::Load(c, C, ldc, acc, last);
  DpPairs<R, NV>(c, A, lda, Bp, panelStride, K);
  PanelAcc<R, NV>::Store(c, C, ldc, last);
}

// 6 rows x 4 panels: 24 accumulators + 4 weight vectors + 1 broadcast of the 32 zmm registers; 10 loads per
// 24 vdpbf16ps. Per group of 4 panels (64 weight rows, in L2 since the caller packed them), every 6 rows.
constexpr int kDpTileRows = 6, kDpTilePanels = 4;

template <int NV>
void RowsDpPacked(float* C, int64_t ldc, const uint16_t* A, int64_t lda, const uint16_t* Bp,
                  int64_t panelStride, int64_t M, int64_t K, bool acc, __mmask16 last) {
  ForRowTiles<kDpTileRows>(M, [&](auto rows, int64_t m) {
    TileDpPacked<decltype(rows)::value, NV>(C + m * ldc, ldc, A + m * lda, lda, Bp, panelStride, K, acc, last);
  });
}

void MmadDpBf16Packed(float* C, int64_t ldc, const uint16_t* A, int64_t lda, const uint16_t* Bp, int64_t M,
                      int64_t N, int64_t K, bool acc) {
  // All of K per tile: the group's packed rows (64 x K) stream from L2. Chunks of 128 k kept in L1 measured
  // slower (Zen 4, one core, 48 x 64 x 1536: 199 against 228 GFLOP/s): the accumulators' trips through C
  // cost more than L2 reads, which the hardware prefetcher keeps ahead.
  const int64_t stride = 32 * ((K + 1) / 2);  // one panel
  int64_t n = 0;
  for (; n + kDpTilePanels * kPairPanel <= N; n += kDpTilePanels * kPairPanel)
    RowsDpPacked<kDpTilePanels>(C + n, ldc, A, lda, Bp + (n / kPairPanel) * stride, stride, M, K, acc, 0xffff);
  const int64_t left = N - n;
  if (left == 0) return;
  const __mmask16 last = Tail((left - 1) % kPairPanel + 1);  // 1 to 63 columns left: 1 to 4 panels
  const uint16_t* b = Bp + (n / kPairPanel) * stride;
  switch ((left + kPairPanel - 1) / kPairPanel) {
    case 4: return RowsDpPacked<4>(C + n, ldc, A, lda, b, stride, M, K, acc, last);
    case 3: return RowsDpPacked<3>(C + n, ldc, A, lda, b, stride, M, K, acc, last);
    case 2: return RowsDpPacked<2>(C + n, ldc, A, lda, b, stride, M, K, acc, last);
    default: return RowsDpPacked<1>(C + n, ldc, A, lda, b, stride, M, K, acc, last);
  }
}

void MmadDpBf16PackedX(float* C, int64_t ldc, const uint16_t* Xp, const uint16_t* W, int64_t ldw, int64_t M,
                       int64_t N, int64_t K, bool acc) {
  MmadPackedX<PackedXDpBf16>(C, ldc, reinterpret_cast<const float*>(Xp), reinterpret_cast<const char*>(W), ldw * 2,
                             M, N, K, 2, acc);
}

// 2^t for exp_pack_pairs_bf16, t <= 128: n = t rounded to nearest even by the 1.5 * 2^23 shifter (add, then
// sub: n's bits are then j's low mantissa bits, so 2^n is one integer add and shift away), f = t - n in
// [-1/2, 1/2], 2^f by kExp2Deg5. t is clamped at -127, where 2^n is the zero bit pattern: a masked score
// (-inf) gives exactly 0, as does a NaN (vmaxps returns its second operand). 12 vector ops against
// ExpNonPositive16's 15: this loop sets the pace of the bf16 softmax.
inline V Exp2Flash16(V t) {
  const V shifter = _mm512_set1_ps(12582912.0f);  // 1.5 * 2^23, bits 0x4B400000
  t = _mm512_max_ps(t, _mm512_set1_ps(-127.0f));
  const V j = _mm512_add_ps(t, shifter);
  const V n = _mm512_sub_ps(j, shifter);
  const V p = Horner(_mm512_sub_ps(t, n), kExp2Deg5, Fma16, Set16);
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_castps_si512(j), _mm512_set1_epi32(127 - 0x4B400000)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

// exp_pack_pairs_bf16 (contract: simd.h): per 16-column panel, per pair of S rows, both rows' P in fp32 (one
// fma, then Exp2Flash16), summed in row order, then rounded to bf16 together (Bf16PairsOf: vcvtne2ps2bf16) and
// interleaved into the panel's pairs: one 64-byte store per pair and panel, and the fp32 P tile never goes
// back to memory. Bf16PairsOf reads denormals as zero, as the tiles and vdpbf16ps read bf16 ones, so P . V
// sees the same products as with P rounded by f32_to_bf16. (vscalefps for the power of two measured 25%
// slower on the AMX Xeon: its underflow of masked scores to zero goes through denormal results.)
// NP panels from column p0 at once: each panel's sum is its own chain of adds (in k order), so NP chains
// overlap their latency; the NP = 4 form runs whole panels only, so it needs no column masks.
template <int NP>
inline void ExpPackPanels(uint16_t* dst, float* sum, const float* S, int64_t ld, const float* b, V sc, int64_t K,
                          int64_t N, int64_t p0, __m512i interleave) {
  const int64_t pairs = (K + 1) / 2, whole = K / 2;
  __mmask16 cols[NP];
  V bc[NP], acc[NP];
#pragma GCC unroll 4
  for (int i = 0; i < NP; ++i) {
    cols[i] = Tail(std::min(kPairPanel, N - p0 - i * kPairPanel));
    bc[i] = MaskLoad(cols[i], b + p0 + i * kPairPanel);
    acc[i] = MaskLoad(cols[i], sum + p0 + i * kPairPanel);
  }
  auto P = [&](int i, int64_t k) {
    const float* s = S + k * ld + p0 + i * kPairPanel;
    if constexpr (NP > 1) return Exp2Flash16(_mm512_fmadd_ps(_mm512_loadu_ps(s), sc, bc[i]));
    // zero past N, as the panel's columns there must be
    return _mm512_maskz_mov_ps(cols[i], Exp2Flash16(_mm512_fmadd_ps(MaskLoad(cols[i], s), sc, bc[i])));
  };
  auto store = [&](int i, int64_t j, V lo, V hi) {
    _mm512_storeu_si512(dst + (p0 + i * kPairPanel) * 2 * pairs + j * 32,
                        _mm512_permutexvar_epi16(interleave, Bf16PairsOf(lo, hi)));
  };
  for (int64_t j = 0; j < whole; ++j) {
#pragma GCC unroll 4
    for (int i = 0; i < NP; ++i) {
      const V lo = P(i, 2 * j), hi = P(i, 2 * j + 1);
      acc[i] = _mm512_add_ps(_mm512_add_ps(acc[i], lo), hi);
      store(i, j, lo, hi);
    }
  }
#pragma GCC unroll 4
  for (int i = 0; i < NP; ++i) {
    if (K % 2) {
      const V lo = P(i, K - 1);
      acc[i] = _mm512_add_ps(acc[i], lo);
      store(i, whole, lo, _mm512_setzero_ps());
    }
    MaskStore(sum + p0 + i * kPairPanel, cols[i], acc[i]);
  }
}

void ExpPackPairsBf16(uint16_t* dst, float* sum, const float* S, int64_t ld, const float* b, float scale, int64_t K,
                      int64_t N) {
  // Bf16PairsOf's [lo 0..15 | hi 0..15] words to pairs (lo i, hi i).
  alignas(64) static constexpr uint16_t kPairOrder[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,  21, 6,  22, 7,  23,
                                                          8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i interleave = _mm512_load_si512(kPairOrder);
  const V sc = _mm512_set1_ps(scale);
  int64_t p = 0;
  for (; p + 4 * kPairPanel <= N; p += 4 * kPairPanel) ExpPackPanels<4>(dst, sum, S, ld, b, sc, K, N, p, interleave);
  for (; p < N; p += kPairPanel) ExpPackPanels<1>(dst, sum, S, ld, b, sc, K, N, p, interleave);
}

void MulCols(float* C, int64_t ldc, const float* v, int64_t M, int64_t N) {
  for (int64_t j = 0; j < N; j += 16) {
    const __mmask16 cols = Tail(std::min<int64_t>(16, N - j));
    const V s = MaskLoad(cols, v + j);
    if ((_mm512_cmp_ps_mask(s, _mm512_set1_ps(1.0f), _CMP_NEQ_UQ) & cols) == 0) continue;
    for (int64_t i = 0; i < M; ++i) MaskStore(C + i * ldc + j, cols, _mm512_mul_ps(MaskLoad(cols, C + i * ldc + j), s));
  }
}

// The low words of a vector's 16 32-bit lanes, as 16 words.
inline __m256i LowWordsOfLanes(__m512i v) {
  alignas(64) static constexpr uint16_t kLowWords[32] = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30,
                                                         0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
  return _mm512_castsi512_si256(_mm512_permutexvar_epi16(_mm512_load_si512(kLowWords), v));
}

// r[i] = row(i) for the block's first `rows` rows, zeros below them (a transposed block's tail).
template <class Row>
inline void LoadBlockRows(__m512i* r, int64_t rows, Row row) {
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) r[i] = i < rows ? row(i) : _mm512_setzero_si512();
}

// A walk over the 16 x 16 blocks of an N x K region (n0, k0; nl, kl of them inside), each transposed as 16 x 16
// 32-bit lanes in registers: load(r, n0, k0, nl, kl) fills r, store(c, n0, k0, nl, kl) takes the transpose.
template <class Load, class Store>
inline void ForTransposedBlocks(int64_t N, int64_t K, Load load, Store store) {
  for (int64_t n0 = 0; n0 < N; n0 += 16) {
    const int64_t nl = std::min<int64_t>(16, N - n0);
    for (int64_t k0 = 0; k0 < K; k0 += 16) {
      const int64_t kl = std::min<int64_t>(16, K - k0);
      __m512i r[16], c[16];
      load(r, n0, k0, nl, kl);
      Transpose16x16(r, c);
      store(c, n0, k0, nl, kl);
    }
  }
}

// store_t_scaled_bf16 (contract: simd.h): 16 x 16 blocks of A transposed in registers, each resulting row
// scaled by its v and rounded to bf16 (Bf16Bits: f32_to_bf16's bits), stored at its own row address.
void StoreTScaledBf16(uint16_t* dst, int64_t ldd, int64_t group, int64_t ldg, const float* A, int64_t lda,
                      const float* v, int64_t N, int64_t K) {
  ForTransposedBlocks(
      N, K,
      [&](__m512i* r, int64_t n0, int64_t k0, int64_t nl, int64_t kl) {
        const __mmask16 cols = Tail(nl);
        LoadBlockRows(r, kl, [&](int i) { return _mm512_castps_si512(MaskLoad(cols, A + (k0 + i) * lda + n0)); });
      },
      [&](const __m512i* c, int64_t n0, int64_t k0, int64_t nl, int64_t kl) {
        for (int64_t j = 0; j < nl; ++j) {
          const int64_t n = n0 + j;
          const V row = _mm512_mul_ps(_mm512_castsi512_ps(c[j]), _mm512_set1_ps(v[n]));
          MaskStoreWords(dst + (n / group) * ldg + (n % group) * ldd + k0, Tail(kl), LowWordsOfLanes(Bf16Bits(row)));
        }
      });
}

// transpose_b16: 16 x 16 blocks widened to 32-bit lanes, transposed as such, narrowed back; tails masked on
// both sides (no read or write past N or K).
void TransposeB16(uint16_t* dst, int64_t ldd, const uint16_t* src, int64_t lds, int64_t N, int64_t K) {
  ForTransposedBlocks(
      N, K,
      [&](__m512i* r, int64_t n0, int64_t k0, int64_t nl, int64_t kl) {
        const __mmask16 cols = Tail(kl);
        LoadBlockRows(r, nl, [&](int i) {
          return _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(cols, src + (n0 + i) * lds + k0));
        });
      },
      [&](const __m512i* c, int64_t n0, int64_t k0, int64_t nl, int64_t kl) {
        const __mmask16 cols = Tail(nl);
        auto store = [&](int64_t j) { MaskStoreWords(dst + (k0 + j) * ldd + n0, cols, LowWordsOfLanes(c[j])); };
        if (kl == 16) {
#pragma GCC unroll 16
          for (int j = 0; j < 16; ++j) store(j);
        } else {
          for (int64_t j = 0; j < kl; ++j) store(j);
        }
      });
}

#if defined(ATB_AVX512_NATIVE)
#pragma GCC pop_options
#endif

#include "simd_amx.h"  // MmadAmxBf16Packed
#include "simd_read_sum.h"  // ReadSumRuns

struct Line512 {
  using V = __m512i;
  static V Zero() { return _mm512_setzero_si512(); }
  static V Add(V a, V b) { return _mm512_add_epi64(a, b); }
  static V Load(const uint64_t* p) { return _mm512_loadu_si512(p); }
  static uint64_t Sum(V v) {
    alignas(64) uint64_t lanes[8];
    _mm512_store_si512(lanes, v);
    uint64_t sum = 0;
    for (uint64_t x : lanes) sum += x;
    return sum;
  }
};

const SimdOps ATB_AVX512_TABLE = {
    ATB_AVX512_NAME, Add, Sub, Mul, Max, Muls, Adds, Axpy, Exp, Silu, SiluMul, Duplicate,
    ReduceSum, ReduceMax, SumSquares, Dot, F16ToF32, Bf16ToF32, F32ToF16, F32ToBf16,
    MmadNT<float, Load16, Load16>, MmadNT<uint16_t, Load16H, Load16H>, MmadNT<uint16_t, Load16B, Load16B>,
    MmadNN<float, Load16>, MmadNN<uint16_t, Load16H>, MmadNN<uint16_t, Load16B>,
    Rope<F32T>, Rope<F16T>, Rope<Bf16T>, SiluMulT<F16T>, SiluMulT<Bf16T>,
    SwigluOut<F16T>, SwigluOut<Bf16T>, ResidualOut<F16T>, ResidualOut<Bf16T>, RmsScaleOut<F16T>, RmsScaleOut<Bf16T>,
    MmadNTLanes<float, LanesF>, MmadNTLanes<uint16_t, LanesH>, MmadNTLanes<uint16_t, LanesB>,
    MmadNTRows<float, Load16, Load16>, MmadNTRows<uint16_t, Load16H, Load16H>, MmadNTRows<uint16_t, Load16B, Load16B>,
    MmadNNRows<float, Load16>, MmadNNRows<uint16_t, Load16H>, MmadNNRows<uint16_t, Load16B>,
    MmadTN, ColMax, ExpSubAcc, SumLanes8,
    TransposeWiden<float, Widen8, Load1>, TransposeWiden<uint16_t, Widen8H, Load1H>,
    TransposeWiden<uint16_t, Widen8B, Load1B>, ReadSumRuns<Line512>,
    /*mmad_nt_dp_bf16=*/nullptr, /*pack_bf16_pairs=*/nullptr, /*mmad_dp_bf16_packed=*/nullptr,
    /*pack_q4_pairs_dequant=*/nullptr, /*pack_q8_pairs_dequant=*/nullptr,
    /*transpose_b16=*/nullptr,
    /*prefetch_to_l2=*/true,
};

// The AVX-512 table: the positional entries and those set by name.
const SimdOps* Base() {
  static const SimdOps table = [] {
    SimdOps t = ATB_AVX512_TABLE;
    t.mmad_packed_x_f32 = MmadPackedXF32;
    t.mmad_packed_x_rows4_f32 = MmadPackedXF32Rows4;
    t.mmad_nt_lanes_rows4_f32 = MmadNTLanesRows4<float, Rows4LoadF>;
    t.mmad_nt_lanes_rows4_bf16 = MmadNTLanesRows4<uint16_t, Rows4LoadB>;
    return t;
  }();
  return &table;
}

// The table with the AVX512-BF16 entries (SIMDe implements them on any CPU).
const SimdOps* WithBf16() {
  static const SimdOps table = [] {
    SimdOps t = *Base();
    t.mmad_nt_dp_bf16 = MmadNTDpBf16;
    t.pack_bf16_pairs = PackBf16Pairs;
    t.mmad_dp_bf16_packed = MmadDpBf16Packed;
    t.pack_q4_pairs_dequant = PackQ4PairsDequant;
    t.pack_q8_pairs_dequant = PackQ8PairsDequant;
    t.transpose_b16 = TransposeB16;
    t.exp_pack_pairs_bf16 = ExpPackPairsBf16;
    t.store_t_scaled_bf16 = StoreTScaledBf16;
    t.mul_cols = MulCols;
    t.mmad_dp_bf16_packed_x = MmadDpBf16PackedX;
    t.mmad_dp_bf16_packed_x_rows4 = MmadDpBf16PackedXRows4;
    return t;
  }();
  return &table;
}

// The AVX512-BF16 table with the bf16 prefill GEMM on AMX tiles (SIMDe build: on the tiles' emulation).
const SimdOps* WithAmx() {
  static const SimdOps table = [] {
    SimdOps t = *WithBf16();
    t.isa = ATB_AVX512_AMX_NAME;
    t.mmad_dp_bf16_packed = MmadAmxBf16Packed;
    t.mmad_dp_bf16_packed_x = MmadAmxBf16PackedX;
    t.mmad_dp_bf16_packed_x_rows4 = nullptr;  // the tiles read weight rows as they lie
    t.amx_tiles = true;
    return t;
  }();
  return &table;
}

}  // namespace

#if defined(ATB_AVX512_NATIVE)
const SimdOps* Avx512SimdOps() { return Base(); }
const SimdOps* Avx512Bf16SimdOps() { return WithBf16(); }
const SimdOps* Avx512AmxSimdOps() { return WithAmx(); }
#else
const SimdOps* Avx512SimdeSimdOps() { return WithBf16(); }
const SimdOps* Avx512AmxSimdeSimdOps() { return WithAmx(); }
#endif

}  // namespace AscendC
#pragma GCC diagnostic pop

#if defined(ATB_AVX512_NATIVE)
#pragma GCC diagnostic pop
#pragma GCC pop_options
#endif

#else  // not x86-64: no native AVX-512 table
namespace AscendC {
const SimdOps* Avx512SimdOps() { return nullptr; }
const SimdOps* Avx512Bf16SimdOps() { return nullptr; }
const SimdOps* Avx512AmxSimdOps() { return nullptr; }
}  // namespace AscendC
#endif
