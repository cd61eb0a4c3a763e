// The one layout of a tiling key, which tiling writes and kernels and bindings
// read: mode * 100 + dtype * 10 + variant, each a digit. Ops without a mode
// leave it 0; rope uses the mode digit for its dtype and the dtype digit for
// its cos/sin dtype.
#pragma once
#include <cstdint>

#include "ascendc/dtype.h"

namespace atb {

constexpr int64_t EncodeTilingKey(AscendC::DataType dtype, int64_t variant, int64_t mode = 0) {
  return mode * 100 + int64_t(dtype) * 10 + variant;
}
constexpr int64_t TilingKeyVariant(int64_t key) { return key % 10; }
constexpr AscendC::DataType TilingKeyDtype(int64_t key) { return AscendC::DataType(key / 10 % 10); }
constexpr int64_t TilingKeyMode(int64_t key) { return key / 100; }

}  // namespace atb
