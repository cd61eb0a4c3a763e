// The widening transpose of the GEMM kernels' packed B operand, in 256-bit AVX (+F16C):
//   dst[k * ldd + n] = fp32(src[n * lds + k]),  n < N, k < K
// as 8 x 8 blocks (8 row loads, widened, an in-register transpose, 8 stores), scalar at the edges. Exact.
// Included by the AVX2 and AVX-512 tables inside their namespace and target pragmas (an AVX-512 CPU runs
// 256-bit code at full speed, and this step is a copy, not arithmetic); the SIMDe build gets the same
// intrinsics from SIMDe.
#pragma once

// r[j] (row j, lanes = 8 columns) -> r[j] = column j of the block.
inline void Transpose8x8(__m256 r[8]) {
  __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
  __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
  __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
  __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
  __m256 s0 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(1, 0, 1, 0)), s1 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(3, 2, 3, 2));
  __m256 s2 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(1, 0, 1, 0)), s3 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(3, 2, 3, 2));
  __m256 s4 = _mm256_shuffle_ps(t4, t6, _MM_SHUFFLE(1, 0, 1, 0)), s5 = _mm256_shuffle_ps(t4, t6, _MM_SHUFFLE(3, 2, 3, 2));
  __m256 s6 = _mm256_shuffle_ps(t5, t7, _MM_SHUFFLE(1, 0, 1, 0)), s7 = _mm256_shuffle_ps(t5, t7, _MM_SHUFFLE(3, 2, 3, 2));
  r[0] = _mm256_permute2f128_ps(s0, s4, 0x20);
  r[1] = _mm256_permute2f128_ps(s1, s5, 0x20);
  r[2] = _mm256_permute2f128_ps(s2, s6, 0x20);
  r[3] = _mm256_permute2f128_ps(s3, s7, 0x20);
  r[4] = _mm256_permute2f128_ps(s0, s4, 0x31);
  r[5] = _mm256_permute2f128_ps(s1, s5, 0x31);
  r[6] = _mm256_permute2f128_ps(s2, s6, 0x31);
  r[7] = _mm256_permute2f128_ps(s3, s7, 0x31);
}

inline __m256 Widen8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 Widen8H(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline __m256 Widen8B(const uint16_t* p) {
  return _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}

template <typename TB, __m256 (*W8)(const TB*), float (*W1)(const TB*)>
void TransposeWiden(float* dst, int64_t ldd, const TB* src, int64_t lds, int64_t N, int64_t K) {
  int64_t n = 0;
  for (; n + 8 <= N; n += 8) {
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
      __m256 r[8];
      for (int j = 0; j < 8; ++j) r[j] = W8(src + (n + j) * lds + k);
      Transpose8x8(r);
      for (int j = 0; j < 8; ++j) _mm256_storeu_ps(dst + (k + j) * ldd + n, r[j]);
    }
    for (; k < K; ++k)
      for (int j = 0; j < 8; ++j) dst[k * ldd + n + j] = W1(src + (n + j) * lds + k);
  }
  for (; n < N; ++n)
    for (int64_t k = 0; k < K; ++k) dst[k * ldd + n] = W1(src + n * lds + k);
}
