// Storage types of the kernels' tensors and their fp32 conversions.
// half / bfloat16_t are 16-bit storage only: every kernel widens to fp32 to
// compute (the Ascend vector unit does the same for bf16) and narrows on the
// way out with round-to-nearest-even, matching torch's own casts bit for bit.
#pragma once
#include <cstdint>
#include <cstring>

#include "error.h"

namespace AscendC {

struct half { uint16_t bits; };
struct bfloat16_t { uint16_t bits; };

// Codes shared with Python (atb/kernels/_common.py DTYPE_CODES).
enum class DataType : int { FLOAT32 = 0, FLOAT16 = 1, BFLOAT16 = 2 };

inline const char* DataTypeName(DataType d) {
  switch (d) {
    case DataType::FLOAT32: return "float32";
    case DataType::FLOAT16: return "float16";
    case DataType::BFLOAT16: return "bfloat16";
  }
  return "unknown";
}
inline int64_t DataTypeSize(DataType d) { return d == DataType::FLOAT32 ? 4 : 2; }

inline float BitsToFloat(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
inline uint32_t FloatToBits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }

inline float ToFloat(float v) { return v; }
inline float ToFloat(bfloat16_t v) { return BitsToFloat(uint32_t(v.bits) << 16); }
inline float ToFloat(half v) {
  // IEEE binary16 -> binary32, including subnormals, inf and NaN.
  uint32_t h = v.bits, sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  if (exp == 0x1f) return BitsToFloat(sign | 0x7f800000u | (man << 13));
  if (exp == 0) {
    if (man == 0) return BitsToFloat(sign);
    float f = float(man) * (1.0f / 16777216.0f);  // man * 2^-24
    return sign ? -f : f;
  }
  return BitsToFloat(sign | ((exp + 112) << 23) | (man << 13));
}

template <typename T> inline T FromFloat(float f);
template <> inline float FromFloat<float>(float f) { return f; }
template <> inline bfloat16_t FromFloat<bfloat16_t>(float f) {
  uint32_t u = FloatToBits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bfloat16_t{uint16_t((u >> 16) | 0x40)};  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
  return bfloat16_t{uint16_t(u >> 16)};
}
template <> inline half FromFloat<half>(float f) {
  uint32_t u = FloatToBits(f), sign = (u >> 16) & 0x8000u, a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return half{uint16_t(sign | 0x7e00u)};
  if (a >= 0x477ff000u) return half{uint16_t(sign | 0x7c00u)};  // rounds to >= 65520: inf
  if (a < 0x38800000u) {  // result is subnormal (or zero) in binary16
    float m = BitsToFloat(a) * 16777216.0f;  // scale by 2^24: the subnormal mantissa, as a float
    uint32_t r = uint32_t(m);
    float frac = m - float(r);
    if (frac > 0.5f || (frac == 0.5f && (r & 1u))) ++r;
    return half{uint16_t(sign | r)};
  }
  uint32_t e = (a >> 23) - 112, man = a & 0x7fffffu;
  uint32_t h = (e << 10) | (man >> 13);
  uint32_t rest = man & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;
  return half{uint16_t(sign | h)};
}

// v rounded to T and back: the rounding a separate op storing T performs.
template <typename T> inline float RoundTo(float v) { return ToFloat(FromFloat<T>(v)); }
template <> inline float RoundTo<float>(float v) { return v; }

// bf16 bits of the integers 0..15, twice: a vpermw table turning 4-bit values into bf16 (vpermw indexes its
// 32 words by the low 5 bits of each index). Exact: small integers have no low mantissa bits.
inline void NibbleBf16Table(uint16_t t[32]) {
  for (int i = 0; i < 32; ++i) t[i] = FromFloat<bfloat16_t>(float(i & 15)).bits;
}

template <typename T> struct DataTypeOf;
template <> struct DataTypeOf<float> { static constexpr DataType value = DataType::FLOAT32; };
template <> struct DataTypeOf<half> { static constexpr DataType value = DataType::FLOAT16; };
template <> struct DataTypeOf<bfloat16_t> { static constexpr DataType value = DataType::BFLOAT16; };

// fn(T{}) with T the storage type of `dtype`: the one switch from a dtype to a kernel instantiation
// (call sites read T as decltype(tag)).
template <typename F>
decltype(auto) DispatchDtype(DataType dtype, F&& fn) {
  switch (dtype) {
    case DataType::FLOAT32: return fn(float{});
    case DataType::FLOAT16: return fn(half{});
    case DataType::BFLOAT16: return fn(bfloat16_t{});
  }
  ThrowError("no kernel for dtype code ", int(dtype));
}

}  // namespace AscendC
