// The polynomials of the SIMD tables' exp functions, in one place: each table evaluates them at its own
// vector width with Horner (below), the same fma steps on the same constants, so every table gives the
// same bits. Included by the AVX2 and AVX-512 tables (ascendc/simd_avx2.cpp, ascendc/simd_avx512.cpp)
// inside their namespace and target pragmas, as simd_hsum4.h is.
#pragma once

// Cephes' expf on the reduced argument r: exp(r) = 1 + r + r^2 P(r); P's coefficients, highest degree first.
constexpr float kExpCephesP[6] = {1.9875691500E-4f, 1.3981999507E-3f, 8.3334519073E-3f,
                                  4.1665795894E-2f, 1.6666665459E-1f, 5.0000001201E-1f};
// 2^f for f in [-1/2, 1/2], degree 6 (1.7 ulp), highest degree first.
constexpr float kExp2Deg6[7] = {1.537173957331106e-4f, 1.3399693416431546e-3f, 9.618369862437248e-3f,
                                5.5503297597169876e-2f, 2.4022649228572845e-1f, 6.931471824645996e-1f, 1.0f};
// 2^f for f in [-1/2, 1/2], degree 5 (1.5e-7 relative, ~1.3 ulp; fitted near-minimax): flash attention's P,
// which go on to bf16 (2^-9 relative) and whose rounding cancels in P . V / sum P.
constexpr float kExp2Deg5[6] = {1.327646430581808e-3f, 9.675540961325169e-3f, 5.550713464617729e-2f,
                                2.4022120237350464e-1f, 6.931469440460205e-1f, 1.0000001192092896f};

// c[0] x^(N-1) + ... + c[N-1]: p = c[0], then p = fma(p, x, c[i]) for i = 1 .. N-1. fma(a, b, c) is the
// table's a * b + c with one rounding, set1 its broadcast.
template <int N, class V, class Fma, class Set1>
__attribute__((always_inline)) inline V Horner(V x, const float (&c)[N], Fma fma, Set1 set1) {
  V p = set1(c[0]);
#pragma GCC unroll 8
  for (int i = 1; i < N; ++i) p = fma(p, x, set1(c[i]));
  return p;
}
