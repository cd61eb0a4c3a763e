// Repacking weights into the rows4 layout (linear_rows4.h): once per weight, when the engine builds its decode
// graph, so a plain copy loop in 16- and 32-byte pieces.
#include "linear_rows4.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>

#include "ascendc/simd.h"
#include "linear_tiling.h"

namespace atb {

bool Rows4Supported(AscendC::DataType dtype) {
  const AscendC::SimdOps& simd = AscendC::Simd();
  if (dtype == AscendC::DataType::BFLOAT16) return simd.mmad_nt_lanes_rows4_bf16 != nullptr;
  if (dtype == AscendC::DataType::FLOAT32) return simd.mmad_nt_lanes_rows4_f32 != nullptr;
  return false;
}

int64_t Rows4MaxRows(AscendC::DataType dtype) {
  if (dtype == AscendC::DataType::BFLOAT16) return 1;
  return AscendC::Fp32DecodeReadsCopy() ? 2 : 0;
}

bool Rows4PackedX(AscendC::DataType dtype, int64_t k) {
  const AscendC::SimdOps& simd = AscendC::Simd();
  if (dtype == AscendC::DataType::BFLOAT16) return simd.mmad_dp_bf16_packed_x_rows4 != nullptr;
  if (dtype == AscendC::DataType::FLOAT32)
    return simd.mmad_packed_x_rows4_f32 != nullptr &&
           ((k * 4) % kPackedXAliasBytes == 0 ||
            (AscendC::Fp32BatchReadsCopy() && k * 4 < kFp32BatchCopyMaxRowBytes));
  return false;
}

namespace {

// The 8 values of row r's chunk c (fewer at the K tail, the rest zero) to their places in the group's chunk.
template <typename T>
void PackChunk(T* chunk, const T* row, int64_t r, int64_t valid) {
  T v[8] = {};
  std::memcpy(v, row, size_t(valid) * sizeof(T));
  if constexpr (sizeof(T) == 2) {
    std::memcpy(chunk + r * 8, v, sizeof(v));
  } else {
    std::memcpy(chunk + r * 4, v, 4 * sizeof(T));
    std::memcpy(chunk + 16 + r * 4, v + 4, 4 * sizeof(T));
  }
}

template <typename T>
void Pack(T* dst, const T* W, int64_t ldw, int64_t N, int64_t K) {
  const int64_t groups = AscendC::CeilDiv(N, kRows4GroupRows), chunks = AscendC::CeilDiv(K, 8), ld = Rows4Ld(K);
  std::memset(dst, 0, size_t(groups * ld) * sizeof(T));  // the padding rows and k
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t r = 0; r < kRows4GroupRows && g * kRows4GroupRows + r < N; ++r) {
      const T* row = W + (g * kRows4GroupRows + r) * ldw;
      for (int64_t c = 0; c < chunks; ++c)
        PackChunk(dst + g * ld + c * 32, row + c * 8, r, std::min<int64_t>(8, K - c * 8));
    }
}

}  // namespace

void PackRows4(void* dst, const void* W, int64_t ldw, int64_t N, int64_t K, AscendC::DataType dtype) {
  if (dtype == AscendC::DataType::FLOAT32)
    return Pack(static_cast<float*>(dst), static_cast<const float*>(W), ldw, N, K);
  if (dtype == AscendC::DataType::BFLOAT16)
    return Pack(static_cast<uint16_t*>(dst), static_cast<const uint16_t*>(W), ldw, N, K);
  throw std::invalid_argument(std::string("pack_rows4: weight dtype must be float32 or bfloat16, got ") +
                              AscendC::DataTypeName(dtype));
}

}  // namespace atb
