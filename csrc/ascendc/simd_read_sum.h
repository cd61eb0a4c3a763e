// SimdOps::read_sum, the benchmarks' streaming-read probe, written once over a table's vector type. Included
// by each table (simd_avx2.cpp, simd_avx512.cpp, simd_portable.cpp) inside its namespace and target pragmas,
// as simd_hsum4.h is. Line is a struct of the table's ops on a 64-byte line of 8 words:
//   V Zero(); V Add(V, V); V Load(const uint64_t* line); uint64_t Sum(V)  (Add/Sum: integer adds, mod 2^64)
#pragma once

// The n words as 4 runs of n / 4 words (whole lines) read one line of each in turn, then the rest in order:
// 4 streams in flight per thread read faster than one (Zen 3: 5-35% over one run of 16-byte loads).
template <typename Line>
uint64_t ReadSumRuns(const uint64_t* p, int64_t n) {
  constexpr int kRuns = 4;
  const int64_t run = n / kRuns / 8 * 8;
  typename Line::V acc[kRuns] = {Line::Zero(), Line::Zero(), Line::Zero(), Line::Zero()};
  for (int64_t i = 0; i < run; i += 8)
    for (int s = 0; s < kRuns; ++s) acc[s] = Line::Add(acc[s], Line::Load(p + s * run + i));
  uint64_t sum = Line::Sum(Line::Add(Line::Add(acc[0], acc[1]), Line::Add(acc[2], acc[3])));
  for (int64_t i = kRuns * run; i < n; ++i) sum += p[i];
  return sum;
}
