// SimdOps::mmad_nt_lanes_rows4_*'s driver, written once for the tables that have the kernel: included by each
// (simd_avx2.cpp, simd_avx512.cpp) inside its namespace and target pragmas, after its own
//   template <typename TB, class L, int R> void LanesRows4Block(float* lanes, int64_t N, const float* A,
//       int64_t lda, const TB* group, int64_t K, bool acc, int64_t rows, int64_t ahead)
// (R rows of A against one group of 4 weight rows, `rows` of them stored; `ahead` elements past each chunk
// of 32 are prefetched into L2, 0: none).
#pragma once

// 1 or 2 rows of x per pass (the linear reads rows4 copies only for such calls: linear_rows4.h), each group of
// the call's rows in turn, front to back.
template <typename TB, class L>
void MmadNTLanesRows4(float* lanes, const float* A, int64_t lda, const TB* B4, int64_t ldg, int64_t M, int64_t N,
                      int64_t K, bool acc) {
  if (K == 0) {
    if (!acc) std::fill(lanes, lanes + M * N * 8, 0.0f);
    return;
  }
  const int64_t ahead = StreamPrefetchBytes() / int64_t(sizeof(TB));
  for (int64_t m = 0; m < M;) {
    const bool two = M - m >= 2;
    for (int64_t n = 0; n < N; n += 4) {
      float* l = lanes + (m * N + n) * 8;
      const TB* group = B4 + n / 4 * ldg;
      const int64_t rows = std::min<int64_t>(4, N - n);
      if (two) LanesRows4Block<TB, L, 2>(l, N, A + m * lda, lda, group, K, acc, rows, ahead);
      else LanesRows4Block<TB, L, 1>(l, N, A + m * lda, lda, group, K, acc, rows, ahead);
    }
    m += two ? 2 : 1;
  }
}
