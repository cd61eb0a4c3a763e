// AscendC vector and cube APIs over LocalTensors, executed by the SIMD table.
// Names and argument order follow AscendC (dst first, count last).
#pragma once
#include <cstdint>

#include "simd.h"
#include "tensor.h"

namespace AscendC {

using LocalF = LocalTensor<float>;

inline void Add(const LocalF& d, const LocalF& a, const LocalF& b, int64_t n) { Simd().add(d.GetPhyAddr(), a.GetPhyAddr(), b.GetPhyAddr(), n); }
inline void Sub(const LocalF& d, const LocalF& a, const LocalF& b, int64_t n) { Simd().sub(d.GetPhyAddr(), a.GetPhyAddr(), b.GetPhyAddr(), n); }
inline void Mul(const LocalF& d, const LocalF& a, const LocalF& b, int64_t n) { Simd().mul(d.GetPhyAddr(), a.GetPhyAddr(), b.GetPhyAddr(), n); }
inline void Max(const LocalF& d, const LocalF& a, const LocalF& b, int64_t n) { Simd().max(d.GetPhyAddr(), a.GetPhyAddr(), b.GetPhyAddr(), n); }
inline void Muls(const LocalF& d, const LocalF& a, float s, int64_t n) { Simd().muls(d.GetPhyAddr(), a.GetPhyAddr(), s, n); }
inline void Adds(const LocalF& d, const LocalF& a, float s, int64_t n) { Simd().adds(d.GetPhyAddr(), a.GetPhyAddr(), s, n); }
inline void Axpy(const LocalF& d, const LocalF& a, float s, int64_t n) { Simd().axpy(d.GetPhyAddr(), a.GetPhyAddr(), s, n); }
inline void Exp(const LocalF& d, const LocalF& a, int64_t n) { Simd().exp(d.GetPhyAddr(), a.GetPhyAddr(), n); }
inline void Silu(const LocalF& d, const LocalF& a, int64_t n) { Simd().silu(d.GetPhyAddr(), a.GetPhyAddr(), n); }
inline void SiluMul(const LocalF& d, const LocalF& g, const LocalF& u, int64_t n) { Simd().silu_mul(d.GetPhyAddr(), g.GetPhyAddr(), u.GetPhyAddr(), n); }
inline void Duplicate(const LocalF& d, float v, int64_t n) { Simd().duplicate(d.GetPhyAddr(), v, n); }
inline float ReduceSum(const LocalF& a, int64_t n) { return Simd().reduce_sum(a.GetPhyAddr(), n); }
inline float ReduceMax(const LocalF& a, int64_t n) { return Simd().reduce_max(a.GetPhyAddr(), n); }
// sum(a*a): Mul + ReduceSum fused, as AscendC kernels get from one vector pass.
inline float SumSquares(const LocalF& a, int64_t n) { return Simd().sum_squares(a.GetPhyAddr(), n); }
inline float Dot(const LocalF& a, const LocalF& b, int64_t n) { return Simd().dot(a.GetPhyAddr(), b.GetPhyAddr(), n); }
// An online softmax's passes over a score tile s [rows][n] (rows ld apart), vertical over its columns:
// m = max(m, column max of s), returning whether s holds a NaN; then d = exp(s - b), sum += column sums of d.
inline bool ColMax(const LocalF& m, const LocalF& s, int64_t ld, int64_t rows, int64_t n) {
  return Simd().col_max(m.GetPhyAddr(), s.GetPhyAddr(), ld, rows, n);
}
inline void ExpSubAcc(const LocalF& d, const LocalF& s, int64_t ld, const LocalF& b, const LocalF& sum, int64_t rows,
                      int64_t n) {
  Simd().exp_sub_acc(d.GetPhyAddr(), s.GetPhyAddr(), ld, b.GetPhyAddr(), sum.GetPhyAddr(), rows, n);
}

// Cast between fp32 and the storage types (round-to-nearest-even, CAST_RINT).
enum class RoundMode { CAST_NONE, CAST_RINT };
template <typename D, typename S>
inline void CastRaw(D* d, const S* s, int64_t n);
template <> inline void CastRaw<float, float>(float* d, const float* s, int64_t n) { if (d != s) Simd().muls(d, s, 1.0f, n); }
template <> inline void CastRaw<float, half>(float* d, const half* s, int64_t n) { Simd().f16_to_f32(d, reinterpret_cast<const uint16_t*>(s), n); }
template <> inline void CastRaw<float, bfloat16_t>(float* d, const bfloat16_t* s, int64_t n) { Simd().bf16_to_f32(d, reinterpret_cast<const uint16_t*>(s), n); }
template <> inline void CastRaw<half, float>(half* d, const float* s, int64_t n) { Simd().f32_to_f16(reinterpret_cast<uint16_t*>(d), s, n); }
template <> inline void CastRaw<bfloat16_t, float>(bfloat16_t* d, const float* s, int64_t n) { Simd().f32_to_bf16(reinterpret_cast<uint16_t*>(d), s, n); }

template <typename D, typename S>
inline void Cast(const LocalTensor<D>& d, const LocalTensor<S>& s, RoundMode, int64_t n) {
  CastRaw<D, S>(d.GetPhyAddr(), s.GetPhyAddr(), n);
}

// Fused elementwise ops in the storage type (see SimdOps::rope_* / silu_mul_*).
// One pass over the tile instead of Cast/Mul/Cast chains: at 64-128-element
// heads a chain of ~10 vector calls costs more than the data movement.
inline void RopeRaw(float* d, const float* s, const float* c, const float* sn, int64_t rows, int64_t pitch,
                    int64_t headDim, int64_t rotary, bool interleave) {
  Simd().rope_f32(d, s, c, sn, rows, pitch, headDim, rotary, interleave);
}
inline void RopeRaw(half* d, const half* s, const float* c, const float* sn, int64_t rows, int64_t pitch,
                    int64_t headDim, int64_t rotary, bool interleave) {
  Simd().rope_f16(reinterpret_cast<uint16_t*>(d), reinterpret_cast<const uint16_t*>(s), c, sn, rows, pitch, headDim,
                  rotary, interleave);
}
inline void RopeRaw(bfloat16_t* d, const bfloat16_t* s, const float* c, const float* sn, int64_t rows, int64_t pitch,
                    int64_t headDim, int64_t rotary, bool interleave) {
  Simd().rope_bf16(reinterpret_cast<uint16_t*>(d), reinterpret_cast<const uint16_t*>(s), c, sn, rows, pitch, headDim,
                   rotary, interleave);
}
inline void SiluMulRaw(float* d, const float* g, const float* u, int64_t n) { Simd().silu_mul(d, g, u, n); }
inline void SiluMulRaw(half* d, const half* g, const half* u, int64_t n) {
  Simd().silu_mul_f16(reinterpret_cast<uint16_t*>(d), reinterpret_cast<const uint16_t*>(g),
                      reinterpret_cast<const uint16_t*>(u), n);
}
inline void SiluMulRaw(bfloat16_t* d, const bfloat16_t* g, const bfloat16_t* u, int64_t n) {
  Simd().silu_mul_bf16(reinterpret_cast<uint16_t*>(d), reinterpret_cast<const uint16_t*>(g),
                       reinterpret_cast<const uint16_t*>(u), n);
}
// The linear epilogues from fp32 sums (SimdOps::swiglu_out_* / residual_out_*; fp32 has nothing to round).
inline void SwigluOutRaw(float* d, const float* g, const float* u, int64_t n) { Simd().silu_mul(d, g, u, n); }
inline void SwigluOutRaw(half* d, const float* g, const float* u, int64_t n) {
  Simd().swiglu_out_f16(reinterpret_cast<uint16_t*>(d), g, u, n);
}
inline void SwigluOutRaw(bfloat16_t* d, const float* g, const float* u, int64_t n) {
  Simd().swiglu_out_bf16(reinterpret_cast<uint16_t*>(d), g, u, n);
}
inline void ResidualOutRaw(float* d, const float* a, const float* r, int64_t n) { Simd().add(d, a, r, n); }
inline void ResidualOutRaw(half* d, const float* a, const half* r, int64_t n) {
  Simd().residual_out_f16(reinterpret_cast<uint16_t*>(d), a, reinterpret_cast<const uint16_t*>(r), n);
}
inline void ResidualOutRaw(bfloat16_t* d, const float* a, const bfloat16_t* r, int64_t n) {
  Simd().residual_out_bf16(reinterpret_cast<uint16_t*>(d), a, reinterpret_cast<const uint16_t*>(r), n);
}
// RMSNorm's output from its fp32 row h (scaled in place for fp32) and weight w (SimdOps::rms_scale_out_*).
inline void RmsScaleOutRaw(float* d, float* h, const float* w, float rstd, int64_t n) {
  Simd().muls(h, h, rstd, n);
  Simd().mul(d, h, w, n);
}
inline void RmsScaleOutRaw(half* d, float* h, const float* w, float rstd, int64_t n) {
  Simd().rms_scale_out_f16(reinterpret_cast<uint16_t*>(d), h, w, rstd, n);
}
inline void RmsScaleOutRaw(bfloat16_t* d, float* h, const float* w, float rstd, int64_t n) {
  Simd().rms_scale_out_bf16(reinterpret_cast<uint16_t*>(d), h, w, rstd, n);
}

// Mmad, the cube unit: C (fp32) = or += A (fp32) x B^T / B, B in storage type T.
template <typename T> struct MmadTable;
template <> struct MmadTable<float> {
  static auto NT() { return Simd().mmad_nt_f32; }
  static auto NN() { return Simd().mmad_nn_f32; }
  static auto NTRows() { return Simd().mmad_nt_rows_f32; }
  static auto NNRows() { return Simd().mmad_nn_rows_f32; }
};
template <> struct MmadTable<half> {
  static auto NT() { return Simd().mmad_nt_f16; }
  static auto NN() { return Simd().mmad_nn_f16; }
  static auto NTRows() { return Simd().mmad_nt_rows_f16; }
  static auto NNRows() { return Simd().mmad_nn_rows_f16; }
};
template <> struct MmadTable<bfloat16_t> {
  static auto NT() { return Simd().mmad_nt_bf16; }
  static auto NN() { return Simd().mmad_nn_bf16; }
  static auto NTRows() { return Simd().mmad_nt_rows_bf16; }
  static auto NNRows() { return Simd().mmad_nn_rows_bf16; }
};
template <typename T> inline auto StorageBits(const T* p) { return p; }
inline auto StorageBits(const half* p) { return reinterpret_cast<const uint16_t*>(p); }
inline auto StorageBits(const bfloat16_t* p) { return reinterpret_cast<const uint16_t*>(p); }

struct MmadParams {
  int64_t m, n, k;
  int64_t lda, ldb, ldc;  // leading dimensions, in elements
  bool accumulate;
};
// C[m][n] (+)= sum_k A[m][k] * B[n][k]. B may be a GM tile: on the CPU the
// cube reads its B operand where it lies (the L1/L0B copy is the cache itself).
template <typename T>
inline void MmadNT(float* C, const float* A, const T* B, const MmadParams& p) {
  MmadTable<T>::NT()(C, p.ldc, A, p.lda, StorageBits(B), p.ldb, p.m, p.n, p.k, p.accumulate);
}
// MmadNT for few A rows (<= 8 per pass): each B row is widened once for all of them.
template <typename T>
inline void MmadNTRows(float* C, const float* A, const T* B, const MmadParams& p) {
  MmadTable<T>::NTRows()(C, p.ldc, A, p.lda, StorageBits(B), p.ldb, p.m, p.n, p.k, p.accumulate);
}
// MmadNN for few A rows (<= 8 per pass): each B panel is widened once for all of them.
template <typename T>
inline void MmadNNRows(float* C, const float* A, const T* B, const MmadParams& p) {
  MmadTable<T>::NNRows()(C, p.ldc, A, p.lda, StorageBits(B), p.ldb, p.m, p.n, p.k, p.accumulate);
}
// C[m][n] (+)= sum_k A[m][k] * B[k][n].
template <typename T>
inline void MmadNN(float* C, const float* A, const T* B, const MmadParams& p) {
  MmadTable<T>::NN()(C, p.ldc, A, p.lda, StorageBits(B), p.ldb, p.m, p.n, p.k, p.accumulate);
}
// C[m][n] (+)= sum_k A[k][m] * B[k][n], all fp32 (A is held transposed in UB).
inline void MmadTN(float* C, const float* A, const float* B, const MmadParams& p) {
  Simd().mmad_tn_f32(C, p.ldc, A, p.lda, B, p.ldb, p.m, p.n, p.k, p.accumulate);
}

}  // namespace AscendC
