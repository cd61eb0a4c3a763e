#include "stream_read.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "ascendc/runtime.h"

namespace atb {
namespace {

// Integer adds (unlike float adds) may be reassociated, so the compiler
// vectorizes this loop for the baseline ISA: two 16-byte loads per cycle is
// far above what DRAM delivers to one core, so the loop is load-bound.
uint64_t SumWords(const uint64_t* p, int64_t n) {
  uint64_t a = 0, b = 0, c = 0, d = 0;
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    a += p[i];
    b += p[i + 1];
    c += p[i + 2];
    d += p[i + 3];
  }
  for (; i < n; ++i) a += p[i];
  return a + b + c + d;
}

}  // namespace

uint64_t StreamRead(const void* data, int64_t bytes) {
  int64_t words = bytes / 8;
  int64_t blocks = std::max<int64_t>(1, std::min(AscendC::GetNumThreads(), words / 4096));
  int64_t per = (words + blocks - 1) / blocks;
  std::vector<uint64_t> partial(size_t(blocks), 0);
  const auto* p = static_cast<const uint64_t*>(data);
  auto kernel = [&]() {
    int64_t b = AscendC::GetBlockIdx(), start = b * per, n = std::max<int64_t>(0, std::min(per, words - start));
    partial[size_t(b)] = SumWords(p + start, n);
  };
  // The UB is not used; the smallest legal size keeps the launch contract.
  AscendC::KernelLaunch(blocks, 1, kernel);
  uint64_t sum = 0;
  for (uint64_t v : partial) sum += v;
  return sum;
}

}  // namespace atb
