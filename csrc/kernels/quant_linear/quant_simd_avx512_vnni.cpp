// The int16-x W4 GEMV on AVX512-VNNI (quant_simd.h: gemv_w4_i16 with x in kBytePlanes), which the
// avx512-i16 path takes where CPUID reports AVX512-VNNI. A file of its own so that only this code is
// compiled with VNNI enabled (pragma after every system header, everything in an anonymous namespace).
// It is compiled a second time by quant_simd_avx512_vnni_simde.cpp against SIMDe, whose portable
// implementations of the same intrinsics let a CPU without AVX-512 run this code's logic in the tests
// (the quantized path "avx512-i16-simde").
//
// Why bytes: the 256-bit int16 GEMV multiplies in vpmaddwd, 16 products per instruction, and with its
// unpacking that came to ~19 instructions per 64 weights: one core computed about 19 GB/s of W4 weights,
// the rate at which a DRAM stream arrives on two cores, so arithmetic and stream could not overlap and
// cold weights streamed at 70% of the read rate. A 512-bit port of the same instructions gained nothing
// here (Xeon, AMX generation: 512-bit integer multiplies issue on one port, 256-bit on two).
// vpdpbusd multiplies 64 unsigned bytes by 64 signed bytes and sums each 4 into int32 lanes: the nibbles,
// masked into bytes (0..15: both a u8 and an s8), meet x split into bytes, xq = 256 xh + xl with
// xh = xq >> 8 in [-128, 127] (s8) and xl = xq & 255 (u8):
//   sum_k q_k xq_k = 256 sum_k q_k xh_k + sum_k q_k xl_k      (dpbusd(q, xh), dpbusd(xl, q)),
// the same exact integers as the int16 route (a lane's 8 products: |sH| <= 8 * 15 * 128, |sL| <=
// 8 * 15 * 255, so |256 sH + sL| < 2^24 converts exactly), at 4 vpdpbusd per 128 weights.
// Xeon (AMX generation), 2 threads, TinyLlama-shaped W4 decode stream from DRAM in 2 MiB pages, ms per step
// (the 256-bit int16 GEMV -> this one), two runs: G32 26.6-27.2 -> 23.7-23.9, G128 24.4-24.7 -> 23.3-23.5;
// M = 2 35.8 -> 32.1, M = 4 62.0 -> 50.4.
#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "ascendc/block_prefetch.h"
#include "quant_simd.h"

#if defined(ATB_QUANT_SIMDE)
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>
#include <simde/x86/f16c.h>
#include <simde/x86/fma.h>
#define ATB_VNNI_W4_GEMV QuantAvx512VnniW4GemvSimde
#define ATB_VNNI_BUILT 1
#elif defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#define ATB_VNNI_W4_GEMV QuantAvx512VnniW4Gemv
#define ATB_VNNI_BUILT 1
#define ATB_VNNI_NATIVE 1
#endif

#if defined(ATB_VNNI_BUILT)
namespace atb {
namespace {

#include "quant_simd_impl.h"  // GroupSums

// The masked loads and the sum over lanes this GEMV uses, which SIMDe lacks: there, the same values
// through a zeroed buffer and a plain sum.
#if defined(ATB_QUANT_SIMDE)
inline __m512i LoadBytes(const uint8_t* p, int64_t n) {  // the first n <= 64 bytes at p, zeros above
  alignas(64) uint8_t t[64] = {};
  std::copy_n(p, n, t);
  return _mm512_load_si512(t);
}
inline __m128 LoadFloats4(const float* p, int64_t n) {  // the first n <= 4 floats at p, zeros above
  alignas(16) float t[4] = {};
  std::copy_n(p, n, t);
  return _mm_load_ps(t);
}
inline __m512 LoadFloats16(const float* p, int64_t n) {  // the first n <= 16 floats at p, zeros above
  alignas(64) float t[16] = {};
  std::copy_n(p, n, t);
  return _mm512_load_ps(t);
}
inline float ReduceAdd(__m512 v) {
  alignas(64) float t[16];
  _mm512_store_ps(t, v);
  float s = 0.0f;
  for (float f : t) s += f;
  return s;
}
#else
inline __m512i LoadBytes(const uint8_t* p, int64_t n) {
  return _mm512_maskz_loadu_epi8(n >= 64 ? ~__mmask64(0) : (__mmask64(1) << n) - 1, p);
}
inline __m128 LoadFloats4(const float* p, int64_t n) { return _mm_maskz_loadu_ps(__mmask8((1u << n) - 1), p); }
inline __m512 LoadFloats16(const float* p, int64_t n) {
  return _mm512_maskz_loadu_ps(__mmask16(n >= 16 ? 0xFFFFu : (1u << n) - 1), p);
}
inline float ReduceAdd(__m512 v) { return _mm512_reduce_add_ps(v); }
#endif

// The W4 min term, sum_g min[r][g] * xg[mb][g], added into the accumulator lanes before their one
// horizontal sum: 16 groups per FMA and a partial tail.
template <int NR, int MB>
__attribute__((always_inline)) inline void AddMinLanes(__m512 (&a)[NR][MB], const float* min, int64_t lds,
                                                       const float* xg, int64_t ldxg, int64_t ng) {
  for (int64_t g = 0; g < ng; g += 16) {
    const int64_t n = std::min<int64_t>(16, ng - g);
    __m512 x[MB];
    for (int mb = 0; mb < MB; ++mb) x[mb] = n == 16 ? _mm512_loadu_ps(xg + mb * ldxg + g) : LoadFloats16(xg + mb * ldxg + g, n);
    for (int r = 0; r < NR; ++r) {
      const __m512 m = n == 16 ? _mm512_loadu_ps(min + r * lds + g) : LoadFloats16(min + r * lds + g, n);
      for (int mb = 0; mb < MB; ++mb) a[r][mb] = _mm512_fmadd_ps(m, x[mb], a[r][mb]);
    }
  }
}

#include "ascendc/simd_hsum4.h"  // HSum4

// The first n of four floats at p (all four when kFull) spread over the lanes as idx picks them.
template <bool kFull>
__attribute__((always_inline)) inline __m512 Lanes(const float* p, int64_t n, __m512i idx) {
  return _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(kFull && n == 4 ? _mm_loadu_ps(p) : LoadFloats4(p, n)));
}

// Chunks [c, c + n) of NR weight rows x MB rows of x into the accumulators a, n <= 4 (kFull: n == 4).
// One 64-byte load is four chunks of a row as stored (a cache line, and one prefetch step); lo = its bytes &
// 0xF are values j of chunk i at byte 16 i + j, hi = (bytes >> 4) & 0xF values j + 16, and x's planes hold
// its bytes in that order (InterleaveXInt16ForW4, kBytePlanes), so int32 lanes 4i..4i+3 of the four vpdpbusd
// sum chunk i. Each lane's sum is scaled by its chunk's group scale times x's chunk scale (kXScaled: already
// folded) into the accumulator, whatever the group size (CPG chunks per group): at G = 64 a load's two
// halves are two groups, at G = 128 one (loads start at chunks 4p, so none crosses a G = 128 group). A last
// load of fewer than four chunks is masked: its weights and scales past kLen read as zeros, as x's planes are.
template <int NR, int MB, int CPG, bool kXScaled, bool kFull>
__attribute__((always_inline)) inline void BytesStep(__m512 (&a)[NR][MB], int64_t c, int64_t n, const int16_t* x,
                                                     int64_t ldx, const float* xsc, int64_t ldxc, const uint8_t* q,
                                                     int64_t ldq, const float* scale, int64_t lds) {
  const __m512i nibble = _mm512_set1_epi8(0xF), zero = _mm512_setzero_si512();
  // Lane i of a load's sums is chunk i / 4 of the load; its group, entry i / (4 CPG) of the scales from
  // chunk c's group on.
  const __m512i chunkLane = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
  const __m512i groupLane = CPG == 1 ? chunkLane : _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
  const int64_t groups = (n + CPG - 1) / CPG;  // loads start at a group's first chunk
  __m512i xl[MB][2], xh[MB][2];
  __m512 xs[MB];
#pragma GCC unroll 4
  for (int mb = 0; mb < MB; ++mb) {
    const auto* planes = reinterpret_cast<const __m512i*>(x + mb * ldx) + c;  // 4 planes of 64 bytes per load
    xl[mb][0] = _mm512_loadu_si512(planes);
    xl[mb][1] = _mm512_loadu_si512(planes + 1);
    xh[mb][0] = _mm512_loadu_si512(planes + 2);
    xh[mb][1] = _mm512_loadu_si512(planes + 3);
    if constexpr (!kXScaled) xs[mb] = Lanes<kFull>(xsc + mb * ldxc + c, n, chunkLane);
  }
#pragma GCC unroll 8
  for (int r = 0; r < NR; ++r) {
    const uint8_t* qc = q + r * ldq + c * 16;
    const __m512i v = kFull ? _mm512_loadu_si512(qc) : LoadBytes(qc, 16 * n);
    const __m512i lo = _mm512_and_si512(v, nibble), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
    const float* gp = scale + r * lds + c / CPG;
    const __m512 gs = CPG >= 4 ? _mm512_set1_ps(*gp) : Lanes<kFull && CPG == 1>(gp, groups, groupLane);
#pragma GCC unroll 4
    for (int mb = 0; mb < MB; ++mb) {
      const __m512i sl = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(zero, xl[mb][0], lo), xl[mb][1], hi);
      const __m512i sh = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(zero, lo, xh[mb][0]), hi, xh[mb][1]);
      const __m512 s = _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_slli_epi32(sh, 8), sl));
      a[r][mb] = _mm512_fmadd_ps(s, kXScaled ? gs : _mm512_mul_ps(xs[mb], gs), a[r][mb]);
    }
  }
}

// NR weight rows x MB rows of x over kLen values: the loads of BytesStep, then the W4 min term and the sums.
template <int NR, int MB, int CPG, bool kXScaled, int64_t FarBytes>
void GemvW4BytesBlock(float* y, int64_t ldy, const int16_t* x, int64_t ldx, const float* xsc, int64_t ldxc,
                      const float* xg, int64_t ldxg, const uint8_t* q, int64_t ldq, const float* scale,
                      const float* min, int64_t lds, int64_t kLen, int64_t G, bool accumulate) {
  __m512 a[NR][MB];
  for (int r = 0; r < NR; ++r)
    for (int mb = 0; mb < MB; ++mb) a[r][mb] = _mm512_setzero_ps();
  const AscendC::BlockPrefetch<NR> prefetch(q, ldq, kLen / 2);
  const AscendC::BlockPrefetch<NR, 2> farPrefetch(q, ldq, kLen / 2, int(std::max<int64_t>(1, FarBytes / (NR * ldq))));
  const int64_t nc = kLen / 32;
  int64_t c = 0;
  for (; c + 4 <= nc; c += 4) {
    prefetch.At(c * 16);
    farPrefetch.At(c * 16);
    BytesStep<NR, MB, CPG, kXScaled, true>(a, c, 4, x, ldx, xsc, ldxc, q, ldq, scale, lds);
  }
  if (c < nc) BytesStep<NR, MB, CPG, kXScaled, false>(a, c, nc - c, x, ldx, xsc, ldxc, q, ldq, scale, lds);
  AddMinLanes<NR, MB>(a, min, lds, xg, ldxg, (kLen + G - 1) / G);
  for (int mb = 0; mb < MB; ++mb) {
    float* o = y + mb * ldy;
    auto half = [&](int r) __attribute__((always_inline)) {  // 16 lanes folded to 8
      return _mm256_add_ps(_mm512_castps512_ps256(a[r][mb]),
                           _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a[r][mb]), 1)));
    };
    if constexpr (NR == 4) {
      const __m128 v = HSum4(half(0), half(1), half(2), half(3));
      _mm_storeu_ps(o, accumulate ? _mm_add_ps(_mm_loadu_ps(o), v) : v);
    } else {
      for (int r = 0; r < NR; ++r) {
        const float v = ReduceAdd(a[r][mb]);
        o[r] = accumulate ? o[r] + v : v;
      }
    }
  }
}

struct BytePlaneBlocks {
  // At M == 1, rows longer than this (TinyLlama's down_proj, K = 5632: 2816 bytes) go 2 at a time: fewer
  // streams in flight. Xeon (AMX generation), 2 threads, TinyLlama-shaped W4 G32 decode stream from DRAM in
  // 2 MiB pages, down_proj ms per step, 4 rows -> 2, two runs: 6.96 / 6.84 -> 6.20 / 6.25 (gate/up, K = 2048:
  // 11.8 -> 12.0, so they keep 4).
  static constexpr int64_t kFourRowsMaxBytes = 2048;
  template <int Bits, int NR, int MB, bool kGroupPerChunk, bool kXScaled, int64_t FarBytes>
  static void Block(float* y, int64_t ldy, const int16_t* x, int64_t ldx, const float* xsc, int64_t ldxc,
                    const float* xg, int64_t ldxg, const uint8_t* q, int64_t ldq, const float* scale,
                    const float* min, int64_t lds, int64_t kLen, int64_t G, bool accumulate) {
    static_assert(Bits == 4, "the byte-plane GEMV is W4's");
    auto block = G == 32   ? GemvW4BytesBlock<NR, MB, 1, kXScaled, FarBytes>
                 : G == 64 ? GemvW4BytesBlock<NR, MB, 2, false, FarBytes>
                           : GemvW4BytesBlock<NR, MB, 4, false, FarBytes>;
    block(y, ldy, x, ldx, xsc, ldxc, xg, ldxg, q, ldq, scale, min, lds, kLen, G, accumulate);
  }
};

#include "quant_gemv_i16.h"  // GemvI16

void GemvW4Bytes(float* y, int64_t ldy, const int16_t* x, int64_t ldx, const float* xsc, int64_t ldxc,
                 const float* xsum, int64_t ldxs, const uint8_t* q, int64_t ldq, const QuantScaleRows& sc, int64_t M,
                 int64_t N, int64_t kLen, int64_t G, bool acc) {
  GemvI16<BytePlaneBlocks, 4, kAvx512HostFarBytes>(y, ldy, x, ldx, xsc, ldxc, xsum, ldxs, q, ldq, sc, M, N, kLen, G,
                                                   acc);
}

}  // namespace

decltype(QuantSimdOps::gemv_w4_i16) ATB_VNNI_W4_GEMV() { return GemvW4Bytes; }

}  // namespace atb

#if defined(ATB_VNNI_NATIVE)
#pragma GCC diagnostic pop
#pragma GCC pop_options
#endif

#else
namespace atb {
decltype(QuantSimdOps::gemv_w4_i16) QuantAvx512VnniW4Gemv() { return nullptr; }
}  // namespace atb
#endif
