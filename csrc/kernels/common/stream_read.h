#pragma once
#include <cstdint>

namespace atb {

// Reads `bytes` from `data` once, split over the kernel thread pool (one
// contiguous slice per thread, read by the SIMD table's read_sum), and returns
// the sum of its 64-bit words (mod 2^64; a trailing partial word is not read) so
// the loads cannot be elided. The benchmarks' memory-bandwidth probe.
uint64_t StreamRead(const void* data, int64_t bytes);

}  // namespace atb
