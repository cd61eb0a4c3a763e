// Portable table: plain loops the compiler vectorizes for the baseline ISA.
// It is the fallback on CPUs without AVX2 (and all of aarch64) and the
// reference the AVX2 table is tested against.
#include <cmath>
#include <cstring>

#include "dtype.h"
#include "simd.h"

namespace AscendC {
namespace {

void Add(float* d, const float* a, const float* b, int64_t n) { for (int64_t i = 0; i < n; ++i) d[i] = a[i] + b[i]; }
void Sub(float* d, const float* a, const float* b, int64_t n) { for (int64_t i = 0; i < n; ++i) d[i] = a[i] - b[i]; }
void Mul(float* d, const float* a, const float* b, int64_t n) { for (int64_t i = 0; i < n; ++i) d[i] = a[i] * b[i]; }
void Max(float* d, const float* a, const float* b, int64_t n) { for (int64_t i = 0; i < n; ++i) d[i] = a[i] > b[i] ? a[i] : b[i]; }
void Muls(float* d, const float* a, float s, int64_t n) { for (int64_t i = 0; i < n; ++i) d[i] = a[i] * s; }
void Adds(float* d, const float* a, float s, int64_t n) { for (int64_t i = 0; i < n; ++i) d[i] = a[i] + s; }
void Axpy(float* d, const float* a, float s, int64_t n) { for (int64_t i = 0; i < n; ++i) d[i] += s * a[i]; }
void Exp(float* d, const float* a, int64_t n) { for (int64_t i = 0; i < n; ++i) d[i] = std::exp(a[i]); }
void Silu(float* d, const float* a, int64_t n) { for (int64_t i = 0; i < n; ++i) d[i] = a[i] / (1.0f + std::exp(-a[i])); }
void SiluMul(float* d, const float* g, const float* u, int64_t n) {
  for (int64_t i = 0; i < n; ++i) d[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
}
void Duplicate(float* d, float v, int64_t n) { for (int64_t i = 0; i < n; ++i) d[i] = v; }

// Eight partial sums: the same association the SIMD paths use, so results
// differ between tables only by the last bits of rounding, not by order effects.
template <typename F>
float Reduce8(int64_t n, F term) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j) acc[j] += term(i + j);
  float s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
  for (; i < n; ++i) s += term(i);
  return s;
}
float ReduceSum(const float* a, int64_t n) { return Reduce8(n, [&](int64_t i) { return a[i]; }); }
float SumSquares(const float* a, int64_t n) { return Reduce8(n, [&](int64_t i) { return a[i] * a[i]; }); }
float Dot(const float* a, const float* b, int64_t n) { return Reduce8(n, [&](int64_t i) { return a[i] * b[i]; }); }
float ReduceMax(const float* a, int64_t n) {
  float m = -INFINITY;
  for (int64_t i = 0; i < n; ++i) m = a[i] > m ? a[i] : m;
  return m;
}

void F16ToF32(float* d, const uint16_t* s, int64_t n) { for (int64_t i = 0; i < n; ++i) d[i] = ToFloat(half{s[i]}); }
void Bf16ToF32(float* d, const uint16_t* s, int64_t n) { for (int64_t i = 0; i < n; ++i) d[i] = BitsToFloat(uint32_t(s[i]) << 16); }
void F32ToF16(uint16_t* d, const float* s, int64_t n) { for (int64_t i = 0; i < n; ++i) d[i] = FromFloat<half>(s[i]).bits; }
void F32ToBf16(uint16_t* d, const float* s, int64_t n) { for (int64_t i = 0; i < n; ++i) d[i] = FromFloat<bfloat16_t>(s[i]).bits; }

inline float Load(const float* p) { return *p; }
inline float LoadH(const uint16_t* p) { return ToFloat(half{*p}); }
inline float LoadB(const uint16_t* p) { return BitsToFloat(uint32_t(*p) << 16); }

template <typename TB, float (*L)(const TB*)>
void MmadNT(float* C, int64_t ldc, const float* A, int64_t lda, const TB* B, int64_t ldb, int64_t M, int64_t N,
            int64_t K, bool acc) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      const float* a = A + m * lda;
      const TB* b = B + n * ldb;
      float s = Reduce8(K, [&](int64_t k) { return a[k] * L(b + k); });
      C[m * ldc + n] = acc ? C[m * ldc + n] + s : s;
    }
}

template <typename TB, float (*L)(const TB*)>
void MmadNN(float* C, int64_t ldc, const float* A, int64_t lda, const TB* B, int64_t ldb, int64_t M, int64_t N,
            int64_t K, bool acc) {
  for (int64_t m = 0; m < M; ++m) {
    float* c = C + m * ldc;
    if (!acc) Duplicate(c, 0.0f, N);
    for (int64_t k = 0; k < K; ++k) {
      float a = A[m * lda + k];
      const TB* b = B + k * ldb;
      for (int64_t n = 0; n < N; ++n) c[n] += a * L(b + n);
    }
  }
}

// fp32 products are already rounded; the empty asm only keeps the compiler
// from fusing them with the following add into an FMA (aarch64 would).
struct F32S {
  using T = float;
  static float L(const float* p) { return *p; }
  static void S(float* p, float v) { *p = v; }
  static float Round(float v) {
#if defined(__x86_64__)
    __asm__("" : "+x"(v));
#elif defined(__aarch64__)
    __asm__("" : "+w"(v));
#endif
    return v;
  }
};
struct F16S {
  using T = uint16_t;
  static float L(const uint16_t* p) { return ToFloat(half{*p}); }
  static void S(uint16_t* p, float v) { *p = FromFloat<half>(v).bits; }
  static float Round(float v) { return ToFloat(FromFloat<half>(v)); }
};
struct Bf16S {
  using T = uint16_t;
  static float L(const uint16_t* p) { return BitsToFloat(uint32_t(*p) << 16); }
  static void S(uint16_t* p, float v) { *p = FromFloat<bfloat16_t>(v).bits; }
  static float Round(float v) { return ToFloat(FromFloat<bfloat16_t>(v)); }
};

template <class S>
void Rope(typename S::T* dst, const typename S::T* src, const float* cos, const float* sin, int64_t rows,
          int64_t pitch, int64_t headDim, int64_t rotary, bool interleave) {
  using T = typename S::T;
  for (int64_t r = 0; r < rows; ++r) {
    const T* x = src + r * pitch;
    T* y = dst + r * pitch;
    // Pairs (i, j) rotate together: neox (i, i + rotary/2), interleave (2i, 2i + 1).
    int64_t pairs = rotary / 2, step = interleave ? 2 : 1, off = interleave ? 1 : pairs;
    for (int64_t p = 0; p < pairs; ++p) {
      int64_t i = p * step, j = i + off;
      float xi = S::L(x + i), xj = S::L(x + j);
      S::S(y + i, S::Round(xi * cos[i]) - S::Round(xj * sin[i]));
      S::S(y + j, S::Round(xj * cos[j]) + S::Round(xi * sin[j]));
    }
    if (y != x && rotary < headDim) std::memcpy(y + rotary, x + rotary, size_t(headDim - rotary) * sizeof(T));
  }
}

template <class S>
void SiluMulT(uint16_t* d, const uint16_t* g, const uint16_t* u, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    float x = S::L(g + i);
    S::S(d + i, S::Round(x / (1.0f + std::exp(-x))) * S::L(u + i));
  }
}

// swiglu_out / residual_out (simd.h): SiluMulT's and add's steps on the rounded sums.
template <class S>
void SwigluOut(uint16_t* d, const float* g, const float* u, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    float x = S::Round(g[i]);
    S::S(d + i, S::Round(x / (1.0f + std::exp(-x))) * S::Round(u[i]));
  }
}
template <class S>
void ResidualOut(uint16_t* d, const float* a, const uint16_t* r, int64_t n) {
  for (int64_t i = 0; i < n; ++i) S::S(d + i, S::Round(a[i]) + S::L(r + i));
}

template <class S>
void RmsScaleOut(uint16_t* d, const float* h, const float* w, float rstd, int64_t n) {
  for (int64_t i = 0; i < n; ++i) S::S(d + i, S::Round(h[i] * rstd) * w[i]);
}

// Lanes as the AVX2 table keeps them: lane j sums k = j, j + 8, ... in order.
template <typename TB, float (*L)(const TB*)>
void MmadNTLanes(float* lanes, const float* A, int64_t lda, const TB* B, int64_t ldb, int64_t M, int64_t N, int64_t K,
                 bool acc) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      float* l = lanes + (m * N + n) * 8;
      const float* a = A + m * lda;
      const TB* b = B + n * ldb;
      for (int j = 0; j < 8; ++j) {
        float s = acc ? l[j] : 0.0f;
        for (int64_t k = j; k < K; k += 8) s += a[k] * L(b + k);
        l[j] = s;
      }
    }
}

void MmadTN(float* C, int64_t ldc, const float* A, int64_t lda, const float* B, int64_t ldb, int64_t M, int64_t N,
            int64_t K, bool acc) {
  for (int64_t m = 0; m < M; ++m) {
    float* c = C + m * ldc;
    if (!acc) Duplicate(c, 0.0f, N);
    for (int64_t k = 0; k < K; ++k) {
      float a = A[k * lda + m];
      const float* b = B + k * ldb;
      for (int64_t n = 0; n < N; ++n) c[n] += a * b[n];
    }
  }
}

bool ColMax(float* m, const float* S, int64_t ld, int64_t rows, int64_t n) {
  bool nan = false;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < n; ++c) {
      float v = S[r * ld + c];
      nan |= std::isnan(v);
      if (v > m[c]) m[c] = v;
    }
  return nan;
}

void ExpSubAcc(float* d, const float* S, int64_t ld, const float* b, float* sum, int64_t rows, int64_t n) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < n; ++c) {
      float x = S[r * ld + c] - b[c];
      d[r * ld + c] = std::isnan(x) ? 0.0f : std::exp(x);
      sum[c] += d[r * ld + c];
    }
}

void SumLanes8(float* d, const float* l, int64_t n) {
  for (int64_t i = 0; i < n; ++i, l += 8) d[i] = ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
}

template <typename TB, float (*L)(const TB*)>
void TransposeWiden(float* dst, int64_t ldd, const TB* src, int64_t lds, int64_t N, int64_t K) {
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K; ++k) dst[k * ldd + n] = L(src + n * lds + k);
}

#include "simd_read_sum.h"  // ReadSumRuns

struct LineWords {
  using V = uint64_t;
  static V Zero() { return 0; }
  static V Add(V a, V b) { return a + b; }
  static V Load(const uint64_t* p) {
    V sum = 0;
    for (int i = 0; i < 8; ++i) sum += p[i];
    return sum;
  }
  static uint64_t Sum(V v) { return v; }
};

const SimdOps kPortable = {
    "portable", Add, Sub, Mul, Max, Muls, Adds, Axpy, Exp, Silu, SiluMul, Duplicate,
    ReduceSum, ReduceMax, SumSquares, Dot, F16ToF32, Bf16ToF32, F32ToF16, F32ToBf16,
    MmadNT<float, Load>, MmadNT<uint16_t, LoadH>, MmadNT<uint16_t, LoadB>,
    MmadNN<float, Load>, MmadNN<uint16_t, LoadH>, MmadNN<uint16_t, LoadB>,
    Rope<F32S>, Rope<F16S>, Rope<Bf16S>, SiluMulT<F16S>, SiluMulT<Bf16S>,
    SwigluOut<F16S>, SwigluOut<Bf16S>, ResidualOut<F16S>, ResidualOut<Bf16S>, RmsScaleOut<F16S>, RmsScaleOut<Bf16S>,
    MmadNTLanes<float, Load>, MmadNTLanes<uint16_t, LoadH>, MmadNTLanes<uint16_t, LoadB>,
    MmadNT<float, Load>, MmadNT<uint16_t, LoadH>, MmadNT<uint16_t, LoadB>,  // mmad_nt_rows: one row at a time already
    MmadNN<float, Load>, MmadNN<uint16_t, LoadH>, MmadNN<uint16_t, LoadB>,  // mmad_nn_rows
    MmadTN, ColMax, ExpSubAcc, SumLanes8,
    TransposeWiden<float, Load>, TransposeWiden<uint16_t, LoadH>, TransposeWiden<uint16_t, LoadB>, ReadSumRuns<LineWords>,
};

}  // namespace

const SimdOps* PortableSimdOps() { return &kPortable; }

}  // namespace AscendC
