// Portable C++ table of the quantized linear: 8-lane arrays in the AVX2
// table's chunk order, so the same loops run on any CPU (and the compiler
// vectorizes them for the baseline ISA).
#include <algorithm>
#include <cstdint>

#include "quant_simd.h"

namespace atb {
namespace {

struct VPortable {
  struct reg {
    float v[8];
  };
  static constexpr int kVecs = 4;
  static constexpr int kW4Off[4] = {0, 16, 8, 24};
  static constexpr int kW8Off[4] = {0, 8, 16, 24};
  static constexpr int kMB = 2, kNR1 = 2, kNR = 1;
  static reg zero() { return reg{}; }
  static reg load(const float* p) {
    reg r;
    for (int i = 0; i < 8; ++i) r.v[i] = p[i];
    return r;
  }
  static void store(float* p, reg a) {
    for (int i = 0; i < 8; ++i) p[i] = a.v[i];
  }
  static reg set1(float s) {
    reg r;
    for (int i = 0; i < 8; ++i) r.v[i] = s;
    return r;
  }
  // std::fma keeps the one-rounding dequantization of the SIMD tables (gguf-exact).
  static reg fma(reg a, reg b, reg c) {
    for (int i = 0; i < 8; ++i) c.v[i] = __builtin_fmaf(a.v[i], b.v[i], c.v[i]);
    return c;
  }
  static reg add(reg a, reg b) {
    for (int i = 0; i < 8; ++i) a.v[i] += b.v[i];
    return a;
  }
  static reg mul(reg a, reg b) {
    for (int i = 0; i < 8; ++i) a.v[i] *= b.v[i];
    return a;
  }
  static float hsum(reg a) {
    return ((a.v[0] + a.v[4]) + (a.v[2] + a.v[6])) + ((a.v[1] + a.v[5]) + (a.v[3] + a.v[7]));
  }
  static void UnpackW4(const uint8_t* q, reg w[4]) {
    for (int h = 0; h < 2; ++h)
      for (int i = 0; i < 8; ++i) {
        w[2 * h].v[i] = float(q[8 * h + i] & 0xF);
        w[2 * h + 1].v[i] = float(q[8 * h + i] >> 4);
      }
  }
  static void UnpackW8(const int8_t* q, reg w[4]) {
    for (int v = 0; v < 4; ++v)
      for (int i = 0; i < 8; ++i) w[v].v[i] = float(q[8 * v + i]);
  }
};

#include "quant_simd_impl.h"

constexpr QuantSimdOps kOps = MakeQuantOps<VPortable>("portable");

}  // namespace

const QuantSimdOps* QuantPortableOps() { return &kOps; }

}  // namespace atb
