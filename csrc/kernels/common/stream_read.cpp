#include "stream_read.h"

#include <algorithm>
#include <vector>

#include "ascendc/runtime.h"
#include "ascendc/simd.h"

namespace atb {
uint64_t StreamRead(const void* data, int64_t bytes) {
  int64_t words = bytes / 8;
  int64_t blocks = std::max<int64_t>(1, std::min(AscendC::GetNumThreads(), words / 4096));
  int64_t per = (words + blocks - 1) / blocks;
  std::vector<uint64_t> partial(size_t(blocks), 0);
  const auto* p = static_cast<const uint64_t*>(data);
  const auto read = AscendC::Simd().read_sum;
  auto kernel = [&]() {
    int64_t b = AscendC::GetBlockIdx(), start = b * per, n = std::max<int64_t>(0, std::min(per, words - start));
    partial[size_t(b)] = read(p + start, n);
  };
  // The UB is not used; the smallest legal size keeps the launch contract.
  AscendC::KernelLaunch(blocks, 1, kernel);
  uint64_t sum = 0;
  for (uint64_t v : partial) sum += v;
  return sum;
}

}  // namespace atb
