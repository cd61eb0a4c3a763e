// AVX2 + FMA + F16C table. Compiled with those target features for this file
// only (pragma below, after every system header, and everything here lives in
// an anonymous namespace), so the rest of the build stays baseline x86-64 and
// the table is only selected when CPUID reports the features.
#include <algorithm>
#include <type_traits>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "block_prefetch.h"
#include "dtype.h"
#include "simd.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

namespace AscendC {
namespace {

inline float HSum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
  return _mm_cvtss_f32(lo);
}
inline float HMax(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_max_ps(lo, hi);
  lo = _mm_max_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_max_ss(lo, _mm_movehdup_ps(lo));
  return _mm_cvtss_f32(lo);
}

#include "simd_exp_poly.h"  // kExpCephesP, kExp2Deg6, Horner
constexpr auto Fma8 = [](__m256 a, __m256 b, __m256 c) { return _mm256_fmadd_ps(a, b, c); };
constexpr auto Set8 = [](float v) { return _mm256_set1_ps(v); };

// exp with Cephes' range reduction and degree-5 polynomial: ~2 ulp on
// [-87.3, 88.7]; below that the result flushes to 0 (so exp(-inf) == 0).
inline __m256 Exp8(__m256 x) {
  const __m256 hiLim = _mm256_set1_ps(88.3762626647949f), loLim = _mm256_set1_ps(-87.3365447505531f);
  __m256 under = _mm256_cmp_ps(x, loLim, _CMP_LT_OQ);
  x = _mm256_min_ps(_mm256_max_ps(x, loLim), hiLim);
  __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = Horner(x, kExpCephesP, Fma8, Set8);
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
  y = _mm256_mul_ps(y, _mm256_castsi256_ps(e));
  return _mm256_andnot_ps(under, y);
}
// exp(x) for x <= 0, the softmax's case: t = max(x log2(e), -127) splits exactly into n = round(t) and
// f = t - n in [-1/2, 1/2]; 2^f by a degree-6 polynomial (1.7 ulp), 2^n through the exponent field, which
// is 0 (so the result is 0) for t < -126.5. NaN and -inf give 0 (max returns its bound). Half the work of
// Exp8, whose range reduction, clamps and underflow mask serve any x.
inline __m256 ExpNonPositive8(__m256 x) {
  __m256 t = _mm256_max_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), _mm256_set1_ps(-127.0f));
  __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 f = _mm256_sub_ps(t, n);
  __m256 p = Horner(f, kExp2Deg6, Fma8, Set8);
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
inline __m256 Silu8(__m256 x) {
  __m256 e = Exp8(_mm256_sub_ps(_mm256_setzero_ps(), x));
  // Exp8 clamps exp(+inf) to a finite value, so silu(-inf) would be -inf; torch
  // gives -inf * sigmoid(-inf) = -inf * 0 = NaN. OR-ing all-ones makes it NaN.
  __m256 negInf = _mm256_cmp_ps(x, _mm256_set1_ps(-INFINITY), _CMP_EQ_OQ);
  return _mm256_or_ps(_mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0f), e)), negInf);
}
// Elementwise ops: vector body, and the tail (n % 8) through the same vector op
// on a zero-padded copy, so every element's result is the same whatever its
// position in the call (a scalar tail rounded differently for silu and axpy,
// which made results depend on how a kernel tiled its rows).
template <typename V>
inline void Map2(float* d, const float* a, const float* b, int64_t n, V vop) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(d + i, vop(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i)));
  if (i < n) {
    alignas(32) float x[8] = {0}, y[8] = {0};
    for (int64_t j = i; j < n; ++j) x[j - i] = a[j], y[j - i] = b[j];
    _mm256_store_ps(x, vop(_mm256_load_ps(x), _mm256_load_ps(y)));
    for (int64_t j = i; j < n; ++j) d[j] = x[j - i];
  }
}
template <typename V>
inline void Map1(float* d, const float* a, int64_t n, V vop) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(d + i, vop(_mm256_loadu_ps(a + i)));
  if (i < n) {
    alignas(32) float x[8] = {0};
    for (int64_t j = i; j < n; ++j) x[j - i] = a[j];
    _mm256_store_ps(x, vop(_mm256_load_ps(x)));
    for (int64_t j = i; j < n; ++j) d[j] = x[j - i];
  }
}

void Add(float* d, const float* a, const float* b, int64_t n) {
  Map2(d, a, b, n, [](__m256 x, __m256 y) { return _mm256_add_ps(x, y); });
}
void Sub(float* d, const float* a, const float* b, int64_t n) {
  Map2(d, a, b, n, [](__m256 x, __m256 y) { return _mm256_sub_ps(x, y); });
}
void Mul(float* d, const float* a, const float* b, int64_t n) {
  Map2(d, a, b, n, [](__m256 x, __m256 y) { return _mm256_mul_ps(x, y); });
}
void Max(float* d, const float* a, const float* b, int64_t n) {
  Map2(d, a, b, n, [](__m256 x, __m256 y) { return _mm256_max_ps(y, x); });
}
void Muls(float* d, const float* a, float s, int64_t n) {
  __m256 v = _mm256_set1_ps(s);
  Map1(d, a, n, [&](__m256 x) { return _mm256_mul_ps(x, v); });
}
void Adds(float* d, const float* a, float s, int64_t n) {
  __m256 v = _mm256_set1_ps(s);
  Map1(d, a, n, [&](__m256 x) { return _mm256_add_ps(x, v); });
}
void Axpy(float* d, const float* a, float s, int64_t n) {
  __m256 v = _mm256_set1_ps(s);
  Map2(d, a, d, n, [&](__m256 x, __m256 y) { return _mm256_fmadd_ps(x, v, y); });
}
void Exp(float* d, const float* a, int64_t n) { Map1(d, a, n, Exp8); }
void Silu(float* d, const float* a, int64_t n) { Map1(d, a, n, Silu8); }
void SiluMul(float* d, const float* g, const float* u, int64_t n) {
  Map2(d, g, u, n, [](__m256 x, __m256 y) { return _mm256_mul_ps(Silu8(x), y); });
}
void Duplicate(float* d, float v, int64_t n) {
  __m256 x = _mm256_set1_ps(v);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(d + i, x);
  for (; i < n; ++i) d[i] = v;
}

// Reductions keep 8 lanes, combined as the portable table does.
float ReduceSum(const float* a, int64_t n) {
  __m256 s = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) s = _mm256_add_ps(s, _mm256_loadu_ps(a + i));
  float r = HSum(s);
  for (; i < n; ++i) r += a[i];
  return r;
}
float SumSquares(const float* a, int64_t n) {
  __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m256 x = _mm256_loadu_ps(a + i), y = _mm256_loadu_ps(a + i + 8);
    s0 = _mm256_fmadd_ps(x, x, s0);
    s1 = _mm256_fmadd_ps(y, y, s1);
  }
  for (; i + 8 <= n; i += 8) {
    __m256 x = _mm256_loadu_ps(a + i);
    s0 = _mm256_fmadd_ps(x, x, s0);
  }
  float r = HSum(_mm256_add_ps(s0, s1));
  for (; i < n; ++i) r += a[i] * a[i];
  return r;
}
float Dot(const float* a, const float* b, int64_t n) {
  __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
    s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
  }
  for (; i + 8 <= n; i += 8) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
  float r = HSum(_mm256_add_ps(s0, s1));
  for (; i < n; ++i) r += a[i] * b[i];
  return r;
}
float ReduceMax(const float* a, int64_t n) {
  __m256 m = _mm256_set1_ps(-INFINITY);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(a + i));
  float r = HMax(m);
  for (; i < n; ++i) r = a[i] > r ? a[i] : r;
  return r;
}

// Storage loads: 8 elements -> fp32 lanes.
inline __m256 Load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 Load8H(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline __m256 Load8B(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
inline float Load1(const float* p) { return *p; }
inline float Load1H(const uint16_t* p) { return ToFloat(half{*p}); }
inline float Load1B(const uint16_t* p) { return BitsToFloat(uint32_t(*p) << 16); }

inline __m128i Bf16Round8(__m256 x) {
  __m256i u = _mm256_castps_si256(x);
  __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
  __m256i absu = _mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff));
  __m256i isnan = _mm256_cmpgt_epi32(absu, _mm256_set1_epi32(0x7f800000));
  __m256i qnan = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
  r = _mm256_blendv_epi8(r, qnan, isnan);
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

void F16ToF32(float* d, const uint16_t* s, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(d + i, Load8H(s + i));
  for (; i < n; ++i) d[i] = Load1H(s + i);
}
void Bf16ToF32(float* d, const uint16_t* s, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(d + i, Load8B(s + i));
  for (; i < n; ++i) d[i] = Load1B(s + i);
}
void F32ToF16(uint16_t* d, const float* s, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(d + i), _mm256_cvtps_ph(_mm256_loadu_ps(s + i), _MM_FROUND_TO_NEAREST_INT));
  for (; i < n; ++i) d[i] = FromFloat<half>(s[i]).bits;
}
void F32ToBf16(uint16_t* d, const float* s, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm_storeu_si128(reinterpret_cast<__m128i*>(d + i), Bf16Round8(_mm256_loadu_ps(s + i)));
  for (; i < n; ++i) d[i] = FromFloat<bfloat16_t>(s[i]).bits;
}

// R rows of A against CN rows of B: R*CN accumulators, B loaded once per k-step
// for all R rows (the register-blocked cube tile).
template <typename TB, __m256 (*L8)(const TB*), float (*L1)(const TB*), int R, int CN>
inline void BlockNT(float* C, int64_t ldc, const float* A, int64_t lda, const TB* B, int64_t ldb, int64_t K, bool acc) {
  __m256 s[R][CN];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < CN; ++c) s[r][c] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    __m256 b[CN];
    for (int c = 0; c < CN; ++c) b[c] = L8(B + c * ldb + k);
    for (int r = 0; r < R; ++r) {
      __m256 a = _mm256_loadu_ps(A + r * lda + k);
      for (int c = 0; c < CN; ++c) s[r][c] = _mm256_fmadd_ps(a, b[c], s[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < CN; ++c) {
      float v = HSum(s[r][c]);
      for (int64_t kk = k; kk < K; ++kk) v += A[r * lda + kk] * L1(B + c * ldb + kk);
      float* out = C + r * ldc + c;
      *out = acc ? *out + v : v;
    }
}

template <typename TB, __m256 (*L8)(const TB*), float (*L1)(const TB*)>
void MmadNT(float* C, int64_t ldc, const float* A, int64_t lda, const TB* B, int64_t ldb, int64_t M, int64_t N,
            int64_t K, bool acc) {
  int64_t n = 0;
  for (; n + 4 <= N; n += 4) {
    int64_t m = 0;
    for (; m + 2 <= M; m += 2) BlockNT<TB, L8, L1, 2, 4>(C + m * ldc + n, ldc, A + m * lda, lda, B + n * ldb, ldb, K, acc);
    for (; m < M; ++m) BlockNT<TB, L8, L1, 1, 4>(C + m * ldc + n, ldc, A + m * lda, lda, B + n * ldb, ldb, K, acc);
  }
  for (; n < N; ++n)
    for (int64_t m = 0; m < M; ++m) BlockNT<TB, L8, L1, 1, 1>(C + m * ldc + n, ldc, A + m * lda, lda, B + n * ldb, ldb, K, acc);
}

// Register-blocked cube tile for C (+)= A x B with B rows N-contiguous: R rows
// of C by 8*NV columns live in R*NV accumulators; per k-step B is loaded once
// (NV vectors) for all R rows and each A element is one broadcast. 6 x 16 uses
// 12 accumulators + 2 B + 1 broadcast = 15 of the 16 ymm registers and needs
// 8 loads per 12 FMAs, so the FMA ports, not the loads, set the pace.
// TA selects A's layout: A[m][k] at A + m*lda + k (NN) or A + k*lda + m (TN).
// Every element of C is the same fma chain over k in order whatever block it
// falls in, so results never depend on M, N or the blocking.
// Not inlined: inside the panel loops GCC ran out of registers for this loop
// and kept its counter and two row pointers on the stack, a store-to-load chain
// per k-step that held the tile to ~45% of the FMA ports (fp32 GEMM M=128:
// 70-85 -> 85-130 GFLOP/s, bf16 72-78 -> 90-120).
template <typename TB, __m256 (*L8)(const TB*), bool TA, int R, int NV>
__attribute__((noinline)) void TileNN(float* C, int64_t ldc, const float* A, int64_t lda, const TB* B, int64_t ldb, int64_t K,
                                         bool acc) {
  static_assert(R >= 1 && R <= 6 && (NV == 1 || NV == 2), "TileNN: up to 6 rows x 2 vectors");
  // Named accumulators, not an array: GCC keeps an array's elements in memory
  // and stores all 12 every k-step, which halves the kernel's speed.
  const __m256 z = _mm256_setzero_ps();
  __m256 c00 = z, c01 = z, c10 = z, c11 = z, c20 = z, c21 = z, c30 = z, c31 = z, c40 = z, c41 = z, c50 = z, c51 = z;
#define ATB_TILE_ROWS(X) X(0) X(1) X(2) X(3) X(4) X(5)
#define ATB_TILE_LOAD(r)                                                   \
  if constexpr (R > r) {                                                   \
    if (acc) {                                                             \
      c##r##0 = _mm256_loadu_ps(C + r * ldc);                              \
      if constexpr (NV > 1) c##r##1 = _mm256_loadu_ps(C + r * ldc + 8);    \
    }                                                                      \
  }
#define ATB_TILE_FMA(r)                                                                    \
  if constexpr (R > r) {                                                                   \
    __m256 a = _mm256_broadcast_ss(TA ? A + k * lda + r : A + r * lda + k);                \
    c##r##0 = _mm256_fmadd_ps(a, b0, c##r##0);                                             \
    if constexpr (NV > 1) c##r##1 = _mm256_fmadd_ps(a, b1, c##r##1);                       \
  }
#define ATB_TILE_STORE(r)                                                  \
  if constexpr (R > r) {                                                   \
    _mm256_storeu_ps(C + r * ldc, c##r##0);                                \
    if constexpr (NV > 1) _mm256_storeu_ps(C + r * ldc + 8, c##r##1);      \
  }
  ATB_TILE_ROWS(ATB_TILE_LOAD)
  for (int64_t k = 0; k < K; ++k) {
    const TB* b = B + k * ldb;
    __m256 b0 = L8(b), b1 = NV > 1 ? L8(b + 8) : z;
    ATB_TILE_ROWS(ATB_TILE_FMA)
  }
  ATB_TILE_ROWS(ATB_TILE_STORE)
#undef ATB_TILE_ROWS
#undef ATB_TILE_LOAD
#undef ATB_TILE_FMA
#undef ATB_TILE_STORE
}

template <typename TB, __m256 (*L8)(const TB*), bool TA, int NV>
inline void RowsNN(float* C, int64_t ldc, const float* A, int64_t lda, const TB* B, int64_t ldb, int64_t M, int64_t K,
                   bool acc) {
  constexpr int kRows = 6;
  int64_t m = 0;
  auto a = [&](int64_t row) { return TA ? A + row : A + row * lda; };
  for (; m + kRows <= M; m += kRows) TileNN<TB, L8, TA, kRows, NV>(C + m * ldc, ldc, a(m), lda, B, ldb, K, acc);
  switch (M - m) {
    case 5: return TileNN<TB, L8, TA, 5, NV>(C + m * ldc, ldc, a(m), lda, B, ldb, K, acc);
    case 4: return TileNN<TB, L8, TA, 4, NV>(C + m * ldc, ldc, a(m), lda, B, ldb, K, acc);
    case 3: return TileNN<TB, L8, TA, 3, NV>(C + m * ldc, ldc, a(m), lda, B, ldb, K, acc);
    case 2: return TileNN<TB, L8, TA, 2, NV>(C + m * ldc, ldc, a(m), lda, B, ldb, K, acc);
    case 1: return TileNN<TB, L8, TA, 1, NV>(C + m * ldc, ldc, a(m), lda, B, ldb, K, acc);
    default: return;
  }
}

// Column panels of 16, then 8, then a scalar tail (fmaf: the same single
// rounding per step as a vector lane, so a column's value does not depend on N).
template <typename TB, __m256 (*L8)(const TB*), float (*L1)(const TB*), bool TA>
void MmadBlocked(float* C, int64_t ldc, const float* A, int64_t lda, const TB* B, int64_t ldb, int64_t M, int64_t N,
                 int64_t K, bool acc) {
  int64_t n = 0;
  for (; n + 16 <= N; n += 16) RowsNN<TB, L8, TA, 2>(C + n, ldc, A, lda, B + n, ldb, M, K, acc);
  for (; n + 8 <= N; n += 8) RowsNN<TB, L8, TA, 1>(C + n, ldc, A, lda, B + n, ldb, M, K, acc);
  for (; n < N; ++n)
    for (int64_t m = 0; m < M; ++m) {
      float v = acc ? C[m * ldc + n] : 0.0f;
      for (int64_t k = 0; k < K; ++k) v = std::fmaf(TA ? A[k * lda + m] : A[m * lda + k], L1(B + k * ldb + n), v);
      C[m * ldc + n] = v;
    }
}

template <typename TB, __m256 (*L8)(const TB*), float (*L1)(const TB*)>
void MmadNN(float* C, int64_t ldc, const float* A, int64_t lda, const TB* B, int64_t ldb, int64_t M, int64_t N,
            int64_t K, bool acc) {
  MmadBlocked<TB, L8, L1, false>(C, ldc, A, lda, B, ldb, M, N, K, acc);
}
void MmadTN(float* C, int64_t ldc, const float* A, int64_t lda, const float* B, int64_t ldb, int64_t M, int64_t N,
            int64_t K, bool acc) {
  MmadBlocked<float, Load8, Load1, true>(C, ldc, A, lda, B, ldb, M, N, K, acc);
}

// The 8 columns at p: plain loads and stores, or masked to the first `mask` lanes at a tile's last columns
// (masked lanes load 0 and are not stored). Zen 3 runs vmaskmovps stores far slower than plain ones.
struct Cols8 {
  __m256i mask;
  bool full;
  explicit Cols8(int64_t left)
      : mask(_mm256_cmpgt_epi32(_mm256_set1_epi32(int(std::min<int64_t>(left, 8))),
                                _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7))),
        full(left >= 8) {}
  __m256 Load(const float* p) const { return full ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, mask); }
  void Store(float* p, __m256 v) const { full ? _mm256_storeu_ps(p, v) : _mm256_maskstore_ps(p, mask, v); }
};

bool ColMax(float* m, const float* S, int64_t ld, int64_t rows, int64_t n) {
  __m256 nan = _mm256_setzero_ps();
  for (int64_t c = 0; c < n; c += 8) {
    const Cols8 cols(n - c);
    __m256 mc = cols.Load(m + c);
    for (int64_t r = 0; r < rows; ++r) {
      __m256 v = cols.Load(S + r * ld + c);
      nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
      mc = _mm256_max_ps(v, mc);  // a NaN v gives mc (maxps returns its second operand)
    }
    cols.Store(m + c, mc);
  }
  return _mm256_movemask_ps(nan) != 0;
}

void ExpSubAcc(float* d, const float* S, int64_t ld, const float* b, float* sum, int64_t rows, int64_t n) {
  for (int64_t c = 0; c < n; c += 8) {
    const Cols8 cols(n - c);
    __m256 bc = cols.Load(b + c), sc = cols.Load(sum + c);
    for (int64_t r = 0; r < rows; ++r) {
      __m256 e = ExpNonPositive8(_mm256_sub_ps(cols.Load(S + r * ld + c), bc));
      cols.Store(d + r * ld + c, e);
      sc = _mm256_add_ps(sc, e);
    }
    cols.Store(sum + c, sc);
  }
}

// Storage traits for the fused elementwise ops: load 8 -> fp32, store 8 with
// rounding, and Round8 = round to the storage precision but stay in fp32 (the
// value HF's intermediate tensor holds).
// For fp32 the product is already rounded; the empty asm only stops the
// compiler from contracting it with the following add into an FMA.
struct F32S {
  using T = float;
  static __m256 L8(const float* p) { return _mm256_loadu_ps(p); }
  static void S8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
  static __m256 Round8(__m256 v) {
    __asm__("" : "+x"(v));
    return v;
  }
  static float L1(const float* p) { return *p; }
  static void S1(float* p, float v) { *p = v; }
  static float Round1(float v) {
    __asm__("" : "+x"(v));
    return v;
  }
};
struct F16S {
  using T = uint16_t;
  static __m256 L8(const uint16_t* p) { return Load8H(p); }
  static void S8(uint16_t* p, __m256 v) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
  }
  static __m256 Round8(__m256 v) { return _mm256_cvtph_ps(_mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT)); }
  static float L1(const uint16_t* p) { return Load1H(p); }
  static void S1(uint16_t* p, float v) { *p = FromFloat<half>(v).bits; }
  static float Round1(float v) { return ToFloat(FromFloat<half>(v)); }
};
struct Bf16S {
  using T = uint16_t;
  static __m256 L8(const uint16_t* p) { return Load8B(p); }
  static void S8(uint16_t* p, __m256 v) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), Bf16Round8(v)); }
  // Round to nearest even at bit 16 without leaving the fp32 lanes (no pack/unpack);
  // a NaN stays a quiet NaN, as FromFloat<bfloat16_t> makes it.
  static __m256 Round8(__m256 v) {
    __m256i u = _mm256_castps_si256(v);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb);
    __m256 hi = _mm256_castsi256_ps(_mm256_set1_epi32(int32_t(0xffff0000u)));
    __m256 nan = _mm256_or_ps(v, _mm256_castsi256_ps(_mm256_set1_epi32(0x00400000)));
    __m256 isnan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
    return _mm256_and_ps(_mm256_blendv_ps(_mm256_castsi256_ps(r), nan, isnan), hi);
  }
  static float L1(const uint16_t* p) { return Load1B(p); }
  static void S1(uint16_t* p, float v) { *p = FromFloat<bfloat16_t>(v).bits; }
  static float Round1(float v) { return ToFloat(FromFloat<bfloat16_t>(v)); }
};

// No FMA on purpose: HF rounds x*cos before adding, so a fused multiply-add
// would differ from it in the last bit (fp32) or by a bf16/fp16 ulp.
template <class S>
void Rope(typename S::T* dst, const typename S::T* src, const float* cos, const float* sin, int64_t rows,
          int64_t pitch, int64_t headDim, int64_t rotary, bool interleave) {
  using T = typename S::T;
  const __m256 negEven = _mm256_castsi256_ps(_mm256_set_epi32(0, INT32_MIN, 0, INT32_MIN, 0, INT32_MIN, 0, INT32_MIN));
  for (int64_t r = 0; r < rows; ++r) {
    const T* x = src + r * pitch;
    T* y = dst + r * pitch;
    if (!interleave) {
      int64_t h = rotary / 2, i = 0;
      for (; i + 8 <= h; i += 8) {
        __m256 x1 = S::L8(x + i), x2 = S::L8(x + h + i);
        __m256 a1 = S::Round8(_mm256_mul_ps(x1, _mm256_loadu_ps(cos + i)));
        __m256 b1 = S::Round8(_mm256_mul_ps(x2, _mm256_loadu_ps(sin + i)));
        __m256 a2 = S::Round8(_mm256_mul_ps(x2, _mm256_loadu_ps(cos + h + i)));
        __m256 b2 = S::Round8(_mm256_mul_ps(x1, _mm256_loadu_ps(sin + h + i)));
        S::S8(y + i, _mm256_sub_ps(a1, b1));
        S::S8(y + h + i, _mm256_add_ps(a2, b2));
      }
      for (; i < h; ++i) {
        float x1 = S::L1(x + i), x2 = S::L1(x + h + i);
        float a1 = S::Round1(x1 * cos[i]), b1 = S::Round1(x2 * sin[i]);
        float a2 = S::Round1(x2 * cos[h + i]), b2 = S::Round1(x1 * sin[h + i]);
        S::S1(y + i, a1 - b1);
        S::S1(y + h + i, a2 + b2);
      }
    } else {
      int64_t i = 0;
      for (; i + 8 <= rotary; i += 8) {
        __m256 v = S::L8(x + i);
        // (x0, x1, x2, x3, ...) -> (-x1, x0, -x3, x2, ...)
        __m256 rot = _mm256_xor_ps(_mm256_permute_ps(v, 0xB1), negEven);
        __m256 a = S::Round8(_mm256_mul_ps(v, _mm256_loadu_ps(cos + i)));
        __m256 b = S::Round8(_mm256_mul_ps(rot, _mm256_loadu_ps(sin + i)));
        S::S8(y + i, _mm256_add_ps(a, b));
      }
      for (; i < rotary; i += 2) {
        float x0 = S::L1(x + i), x1 = S::L1(x + i + 1);
        S::S1(y + i, S::Round1(x0 * cos[i]) - S::Round1(x1 * sin[i]));
        S::S1(y + i + 1, S::Round1(x1 * cos[i + 1]) + S::Round1(x0 * sin[i + 1]));
      }
    }
    if (y != x && rotary < headDim) std::memcpy(y + rotary, x + rotary, size_t(headDim - rotary) * sizeof(T));
  }
}

template <class S>
void SiluMulT(uint16_t* d, const uint16_t* g, const uint16_t* u, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) S::S8(d + i, _mm256_mul_ps(S::Round8(Silu8(S::L8(g + i))), S::L8(u + i)));
  if (i < n) {  // the tail goes through the same vector path, zero-padded
    alignas(32) uint16_t gb[8] = {0}, ub[8] = {0}, db[8];
    for (int64_t j = i; j < n; ++j) gb[j - i] = g[j], ub[j - i] = u[j];
    S::S8(db, _mm256_mul_ps(S::Round8(Silu8(S::L8(gb))), S::L8(ub)));
    for (int64_t j = i; j < n; ++j) d[j] = db[j - i];
  }
}

// swiglu_out / residual_out (simd.h): SiluMulT's and add's steps on the sums rounded in the lanes (S::Round8
// is S::L8 of S::S8); the tail through the same vector path, zero-padded.
template <class S, class Op>
void EpilogueOut(uint16_t* d, const float* a, const float* b, int64_t n, Op op) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) S::S8(d + i, op(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i)));
  if (i < n) {
    alignas(32) float ab[8] = {0}, bb[8] = {0};
    alignas(32) uint16_t db[8];
    for (int64_t j = i; j < n; ++j) ab[j - i] = a[j], bb[j - i] = b[j];
    S::S8(db, op(_mm256_load_ps(ab), _mm256_load_ps(bb)));
    for (int64_t j = i; j < n; ++j) d[j] = db[j - i];
  }
}
template <class S>
void SwigluOut(uint16_t* d, const float* g, const float* u, int64_t n) {
  EpilogueOut<S>(d, g, u, n, [](__m256 gv, __m256 uv) {
    return _mm256_mul_ps(S::Round8(Silu8(S::Round8(gv))), S::Round8(uv));
  });
}
template <class S>
void ResidualOut(uint16_t* d, const float* a, const uint16_t* r, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) S::S8(d + i, _mm256_add_ps(S::Round8(_mm256_loadu_ps(a + i)), S::L8(r + i)));
  for (; i < n; ++i) S::S1(d + i, S::Round1(a[i]) + S::L1(r + i));
}

template <class S>
void RmsScaleOut(uint16_t* d, const float* h, const float* w, float rstd, int64_t n) {
  const __m256 r = _mm256_set1_ps(rstd);
  EpilogueOut<S>(d, h, w, n, [r](__m256 hv, __m256 wv) { return _mm256_mul_ps(S::Round8(_mm256_mul_ps(hv, r)), wv); });
}

#include "simd_lanes_block8.h"  // LanesBlock8

template <typename TB, __m256 (*L8)(const TB*), int R, int CN>
inline void LanesRows(float* lanes, int64_t N, const float* A, int64_t lda, const TB* B, int64_t ldb, int64_t M,
                      int64_t K, bool acc) {
  int64_t m = 0;
  for (; m + R <= M; m += R) LanesBlock8<TB, L8, R, CN>(lanes + m * N * 8, N, A + m * lda, lda, B, ldb, K, acc);
  if constexpr (R > 2)
    for (; m + 2 <= M; m += 2) LanesBlock8<TB, L8, 2, CN>(lanes + m * N * 8, N, A + m * lda, lda, B, ldb, K, acc);
  if (m < M) LanesBlock8<TB, L8, 1, CN>(lanes + m * N * 8, N, A + m * lda, lda, B, ldb, K, acc);
}

// Every accumulator is one fma chain per lane (the lanes contract), so the block shape cannot add chains by
// splitting K: it can only hold more (row, weight row) pairs. One or two A rows: 2 x 4 blocks (the DRAM-bound
// decode GEMV, each weight row streamed once). From three rows on, 4 x 3 blocks: 12 chains and 7 loads per 12
// FMAs, against 8 chains and 6 loads per 8 (M=16, K=576, N=1536, fp32, one Zen 3 core, weights in cache:
// 34 -> 57 GFLOP/s; fewer chains leave the FMA pipes waiting on their latency). Blocks of 3 weight rows x
// kLanesKBlock values (24 KiB of fp32) stay in L1 while every A row passes over them; whole-K passes beat
// 512-value blocks at K = 576 and 1536 (the lanes' loads and stores per block cost more than the A rows'
// trips to L2). The lanes' sums are the same bits whichever shape computes them.
constexpr int64_t kLanesKBlock = 2048;

template <typename TB, __m256 (*L8)(const TB*), int R, int CN>
inline void LanesPanels(float* lanes, const float* A, int64_t lda, const TB* B, int64_t ldb, int64_t M, int64_t N,
                        int64_t K, int64_t kb, bool acc, int64_t n = 0) {
  for (; n + CN <= N; n += CN)
    for (int64_t k = 0; k < K; k += kb)
      LanesRows<TB, L8, R, CN>(lanes + n * 8, N, A + k, lda, B + n * ldb + k, ldb, M, std::min(kb, K - k),
                               acc || k > 0);
  for (; n < N; ++n)
    for (int64_t k = 0; k < K; k += kb)
      LanesRows<TB, L8, R, 1>(lanes + n * 8, N, A + k, lda, B + n * ldb + k, ldb, M, std::min(kb, K - k),
                              acc || k > 0);
}

template <typename TB, __m256 (*L8)(const TB*)>
void MmadNTLanes(float* lanes, const float* A, int64_t lda, const TB* B, int64_t ldb, int64_t M, int64_t N, int64_t K,
                 bool acc) {
  if (K == 0) {  // an all-tail K (< 8): the lanes still start from zero
    if (!acc) std::fill(lanes, lanes + M * N * 8, 0.0f);
    return;
  }
  if (M <= 2 && N >= 4 * kLanesRunMinRows) {
    // As the AVX-512 table's few-row form: the block's 4 weight rows from 4 runs of N / 4 rows, each run read
    // front to back (the stream prefetcher follows it), then the rows past the runs as before.
    const int64_t run = N / 4;
    for (int64_t i = 0; i < run; ++i) {
      if (M == 2) LanesBlock8<TB, L8, 2, 4>(lanes + i * 8, N, A, lda, B + i * ldb, ldb, K, acc, run);
      else LanesBlock8<TB, L8, 1, 4>(lanes + i * 8, N, A, lda, B + i * ldb, ldb, K, acc, run);
    }
    LanesPanels<TB, L8, 2, 4>(lanes, A, lda, B, ldb, M, N, K, K, acc, 4 * run);
  } else if (M <= 2)
    LanesPanels<TB, L8, 2, 4>(lanes, A, lda, B, ldb, M, N, K, K, acc);
  else
    LanesPanels<TB, L8, 4, 3>(lanes, A, lda, B, ldb, M, N, K, kLanesKBlock, acc);
}

// Few-row Mmads take A in blocks of up to 8 rows; each row count R gets its own
// instantiation with as many B panels as the 16 ymm registers allow
// (R*CN accumulators + CN B vectors + 1 broadcast).
template <int R> constexpr int kPanelsForRows = R <= 2 ? 4 : R == 3 ? 3 : R <= 6 ? 2 : 1;

// Past 8 rows (attention's prefill items: up to 64 query rows per tile) blocks of 6 rows x 2 panels come
// first: 12 accumulators against 8 x 1, 2 B + 6 A loads per 12 FMAs against 1 + 8 per 8. One Zen 3 core, hot,
// bf16 K/V, 64 rows x 24 keys, GFLOP/s, 8-row -> 6-row blocks in the same run: scores, head_dim 64, 43.6-45.6
// -> 47.2-47.4 (a slower phase of the machine: 29.6 -> 33.5), head_dim 128 49.0-50.4 -> 51.6-51.9; P x V
// 81-83 either way (slower phase: 42.7 -> 49.0). A block's shape changes no element's sum (the contracts above).
template <typename Fn>
inline void ForRowBlocks(int64_t M, Fn&& fn) {
  using std::integral_constant;
  int64_t m0 = 0;
  if (M > 8)
    for (; m0 + 6 <= M; m0 += 6) fn(integral_constant<int, 6>{}, m0);
  for (int64_t m = m0; m < M; m += 8) {
    switch (std::min<int64_t>(8, M - m)) {
      case 1: fn(integral_constant<int, 1>{}, m); break;
      case 2: fn(integral_constant<int, 2>{}, m); break;
      case 3: fn(integral_constant<int, 3>{}, m); break;
      case 4: fn(integral_constant<int, 4>{}, m); break;
      case 5: fn(integral_constant<int, 5>{}, m); break;
      case 6: fn(integral_constant<int, 6>{}, m); break;
      case 7: fn(integral_constant<int, 7>{}, m); break;
      default: fn(integral_constant<int, 8>{}, m); break;
    }
  }
}

// Few-row NT Mmad: all R (<= 8) A rows against CN B rows per block, so a B
// row is widened once; CN keeps R*CN + CN + 1 <= 16 ymm registers. The R*CN
// lane sums are reduced four at a time by an hadd tree (5 instructions per 4
// outputs instead of 6 per output), which matters at head_dim 64 where a
// block's k loop is only 8 steps long.
#include "simd_hsum4.h"    // HSum4
#include "simd_lane_of.h"  // LaneOf

template <typename TB, __m256 (*L8)(const TB*), float (*L1)(const TB*), int R, int CN>
inline void BlockNTRows(float* C, int64_t ldc, const float* A, int64_t lda, const TB* B, int64_t ldb, int64_t K,
                        bool acc) {
  constexpr int kOut = R * CN, kPad = (kOut + 3) / 4 * 4;
  __m256 s[kPad];
#pragma GCC unroll 32
  for (int i = 0; i < kPad; ++i) s[i] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    __m256 b[CN];
#pragma GCC unroll 8
    for (int c = 0; c < CN; ++c) b[c] = L8(B + c * ldb + k);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      __m256 a = _mm256_loadu_ps(A + r * lda + k);
#pragma GCC unroll 8
      for (int c = 0; c < CN; ++c) s[r * CN + c] = _mm256_fmadd_ps(a, b[c], s[r * CN + c]);
    }
  }
  __m128 sums[kPad / 4];
#pragma GCC unroll 8
  for (int i = 0; i < kPad; i += 4) sums[i / 4] = HSum4(s[i], s[i + 1], s[i + 2], s[i + 3]);
  if constexpr (CN == 2) {
    // No k tail and nothing to add to (attention's scores at head_dim 64 or 128): sums[i] holds rows 2i and
    // 2i + 1, two columns each, stored as two pairs instead of four extracts, tail checks and scalar stores,
    // which at head_dim 64 (an 8-step k loop) are a large part of a block (bf16, 64 rows x 24 keys, one Zen 3
    // core, hot, same run: 47.2-47.4 -> 49.9-50.2 GFLOP/s; head_dim 128 within noise).
    if (k == K && !acc) {
#pragma GCC unroll 8
      for (int i = 0; i < kPad / 4; ++i) {
        _mm_storel_pi(reinterpret_cast<__m64*>(C + 2 * i * ldc), sums[i]);
        if (2 * i + 1 < R) _mm_storeh_pi(reinterpret_cast<__m64*>(C + (2 * i + 1) * ldc), sums[i]);
      }
      return;
    }
  }
  // Each sum is taken out of its register (LaneOf). Stored as vectors and read back one float at a time,
  // the reads waited on the stores: SmolLM2 decode scores (3 heads x 3 rows x 160 keys, head_dim 64, bf16,
  // L1-resident, one Zen 3 core) took 9.8 us that way and 6.2 us this way (1.2 -> 1.85 ymm FMA/ns).
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < CN; ++c) {
      float v = LaneOf(sums[(r * CN + c) / 4], (r * CN + c) % 4);
      for (int64_t kk = k; kk < K; ++kk) v += A[r * lda + kk] * L1(B + c * ldb + kk);
      float* out = C + r * ldc + c;
      *out = acc ? *out + v : v;
    }
}

template <typename TB, __m256 (*L8)(const TB*), float (*L1)(const TB*), int R, int CN>
void RowsNT(float* C, int64_t ldc, const float* A, int64_t lda, const TB* B, int64_t ldb, int64_t N, int64_t K,
            bool acc) {
  int64_t n = 0;
  for (; n + CN <= N; n += CN) BlockNTRows<TB, L8, L1, R, CN>(C + n, ldc, A, lda, B + n * ldb, ldb, K, acc);
  for (; n < N; ++n) BlockNTRows<TB, L8, L1, R, 1>(C + n, ldc, A, lda, B + n * ldb, ldb, K, acc);
}

template <typename TB, __m256 (*L8)(const TB*), float (*L1)(const TB*)>
void MmadNTRows(float* C, int64_t ldc, const float* A, int64_t lda, const TB* B, int64_t ldb, int64_t M, int64_t N,
                int64_t K, bool acc) {
  ForRowBlocks(M, [&](auto rows, int64_t m) {
    constexpr int R = decltype(rows)::value;
    RowsNT<TB, L8, L1, R, kPanelsForRows<R>>(C + m * ldc, ldc, A + m * lda, lda, B, ldb, N, K, acc);
  });
}

// Few-row NN Mmad: R rows x 8*NV columns of C in R*NV accumulators; per k the
// B panel (NV vectors) is widened once and each A element is one broadcast.
template <typename TB, __m256 (*L8)(const TB*), int R, int NV>
void PanelNN(float* C, int64_t ldc, const float* A, int64_t lda, const TB* B, int64_t ldb, int64_t K, bool acc) {
  // The unroll pragmas let GCC keep c[][] in registers (without them it
  // stores every accumulator to the stack on each k step).
  __m256 c[R][NV];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) c[r][v] = acc ? _mm256_loadu_ps(C + r * ldc + 8 * v) : _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m256 b[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) b[v] = L8(B + k * ldb + 8 * v);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      __m256 a = _mm256_broadcast_ss(A + r * lda + k);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) c[r][v] = _mm256_fmadd_ps(a, b[v], c[r][v]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) _mm256_storeu_ps(C + r * ldc + 8 * v, c[r][v]);
}

template <typename TB, __m256 (*L8)(const TB*), float (*L1)(const TB*), int R, int NV>
void RowsNN(float* C, int64_t ldc, const float* A, int64_t lda, const TB* B, int64_t ldb, int64_t N, int64_t K,
            bool acc) {
  int64_t n = 0;
  for (; n + 8 * NV <= N; n += 8 * NV) PanelNN<TB, L8, R, NV>(C + n, ldc, A, lda, B + n, ldb, K, acc);
  for (; n + 8 <= N; n += 8) PanelNN<TB, L8, R, 1>(C + n, ldc, A, lda, B + n, ldb, K, acc);
  for (; n < N; ++n)  // fmaf: the same single rounding per step as a vector lane
    for (int r = 0; r < R; ++r) {
      float v = acc ? C[r * ldc + n] : 0.0f;
      for (int64_t k = 0; k < K; ++k) v = std::fmaf(A[r * lda + k], L1(B + k * ldb + n), v);
      C[r * ldc + n] = v;
    }
}

template <typename TB, __m256 (*L8)(const TB*), float (*L1)(const TB*)>
void MmadNNRows(float* C, int64_t ldc, const float* A, int64_t lda, const TB* B, int64_t ldb, int64_t M, int64_t N,
                int64_t K, bool acc) {
  ForRowBlocks(M, [&](auto rows, int64_t m) {
    constexpr int R = decltype(rows)::value;
    RowsNN<TB, L8, L1, R, kPanelsForRows<R>>(C + m * ldc, ldc, A + m * lda, lda, B, ldb, N, K, acc);
  });
}

void SumLanes8(float* d, const float* l, int64_t n) {
  for (int64_t i = 0; i < n; ++i) d[i] = HSum(_mm256_loadu_ps(l + 8 * i));  // HSum's tree is sum_lanes8's
}

#include "simd_transpose8.h"  // TransposeWiden

#include "simd_read_sum.h"  // ReadSumRuns

struct Line256 {
  using V = __m256i;
  static V Zero() { return _mm256_setzero_si256(); }
  static V Add(V a, V b) { return _mm256_add_epi64(a, b); }
  static V Load(const uint64_t* p) {
    const auto* q = reinterpret_cast<const __m256i*>(p);
    return _mm256_add_epi64(_mm256_loadu_si256(q), _mm256_loadu_si256(q + 1));
  }
  static uint64_t Sum(V v) {
    alignas(32) uint64_t lanes[4];
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), v);
    return lanes[0] + lanes[1] + lanes[2] + lanes[3];
  }
};

// ---- mmad_nt_lanes over rows4 weights (kernels/linear/linear_rows4.h), bf16 ---------
// Row r of a group's chunk of 8 k (its 16 bytes) becomes one ymm of fp32 lanes 0-7, widened as Load8B, against
// x's k..k+7: each lane the contract's one fma chain over its k, LanesBlock's bits. A core's groups lie front to
// back, one stream the hardware prefetcher follows, where MmadNTLanes reads 4 runs of rows. No fp32 entry: on
// Zen 4 under this table, fp32 batch-1 graph steps ran 1.04x (SmolLM2) and 0.975x (TinyLlama-shaped) with the
// copies, which would cost twice bf16's memory.
struct Rows4RowB {
  static __m256 Row(const uint16_t* chunk, int r) { return Load8B(chunk + r * 8); }
};

// R rows of A against one group (`rows` of its 4 rows stored); `ahead` as in simd_avx512.cpp's.
template <typename TB, class L, int R>
void LanesRows4Block(float* lanes, int64_t N, const float* A, int64_t lda, const TB* G, int64_t K, bool acc,
                     int64_t rows, int64_t ahead) {
  __m256 s[R][4];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c)
      s[r][c] = acc && c < rows ? _mm256_loadu_ps(lanes + (r * N + c) * 8) : _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {
    const TB* chunk = G + 4 * k;  // chunk k / 8: 32 elements
    if (ahead) PrefetchChunk(chunk + ahead);
    __m256 b[4];
    for (int c = 0; c < 4; ++c) b[c] = L::Row(chunk, c);
    for (int r = 0; r < R; ++r) {
      const __m256 a = _mm256_loadu_ps(A + r * lda + k);
      for (int c = 0; c < 4; ++c) s[r][c] = _mm256_fmadd_ps(a, b[c], s[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < rows; ++c) _mm256_storeu_ps(lanes + (r * N + c) * 8, s[r][c]);
}

#include "simd_rows4.h"  // MmadNTLanesRows4

const SimdOps kAvx2 = {
    "avx2", Add, Sub, Mul, Max, Muls, Adds, Axpy, Exp, Silu, SiluMul, Duplicate,
    ReduceSum, ReduceMax, SumSquares, Dot, F16ToF32, Bf16ToF32, F32ToF16, F32ToBf16,
    MmadNT<float, Load8, Load1>, MmadNT<uint16_t, Load8H, Load1H>, MmadNT<uint16_t, Load8B, Load1B>,
    MmadNN<float, Load8, Load1>, MmadNN<uint16_t, Load8H, Load1H>, MmadNN<uint16_t, Load8B, Load1B>,
    Rope<F32S>, Rope<F16S>, Rope<Bf16S>, SiluMulT<F16S>, SiluMulT<Bf16S>,
    SwigluOut<F16S>, SwigluOut<Bf16S>, ResidualOut<F16S>, ResidualOut<Bf16S>, RmsScaleOut<F16S>, RmsScaleOut<Bf16S>,
    MmadNTLanes<float, Load8>, MmadNTLanes<uint16_t, Load8H>, MmadNTLanes<uint16_t, Load8B>,
    MmadNTRows<float, Load8, Load1>, MmadNTRows<uint16_t, Load8H, Load1H>, MmadNTRows<uint16_t, Load8B, Load1B>,
    MmadNNRows<float, Load8, Load1>, MmadNNRows<uint16_t, Load8H, Load1H>, MmadNNRows<uint16_t, Load8B, Load1B>,
    MmadTN, ColMax, ExpSubAcc, SumLanes8,
    TransposeWiden<float, Widen8, Load1>, TransposeWiden<uint16_t, Widen8H, Load1H>,
    TransposeWiden<uint16_t, Widen8B, Load1B>, ReadSumRuns<Line256>,
};

}  // namespace
#pragma GCC pop_options

// The positional entries, then those set by name.
const SimdOps* Avx2SimdOps() {
  static const SimdOps table = [] {
    SimdOps t = kAvx2;
    t.mmad_nt_lanes_rows4_bf16 = MmadNTLanesRows4<uint16_t, Rows4RowB>;
    return t;
  }();
  return &table;
}

}  // namespace AscendC

#else
namespace AscendC {
const SimdOps* Avx2SimdOps() { return nullptr; }
}  // namespace AscendC
#endif
