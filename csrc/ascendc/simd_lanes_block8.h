// LanesBlock8: the lanes GEMV tile over 256-bit vectors, one weight row per vector (8 values of k), written
// once for the tables that run it: the AVX2 table's every lanes Mmad, and the AVX-512 tables' fp32 few-row form
// where the fp32 decode GEMV reads weights as they lie (Fp32DecodeReadsCopy in simd.h: off). Included by each
// (simd_avx2.cpp, simd_avx512.cpp) inside its namespace and target pragmas, after block_prefetch.h.
#pragma once

// Lane-accumulating GEMV/GEMM tile for decode-shaped linears: R rows of A
// against CN weight rows, R*CN accumulators in registers, every weight vector
// loaded once per k-step for all R rows. Accumulators start from (and return
// to) the lanes buffer, so K may be split anywhere on a multiple of 8.
// Weight row c of the block is row c * rowStep (1: adjacent rows; MmadNTLanes' runs: one row of each run).
template <typename TB, __m256 (*L8)(const TB*), int R, int CN>
inline void LanesBlock8(float* lanes, int64_t N, const float* A, int64_t lda, const TB* B, int64_t ldb, int64_t K,
                        bool acc, int64_t rowStep = 1) {
  __m256 s[R][CN];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < CN; ++c)
      s[r][c] = acc ? _mm256_loadu_ps(lanes + (r * N + c * rowStep) * 8) : _mm256_setzero_ps();
  // Short weight rows (a few KiB: bf16 K=576 is 1.1 KiB) end before the hardware
  // prefetcher ramps up, so the block ahead is fetched while this one is used
  // (block_prefetch.h; bf16 1536x576, M = 1, 2 threads, medians of 21 interleaved
  // rounds: 150 -> 121 us against rows two blocks ahead at the same offset; 576x1536
  // and fp32 unchanged). Long rows are left to the hardware prefetcher.
  constexpr int64_t kLine = 64 / int64_t(sizeof(TB));
  const bool prefetch = ldb * int64_t(sizeof(TB)) <= 4096;
  // Rows prefetched one by one (long rows, a K slice) are fetched two blocks ahead, as before the sweep; rows
  // from runs, each run's row two ahead.
  const int64_t rowBytes = K * int64_t(sizeof(TB)), pitch = ldb * int64_t(sizeof(TB));
  const BlockPrefetch<CN> ahead =
      rowStep == 1 ? BlockPrefetch<CN>(B, pitch, rowBytes, BlockPrefetch<CN>::Linear(pitch, rowBytes) ? 1 : 2)
                   : BlockPrefetch<CN>::Runs(B, pitch, rowStep * pitch, 2);
  for (int64_t k = 0; k < K; k += 8) {
    if (prefetch && k % kLine == 0) ahead.At(k * int64_t(sizeof(TB)));
    __m256 b[CN];
    for (int c = 0; c < CN; ++c) b[c] = L8(B + c * rowStep * ldb + k);
    for (int r = 0; r < R; ++r) {
      __m256 a = _mm256_loadu_ps(A + r * lda + k);
      for (int c = 0; c < CN; ++c) s[r][c] = _mm256_fmadd_ps(a, b[c], s[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < CN; ++c) _mm256_storeu_ps(lanes + (r * N + c * rowStep) * 8, s[r][c]);
}
