// The int16-x GEMV's driver (quant_simd.h: gemv_w4_i16 / gemv_w8_i16), shared by the tables that have one:
// the walk over blocks of weight rows and x rows, and the widening of fp16/bf16 scales a block ahead. The
// block itself, Blocks::Block<Bits, NR, MB, kGroupPerChunk, kXScaled, FarBytes>, is the table's own (256-bit
// vpmaddwd in quant_simd_avx2.cpp, 512-bit vpdpbusd in quant_simd_avx512_vnni.cpp). Included inside each
// table's target pragma and anonymous namespace, after quant_simd_impl.h (GroupSums), as quant_simd_impl.h is.
#pragma once

// How far ahead the int16 GEMVs' second weight prefetch reaches on an AVX-512 host (FarBytes), whichever
// block runs: measured on Zen 4 for the 256-bit one (quant_simd_avx2.cpp: kInt16Gemvs), and no distance
// from 4 to 128 KiB beat it for the vpdpbusd one on the AMX Xeon.
constexpr int64_t kAvx512HostFarBytes = 16 * 1024;

// n fp16 (or bf16) values widened to fp32 (F16C), times mul[i] where given.
inline void Widen16(float* d, const uint16_t* s, int64_t n, bool bf16, const float* mul = nullptr) {
  auto widen8 = [&](int64_t i) {
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i));
    return bf16 ? _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)) : _mm256_cvtph_ps(h);
  };
  auto widen1 = [&](int64_t i) {
    return _mm_cvtss_f32(bf16 ? _mm_castsi128_ps(_mm_cvtsi32_si128(int(s[i]) << 16))
                                : _mm_cvtph_ps(_mm_cvtsi32_si128(s[i])));
  };
  int64_t i = 0;
  if (mul) {
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(d + i, _mm256_mul_ps(widen8(i), _mm256_loadu_ps(mul + i)));
    for (; i < n; ++i) d[i] = widen1(i) * mul[i];
  } else {
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(d + i, widen8(i));
    for (; i < n; ++i) d[i] = widen1(i);
  }
}

// Rows [n0, n1) of sc's 16-bit scales (and W4 mins) widened into its scratch. They span whole rows
// (StoredScales), so the rows' lds groups lie back to back. With xScale (one group per chunk), each scale
// is multiplied by x's scale of its chunk: xScaleRows holds x's chunk scales repeated for tiledRows rows,
// so that many rows widen as one run (per-row runs of K = 576's 18 groups end in a scalar tail of two);
// more rows go row by row. The same products either way. Zen 4, 2 threads, W4 G32, M = 1, in-process
// interleaved rounds, per row -> one run: 3072x576 in L2 0.953, SmolLM2 decode graph step 0.961 (15 rounds).
inline void WidenScaleRows(const QuantScaleRows& sc, bool w4, int64_t n0, int64_t n1, const float* xScale,
                           const float* xScaleRows, int64_t tiledRows) {
  const bool bf16 = sc.type == AscendC::DataType::BFLOAT16;
  const int64_t g = sc.lds;
  const auto* s16 = static_cast<const uint16_t*>(sc.scale);
  if (!xScale)
    Widen16(sc.scratch + n0 * g, s16 + n0 * g, (n1 - n0) * g, bf16);
  else if (n1 - n0 <= tiledRows)
    Widen16(sc.scratch + n0 * g, s16 + n0 * g, (n1 - n0) * g, bf16, xScaleRows);
  else
    for (int64_t r = n0; r < n1; ++r) Widen16(sc.scratch + r * g, s16 + r * g, g, bf16, xScale);
  if (w4) Widen16(sc.minScratch + n0 * g, static_cast<const uint16_t*>(sc.min) + n0 * g, (n1 - n0) * g, bf16);
}

// Blocks of 4 rows of x and one weight row while 4 rows remain, then of 2 rows of x (4 weight rows at M == 1,
// 2 otherwise: 16 ymm registers; at M == 1 2 as well where a row's bytes exceed Blocks::kFourRowsMaxBytes),
// tails one by one. A block of 4 x rows unpacks each weight once for all 4
// (x is reloaded from L1 per weight row); every sum is the same chain whatever the block. Zen 3, 2 threads,
// bf16 x, SmolLM2's shapes in cache, 4-row against 2-row blocks, time ratio: W4 G32 M = 8 0.94-0.97, W8
// M = 16 0.96-1.01, M = 12 0.81-1.05.
// fp16/bf16 scales are widened during the first x block, a weight-row block ahead of the block that
// uses them: the loads of the next block's scales (cold: they stream beside the weights) overlap this
// block's arithmetic, and the block reads stores long retired. A widening pass over each 64-row tile
// first stalled on those loads: 12-24% of the op's samples. Zen 3, 2 threads, M = 1, bf16 x, W4 G32 fp16
// scales, cold weights, median per-round ratio over 41 interleaved rounds: 8192x576 0.957, 3072x576
// 0.979, 576x1536 0.949.
template <class Blocks, int Bits, int64_t FarBytes>
void GemvI16(float* y, int64_t ldy, const int16_t* x, int64_t ldx, const float* xsc, int64_t ldxc, const float* xsum,
             int64_t ldxs, const uint8_t* q, int64_t ldq, const QuantScaleRows& sc, int64_t M, int64_t N,
             int64_t kLen, int64_t G, bool acc) {
  const int64_t ng = (kLen + G - 1) / G, lds = sc.lds;
  const bool f32 = sc.type == AscendC::DataType::FLOAT32;
  const float* scale = f32 ? static_cast<const float*>(sc.scale) : sc.scratch;
  const float* min = Bits != 4 ? nullptr : f32 ? static_cast<const float*>(sc.min) : sc.minScratch;
  float xg[kQuantMaxGroupSums];
  int64_t widened = f32 ? N : 0;  // rows whose fp32 scales are in place
  // One x row and one W4 group per chunk: x's chunk scales fold into the widened group scales (repeated
  // for the 8 rows a widening covers at most: a 4-row block and the next one, when they fit).
  const bool xScaled = Bits == 4 && G == 32 && !f32 && M == 1;
  constexpr int64_t kTiledScales = 1024;
  float xScaleRows[kTiledScales];
  const int64_t tiledRows = xScaled && 8 * ng <= kTiledScales ? 8 : 0;
  for (int64_t r = 0; r < tiledRows; ++r) std::copy_n(xsc, ng, xScaleRows + r * ng);
  auto rows = [&](auto nrTag, auto mbTag, int64_t m, int64_t n, int64_t ahead) {
    constexpr int NR = decltype(nrTag)::value, MB = decltype(mbTag)::value;
    if (widened < N) {
      const int64_t upto = std::min(N, n + NR + ahead);
      if (upto > widened)
        WidenScaleRows(sc, Bits == 4, widened, upto, xScaled ? xsc : nullptr, xScaleRows, tiledRows);
      widened = std::max(widened, upto);
    }
    // xScaled implies M == 1, so MB == 1 wherever it holds.
    auto block = Bits != 4 || G != 32 ? Blocks::template Block<Bits, NR, MB, false, false, FarBytes>
                 : xScaled            ? Blocks::template Block<Bits, NR, MB, true, MB == 1, FarBytes>
                                      : Blocks::template Block<Bits, NR, MB, true, false, FarBytes>;
    block(y + m * ldy + n, ldy, x + m * ldx, ldx, xsc + m * ldxc, ldxc, xg, ng, q + n * ldq, ldq, scale + n * lds,
          Bits == 4 ? min + n * lds : nullptr, lds, kLen, G, acc);
  };
  using One = std::integral_constant<int, 1>;
  using Two = std::integral_constant<int, 2>;
  using Four = std::integral_constant<int, 4>;
  for (int64_t m = 0; m < M;) {
    const int64_t mb = M - m >= 4 ? 4 : std::min<int64_t>(2, M - m);
    if constexpr (Bits == 4) GroupSums(xg, xsum + m * ldxs, ldxs, mb, kLen, G);
    int64_t n = 0;
    if (mb == 4) {
      for (; n < N; ++n) rows(One{}, Four{}, m, n, 1);
    } else if (mb == 2) {
      for (; n + 2 <= N; n += 2) rows(Two{}, Two{}, m, n, 2);
      for (; n < N; ++n) rows(One{}, Two{}, m, n, 1);
    } else if (kLen * Bits / 8 > Blocks::kFourRowsMaxBytes) {
      for (; n + 2 <= N; n += 2) rows(Two{}, One{}, m, n, 2);
      for (; n < N; ++n) rows(One{}, One{}, m, n, 1);
    } else {
      for (; n + 4 <= N; n += 4) rows(Four{}, One{}, m, n, 4);
      for (; n < N; ++n) rows(One{}, One{}, m, n, 1);
    }
    m += mb;
  }
}
