// Four horizontal sums of 8 fp32 lanes as one vector, in order: an hadd tree, 5 instructions per 4 outputs
// instead of 6 per output. Included by the AVX2 tables (ascendc/simd_avx2.cpp, the few-row NT Mmad's lane
// sums; kernels/quant_linear/quant_simd_avx2.cpp, a 4-row GEMV block's sums) inside their namespace and
// target pragmas, as simd_transpose8.h is.
#pragma once

inline __m128 HSum4(__m256 a, __m256 b, __m256 c, __m256 d) {
  __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}
