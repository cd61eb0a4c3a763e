#pragma once
#include <cstdint>

namespace atb {

// Reads `bytes` from `data` once, split over the kernel thread pool (one
// contiguous slice per thread), and returns a checksum of what it read so the
// loads cannot be elided. The benchmark's memory-bandwidth probe.
uint64_t StreamRead(const void* data, int64_t bytes);

}  // namespace atb
