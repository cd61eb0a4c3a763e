// AVX2 + FMA table of the quantized linear (pragma-scoped target features, as
// in quant_simd_avx512.cpp); selected when CPUID reports AVX2, FMA and F16C.
#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "ascendc/block_prefetch.h"
#include "quant_simd.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

namespace atb {
namespace {

struct V256 {
  using reg = __m256;
  static constexpr int kVecs = 4;
  // 8 bytes widen to 8 lanes: low nibbles are values 0..7 (then 8..15), high nibbles 16..23 (then 24..31).
  static constexpr int kW4Off[4] = {0, 16, 8, 24};
  static constexpr int kW8Off[4] = {0, 8, 16, 24};
  static constexpr int kMB = 2, kNR1 = 2, kNR = 1;  // 16 ymm registers
  static reg zero() { return _mm256_setzero_ps(); }
  static reg load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, reg v) { _mm256_storeu_ps(p, v); }
  static reg set1(float v) { return _mm256_set1_ps(v); }
  static reg fma(reg a, reg b, reg c) { return _mm256_fmadd_ps(a, b, c); }
  static reg add(reg a, reg b) { return _mm256_add_ps(a, b); }
  static reg mul(reg a, reg b) { return _mm256_mul_ps(a, b); }
  static float hsum(reg v) {
    __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    return _mm_cvtss_f32(_mm_add_ss(lo, _mm_movehdup_ps(lo)));
  }
  static void UnpackW4(const uint8_t* q, reg w[4]) {
    const __m256i mask = _mm256_set1_epi32(0xF);
    for (int h = 0; h < 2; ++h) {
      __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * h)));
      w[2 * h] = _mm256_cvtepi32_ps(_mm256_and_si256(b, mask));
      w[2 * h + 1] = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
    }
  }
  static void UnpackW8(const int8_t* q, reg w[4]) {
    for (int v = 0; v < 4; ++v)
      w[v] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * v))));
  }
};

#include "quant_simd_impl.h"

// The W4 min term, sum_g min[r][g] * xg[mb][g], added into the accumulator lanes before their one
// horizontal sum: 8 groups per FMA and a masked tail (K = 576 has 18 groups), where it was a separate
// dot with a scalar tail and its own horizontal sum. With HSum4 (the 4-row block's sums in one vector,
// one store), Zen 3, one thread, weights in L2, interleaved medians of 61 rounds: W4 G = 32 480x576
// 20.3 -> 17.6 us, 288x1536 1.08-1.12x; G = 128 1.10x; W8 (no min term) per channel 1.06x, G = 32 1.10x.
// Groups outer and the block's rows and x rows unrolled inside, so the accumulators stay in registers:
// with the rows outer GCC kept them in the block's stack frame and looped over it (a store and a reload
// per row, ~12% of a W4 G32 block's samples on Zen 4). Same FMAs in the same order per accumulator. Zen 4,
// 2 threads, M = 1, in-process interleaved rounds: 3072x576 in L2 0.971, the 49152x576 LM head from DRAM
// 0.984, SmolLM2 W4 decode step 0.970 (11 rounds).
template <int NR, int MB>
__attribute__((always_inline)) inline void AddMinLanes(__m256 (&a)[NR][MB], const float* min, int64_t lds,
                                                       const float* xg, int64_t ldxg, int64_t ng) {
  const int64_t full = ng & ~int64_t(7);
  auto step = [&](int64_t g, auto load) __attribute__((always_inline)) {
    __m256 x[MB];
#pragma GCC unroll 4
    for (int mb = 0; mb < MB; ++mb) x[mb] = load(xg + mb * ldxg + g);
#pragma GCC unroll 8
    for (int r = 0; r < NR; ++r) {
      const __m256 m = load(min + r * lds + g);
#pragma GCC unroll 4
      for (int mb = 0; mb < MB; ++mb) a[r][mb] = _mm256_fmadd_ps(m, x[mb], a[r][mb]);
    }
  };
  for (int64_t g = 0; g < full; g += 8) step(g, [](const float* p) { return _mm256_loadu_ps(p); });
  if (full < ng) {
    const __m256i tail = _mm256_cmpgt_epi32(_mm256_set1_epi32(int(ng - full)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    step(full, [tail](const float* p) { return _mm256_maskload_ps(p, tail); });
  }
}

#include "ascendc/simd_hsum4.h"  // HSum4

// The int16-x GEMV (quant_simd.h: gemv_w4_i16 / gemv_w8_i16): one block of NR weight rows x MB rows of x.
// W8, per 32-value chunk and weight row: the 32 weights widen to int16 in two registers (two vpmovsxbw),
// two vpmaddwd against x's two int16 registers give 8 exact int32 sums of 4 products, converted once and
// scaled by x's chunk scale into the group's t.
// W4 takes two chunks per 32-byte load, as they are stored, with no widening shuffle: each 16-bit word holds
// four nibbles, split by shifts and masks into four registers of 16 int16 weights (lane 0 chunk c, lane 1
// chunk c + 1), which meet x in the matching order (quant_simd.h: InterleaveXInt16ForW4, kPairs); four
// vpmaddwd give 8 exact int32 sums of 8 products (|sum| <= 8 * 15 * 32767 < 2^24: converted exactly), lanes
// 0-3 of chunk c and 4-7 of chunk c + 1, scaled per lane. 17 instructions per 64 weights where one chunk at a time took
// 18, two of them vpmovzxbw, a lane-crossing shuffle each. Zen 3: the loop alone, one core, weights in L1,
// K = 576: 25.6 -> 32.0 G weights/s. The op, 2 threads, cold weights, M = 1, median per-round time ratio
// over 15 interleaved rounds: G32 3072x576 0.96, 960x576 0.95, the 49152x576 LM head 0.94, 5632x2048 0.93,
// 576x1536 0.97-1.07; G128 0.95-1.0; M = 2 G32 0.92-0.97. SmolLM2 W4 decode graph step, 9 rounds: G32
// 0.971, G128 1.003 (there the weight stream, not the arithmetic, bounds it).
//
// The chunk loop runs a 64-byte line of every row per step (4 W4 chunks, 2 W8 ones), so the prefetch is
// issued once per step with no test. With one group per chunk (W4 at G == 32, GGUF's Q4_0/Q4_1 blocks)
// the chunk's sum goes straight into the accumulator at x's chunk scale times the row's group scale: no
// per-group t, reset and fold, whose loop bookkeeping cost more than the arithmetic. Zen 3, 2 threads,
// cold weights, medians of 21 interleaved rounds, W4 G = 32: M = 1 1536x576 54 -> 48 us, 576x1536
// 52-60 -> 44-53 us, 5632x2048 626 -> 538 us; M = 2 1536x576 81 -> 64 us; G = 128 1536x576 41 -> 38 us.
// W8 is unchanged per channel, and kept on the group loop at G = 32, where the fold measured 5-10% slower.
//
// kXScaled (one group per chunk, MB == 1): scale[r][c] already holds the group scale times x's chunk
// scale (GemvI16 folds them while widening 16-bit scales), one vmulps fewer per row and chunk: the same
// product, rounded once as before (x's scale is a power of two). Zen 3, 2 threads, 3072x576 and
// 8192x576, M = 1, median per-round ratio over 31-41 interleaved rounds: 0.974-0.986.
//
// FarBytes: how far ahead the second prefetch requests the weights, into L2 (see kInt16Gemvs).
template <int Bits, int NR, int MB, bool kGroupPerChunk, bool kXScaled, int64_t FarBytes>
void GemvI16Block(float* y, int64_t ldy, const int16_t* x, int64_t ldx, const float* xsc, int64_t ldxc,
                  const float* xg, int64_t ldxg, const uint8_t* q, int64_t ldq, const float* scale, const float* min,
                  int64_t lds, int64_t kLen, int64_t G, bool accumulate) {
  constexpr int64_t kChunkBytes = 32 * Bits / 8, kStepChunks = 64 / kChunkBytes;
  const __m256i nibble = _mm256_set1_epi16(0xF);
  __m256 a[NR][MB], t[NR][MB];
  for (int r = 0; r < NR; ++r)
    for (int mb = 0; mb < MB; ++mb) a[r][mb] = t[r][mb] = _mm256_setzero_ps();
  // Rows are a few hundred bytes: fetch the next block while this one is used (ascendc/block_prefetch.h),
  // and, into L2, the block FarBytes ahead: one block ahead is ~70 ns of this loop, less than a DRAM
  // round trip, so on its own each block still waited on memory (the W4 decode GEMV took about its
  // arithmetic plus its bytes' transfer time). Zen 4, 2 threads, SmolLM2 decode graph step, medians of
  // per-round ratios over 7-15 interleaved rounds, near only -> near + far at 8 / 16 KiB: W8A16 0.86-0.97
  // / 0.95, W4A16 G32 0.95-1.00 / 0.93-0.99 (the gain largest while the machine's read rate was low).
  const AscendC::BlockPrefetch<NR> prefetch(q, ldq, kLen * Bits / 8);
  const AscendC::BlockPrefetch<NR, 2> farPrefetch(q, ldq, kLen * Bits / 8,
                                                  int(std::max<int64_t>(1, FarBytes / (NR * ldq))));
  auto prefetchLine = [&](int64_t c) __attribute__((always_inline)) {  // the 64-byte line starting at chunk c
    prefetch.At(c * kChunkBytes);
    farPrefetch.At(c * kChunkBytes);
  };
  // W8: chunk c of every row; its two vpmaddwd give 8 exact int32 sums of 2 products each, for values 0-15
  // and 16-31. On the group loop (kHalves false) they add into one sum, scaled by x's chunk scale into t. At
  // G = 16 (kQuantHalfChunkGroup, kHalves) the halves are groups 2c and 2c + 1: each is scaled by its own
  // group scale times x's chunk scale, the first into a and the second into t (two chains per row), which
  // are added at the end.
  auto chunk = [&](int64_t c, auto halvesTag) __attribute__((always_inline)) {
    constexpr bool kHalves = decltype(halvesTag)::value;
    __m256i xv[MB][2];
    __m256 xs[MB];
    for (int mb = 0; mb < MB; ++mb) {
      xv[mb][0] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + mb * ldx + 32 * c));
      xv[mb][1] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + mb * ldx + 32 * c + 16));
      xs[mb] = _mm256_broadcast_ss(xsc + mb * ldxc + c);
    }
    for (int r = 0; r < NR; ++r) {
      const auto* p = reinterpret_cast<const __m128i*>(q + r * ldq + c * kChunkBytes);
      const __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(p)), w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(p + 1));
      for (int mb = 0; mb < MB; ++mb) {
        const __m256i lo = _mm256_madd_epi16(w0, xv[mb][0]), hi = _mm256_madd_epi16(w1, xv[mb][1]);
        if constexpr (kHalves) {
          const __m256 s0 = _mm256_broadcast_ss(scale + r * lds + 2 * c);
          const __m256 s1 = _mm256_broadcast_ss(scale + r * lds + 2 * c + 1);
          a[r][mb] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lo), _mm256_mul_ps(xs[mb], s0), a[r][mb]);
          t[r][mb] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi), _mm256_mul_ps(xs[mb], s1), t[r][mb]);
        } else {
          t[r][mb] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(lo, hi)), xs[mb], t[r][mb]);
        }
      }
    }
  };
  // W4: chunks c and c + 1 of every row (c even: x's pair at 32 c), or chunk c alone (Single: the last of an
  // odd count; its lane 1 of weights and of x is zero, its scales repeat chunk c's so the zeros stay zero).
  auto pair = [&](int64_t c, auto singleTag) __attribute__((always_inline)) {
    constexpr bool kSingle = decltype(singleTag)::value;
    auto lanes = [](const float* p) __attribute__((always_inline)) {  // p[0] in lanes 0-3, p[1] in 4-7
      if constexpr (kSingle) return _mm256_broadcast_ss(p);
      return _mm256_permutevar_ps(_mm256_castpd_ps(_mm256_broadcast_sd(reinterpret_cast<const double*>(p))),
                                  _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1));
    };
    __m256i xv[MB][4];
    __m256 xs[MB];
    for (int mb = 0; mb < MB; ++mb) {
      for (int j = 0; j < 4; ++j)
        xv[mb][j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + mb * ldx + 32 * c + 16 * j));
      if constexpr (!kXScaled) xs[mb] = lanes(xsc + mb * ldxc + c);
    }
    for (int r = 0; r < NR; ++r) {
      const uint8_t* qc = q + r * ldq + c * kChunkBytes;
      const __m256i v = kSingle ? _mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qc)))
                                : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qc));
      const __m256i w0 = _mm256_and_si256(v, nibble), w1 = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
      const __m256i w2 = _mm256_and_si256(_mm256_srli_epi16(v, 8), nibble), w3 = _mm256_srli_epi16(v, 12);
      __m256 gs;
      if constexpr (kGroupPerChunk) gs = lanes(scale + r * lds + c);
      for (int mb = 0; mb < MB; ++mb) {
        const __m256i s = _mm256_add_epi32(
            _mm256_add_epi32(_mm256_madd_epi16(w0, xv[mb][0]), _mm256_madd_epi16(w1, xv[mb][1])),
            _mm256_add_epi32(_mm256_madd_epi16(w2, xv[mb][2]), _mm256_madd_epi16(w3, xv[mb][3])));
        if constexpr (kXScaled)
          a[r][mb] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), gs, a[r][mb]);
        else if constexpr (kGroupPerChunk)
          a[r][mb] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(xs[mb], gs), a[r][mb]);
        else
          t[r][mb] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), xs[mb], t[r][mb]);
      }
    }
  };
  // The chunks [c, c + n) of every row, n <= kUnit: W4 as one pair (or a single), W8 one chunk.
  constexpr int64_t kUnit = Bits == 4 ? 2 : 1;
  auto unit = [&](int64_t c, int64_t n) __attribute__((always_inline)) {
    if constexpr (Bits == 4) {
      if (n == 2)
        pair(c, std::false_type{});
      else
        pair(c, std::true_type{});
    } else {
      chunk(c, std::false_type{});
    }
  };
  const int64_t nc = kLen / 32;
  if (Bits == 8 && G == kQuantHalfChunkGroup) {
    int64_t c = 0;
    for (; c + kStepChunks <= nc; c += kStepChunks) {
      prefetchLine(c);
#pragma GCC unroll 2
      for (int i = 0; i < kStepChunks; ++i) chunk(c + i, std::true_type{});
    }
    for (; c < nc; ++c) chunk(c, std::true_type{});
    for (int r = 0; r < NR; ++r)
      for (int mb = 0; mb < MB; ++mb) a[r][mb] = _mm256_add_ps(a[r][mb], t[r][mb]);
  } else if constexpr (kGroupPerChunk) {
    int64_t c = 0;
    for (; c + kStepChunks <= nc; c += kStepChunks) {
      prefetchLine(c);
#pragma GCC unroll 4
      for (int i = 0; i < kStepChunks; i += kUnit) unit(c + i, kUnit);
    }
    for (; c < nc; c += kUnit) unit(c, std::min(kUnit, nc - c));
  } else {
    const int64_t cpg = G / 32;
    auto fold = [&](int64_t g) __attribute__((always_inline)) {
      for (int r = 0; r < NR; ++r) {
        __m256 sc = _mm256_broadcast_ss(scale + r * lds + g);
        for (int mb = 0; mb < MB; ++mb) {
          a[r][mb] = _mm256_fmadd_ps(t[r][mb], sc, a[r][mb]);
          t[r][mb] = _mm256_setzero_ps();
        }
      }
    };
    // Groups of whole 64-byte lines (W4 G >= 128, W8 per channel or G >= 64) take the lines as the one-group-
    // per-chunk loop does: one prefetch per line and its chunks unrolled, with no test per chunk; the last,
    // shorter group (K = 576 at G = 128) and other group sizes go chunk by chunk. The same FMAs in the same
    // order. Zen 3, 2 threads, SmolLM2 batch-1 decode, medians of per-round ratios over 11 interleaved rounds:
    // W4A16 G128 1.034x tok/s, W8A16 per channel 1.035x.
    int64_t c = 0, g = 0;
    if (cpg % kStepChunks == 0) {
      for (; c + cpg <= nc; ++g) {
        for (const int64_t end = c + cpg; c < end; c += kStepChunks) {
          prefetchLine(c);
#pragma GCC unroll 4
          for (int i = 0; i < kStepChunks; i += kUnit) unit(c + i, kUnit);
        }
        fold(g);
      }
    }
    // W4 groups are whole pairs (G = 64, 128; G = 32 is one group per chunk), so every pair starts at an
    // even chunk, as x's pairs do; only the last group may end in a single.
    for (; c < nc; ++g) {
      for (const int64_t end = std::min(nc, c + cpg); c < end;) {
        const int64_t n = std::min(kUnit, end - c);
        if (c % kStepChunks == 0) prefetchLine(c);
        unit(c, n);
        c += n;
      }
      fold(g);
    }
  }
  // (One group per chunk: the group count without a division.)
  if constexpr (Bits == 4)
    AddMinLanes<NR, MB>(a, min, lds, xg, ldxg, kGroupPerChunk ? kLen / 32 : (kLen + G - 1) / G);
  for (int mb = 0; mb < MB; ++mb) {
    float* o = y + mb * ldy;
    if constexpr (NR == 4) {
      __m128 v = HSum4(a[0][mb], a[1][mb], a[2][mb], a[3][mb]);
      _mm_storeu_ps(o, accumulate ? _mm_add_ps(_mm_loadu_ps(o), v) : v);
    } else {
      for (int r = 0; r < NR; ++r) o[r] = accumulate ? o[r] + V256::hsum(a[r][mb]) : V256::hsum(a[r][mb]);
    }
  }
}

// GemvI16's view of this table's block (quant_gemv_i16.h).
struct Avx2Blocks {
  static constexpr int64_t kFourRowsMaxBytes = INT64_MAX;  // 4 weight rows at M == 1 whatever their length
  template <int Bits, int NR, int MB, bool kGroupPerChunk, bool kXScaled, int64_t FarBytes>
  static void Block(float* y, int64_t ldy, const int16_t* x, int64_t ldx, const float* xsc, int64_t ldxc,
                    const float* xg, int64_t ldxg, const uint8_t* q, int64_t ldq, const float* scale,
                    const float* min, int64_t lds, int64_t kLen, int64_t G, bool accumulate) {
    GemvI16Block<Bits, NR, MB, kGroupPerChunk, kXScaled, FarBytes>(y, ldy, x, ldx, xsc, ldxc, xg, ldxg, q, ldq,
                                                                   scale, min, lds, kLen, G, accumulate);
  }
};

#include "quant_gemv_i16.h"  // GemvI16

template <int64_t FarBytes>
void GemvW4I16(float* y, int64_t ldy, const int16_t* x, int64_t ldx, const float* xsc, int64_t ldxc,
               const float* xsum, int64_t ldxs, const uint8_t* q, int64_t ldq, const QuantScaleRows& sc, int64_t M,
               int64_t N, int64_t kLen, int64_t G, bool acc) {
  GemvI16<Avx2Blocks, 4, FarBytes>(y, ldy, x, ldx, xsc, ldxc, xsum, ldxs, q, ldq, sc, M, N, kLen, G, acc);
}

template <int64_t FarBytes>
void GemvW8I16(float* y, int64_t ldy, const int16_t* x, int64_t ldx, const float* xsc, int64_t ldxc, const int8_t* q,
               int64_t ldq, const QuantScaleRows& sc, int64_t M, int64_t N, int64_t kLen, int64_t G, bool acc) {
  GemvI16<Avx2Blocks, 8, FarBytes>(y, ldy, x, ldx, xsc, ldxc, nullptr, 0, reinterpret_cast<const uint8_t*>(q), ldq, sc, M, N,
                       kLen, G, acc);
}

// The int16 GEMVs with the far prefetch FarBytes ahead. The distance that pays differs between the machines
// measured: Zen 4 (AVX-512, where they run as the avx512-i16 path) 8-16 KiB for W8 and 8-32 KiB for W4 of 4-32;
// Zen 3 (AVX2 only) shorter. Zen 3, 2 threads, cold weights, bf16 x, M = 1, median per-round time ratio over 16
// interleaved rounds in one process, 16 -> 4 KiB: W8 3072x576 0.959-0.980, 576x1536 0.972-0.974, 960x576
// 0.959, the 49152x576 LM head 0.932-0.939; W4 G32 0.946-0.996; SmolLM2 W8A16 decode step 0.910 and 0.931 over
// 11-15 rounds (W4A16 0.98-1.00). The two machines' DRAM differ too (~27 against ~47 GB/s read).
template <int64_t FarBytes>
constexpr QuantInt16Gemvs kInt16Gemvs = {GemvW4I16<FarBytes>, GemvW8I16<FarBytes>};

constexpr QuantSimdOps WithInt16(QuantSimdOps ops, const QuantInt16Gemvs& gemvs) {
  ops.gemv_w4_i16 = gemvs.w4;
  ops.gemv_w8_i16 = gemvs.w8;
  return ops;
}

constexpr int64_t kAvx2FarBytes = 4 * 1024;
constexpr QuantSimdOps kOps = WithInt16(MakeQuantOps<V256>("avx2"), kInt16Gemvs<kAvx2FarBytes>);

}  // namespace

const QuantSimdOps* QuantAvx2Ops() { return &kOps; }
const QuantInt16Gemvs* QuantAvx2Int16GemvsForAvx512Host() { return &kInt16Gemvs<kAvx512HostFarBytes>; }

}  // namespace atb

#pragma GCC pop_options

#else
namespace atb {
const QuantSimdOps* QuantAvx2Ops() { return nullptr; }
const QuantInt16Gemvs* QuantAvx2Int16GemvsForAvx512Host() { return nullptr; }
}  // namespace atb
#endif
