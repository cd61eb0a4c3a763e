// The GEMV and dequantization loops of quant_simd.h, written once over a
// vector-traits type V and instantiated by each ISA file after its target
// pragma, inside that file's anonymous namespace (so no symbol compiled for
// one ISA can be picked by the linker for another).
//
// V provides: reg; kVecs (registers per 32-value chunk); kW4Off[v] / kW8Off[v]
// (the x offset, within the chunk, of unpacked register v); kMB (x rows per
// block), kNR1 (weight rows per block when M == 1), kNR (when M > 1); zero,
// load, store, set1, fma, hsum; UnpackW4(16 bytes), UnpackW8(32 bytes).
//
// Register blocking: NR weight rows x MB rows of x. A chunk of each weight row
// is unpacked once and feeds MB rows of x; each group's partial dot t is
// scaled into the row's accumulator once per group. At M == 1 the chunk's
// registers accumulate into separate t's so the FMA chains stay independent
// (4-cycle FMA latency; one chain per row would stall).
#pragma once
#include "ascendc/block_prefetch.h"

// sum_i a[i] * b[i] in vector lanes (the W4 min term: one row's mins . x's group sums).
template <class V>
float DotLanes(const float* a, const float* b, int64_t n) {
  constexpr int L = 32 / V::kVecs;
  typename V::reg acc = V::zero();
  int64_t i = 0;
  for (; i + L <= n; i += L) acc = V::fma(V::load(a + i), V::load(b + i), acc);
  float s = V::hsum(acc);
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// One block of NR weight rows x MB rows of x, for Bits = 4 (q: packed nibbles, + the min term) or 8
// (q: int8). ldq counts bytes.
template <class V, int Bits, int NR, int MB>
void GemvBlock(float* y, int64_t ldy, const float* x, int64_t ldx, const float* xg, int64_t ldxg, const uint8_t* q,
               int64_t ldq, const float* scale, const float* min, int64_t lds, int64_t kLen, int64_t G,
               bool accumulate) {
  using R = typename V::reg;
  constexpr int TV = MB == 1 ? V::kVecs : 1;
  R a[NR][MB];
  for (int r = 0; r < NR; ++r)
    for (int mb = 0; mb < MB; ++mb) a[r][mb] = V::zero();
  const AscendC::BlockPrefetch<NR> prefetch(q, ldq, kLen * Bits / 8);
  const int64_t ng = (kLen + G - 1) / G;
  if (Bits == 8 && G == kQuantHalfChunkGroup) {
    // Two groups per chunk (GGUF's Q6_K sub-blocks): each register's 8 or 16 values lie in one group, so
    // they are scaled as they are unpacked and summed straight into the row's chains, with no per-group fold.
    R t[NR][MB][TV];
    for (int r = 0; r < NR; ++r)
      for (int mb = 0; mb < MB; ++mb)
        for (int v = 0; v < TV; ++v) t[r][mb][v] = V::zero();
    for (int64_t k = 0; k < kLen; k += 32) {
      if (k % 64 == 0) prefetch.At(k);
      R xv[MB][V::kVecs];
      for (int mb = 0; mb < MB; ++mb)
        for (int v = 0; v < V::kVecs; ++v) xv[mb][v] = V::load(x + mb * ldx + k + V::kW8Off[v]);
      for (int r = 0; r < NR; ++r) {
        R w[V::kVecs];
        V::UnpackW8(reinterpret_cast<const int8_t*>(q + r * ldq + k), w);
        for (int v = 0; v < V::kVecs; ++v) {
          const R ws = V::mul(w[v], V::set1(scale[r * lds + (k + V::kW8Off[v]) / kQuantHalfChunkGroup]));
          for (int mb = 0; mb < MB; ++mb) t[r][mb][v % TV] = V::fma(ws, xv[mb][v], t[r][mb][v % TV]);
        }
      }
    }
    for (int r = 0; r < NR; ++r)
      for (int mb = 0; mb < MB; ++mb) {
        R sum = t[r][mb][0];
        for (int v = 1; v < TV; ++v) sum = V::add(sum, t[r][mb][v]);
        a[r][mb] = sum;
      }
  } else {
    for (int64_t g = 0; g < ng; ++g) {
      int64_t k0 = g * G, k1 = std::min(kLen, k0 + G);
      R t[NR][MB][TV];
      for (int r = 0; r < NR; ++r)
        for (int mb = 0; mb < MB; ++mb)
          for (int v = 0; v < TV; ++v) t[r][mb][v] = V::zero();
      for (int64_t k = k0; k < k1; k += 32) {
        if (k * Bits / 8 % 64 == 0) prefetch.At(k * Bits / 8);
        R xv[MB][V::kVecs];
        for (int mb = 0; mb < MB; ++mb)
          for (int v = 0; v < V::kVecs; ++v)
            xv[mb][v] = V::load(x + mb * ldx + k + (Bits == 4 ? V::kW4Off[v] : V::kW8Off[v]));
        for (int r = 0; r < NR; ++r) {
          R w[V::kVecs];
          if constexpr (Bits == 4)
            V::UnpackW4(q + r * ldq + k / 2, w);
          else
            V::UnpackW8(reinterpret_cast<const int8_t*>(q + r * ldq + k), w);
          for (int mb = 0; mb < MB; ++mb)
            for (int v = 0; v < V::kVecs; ++v) t[r][mb][v % TV] = V::fma(w[v], xv[mb][v], t[r][mb][v % TV]);
        }
      }
      for (int r = 0; r < NR; ++r) {
        R s = V::set1(scale[r * lds + g]);
        for (int mb = 0; mb < MB; ++mb) {
          R sum = t[r][mb][0];
          for (int v = 1; v < TV; ++v) sum = V::add(sum, t[r][mb][v]);
          a[r][mb] = V::fma(sum, s, a[r][mb]);
        }
      }
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int mb = 0; mb < MB; ++mb) {
      float v = V::hsum(a[r][mb]);
      if constexpr (Bits == 4) v += DotLanes<V>(min + r * lds, xg + mb * ldxg, ng);
      float* o = y + mb * ldy + r;
      *o = accumulate ? *o + v : v;
    }
}

// Walks N in blocks of NR weight rows (NR1 at M == 1, NR otherwise); tails take NR = 1.
template <class V, int Bits>
struct RowsOf {
  template <int MB>
  struct Rows {
    static void Run(float* y, int64_t ldy, const float* x, int64_t ldx, const float* xg, int64_t ldxg,
                    const uint8_t* q, int64_t ldq, const float* scale, const float* min, int64_t lds, int64_t N,
                    int64_t kLen, int64_t G, bool acc) {
      constexpr int NR = MB == 1 ? V::kNR1 : V::kNR;
      auto mn = [&](int64_t n) { return Bits == 4 ? min + n * lds : nullptr; };
      int64_t n = 0;
      for (; n + NR <= N; n += NR)
        GemvBlock<V, Bits, NR, MB>(y + n, ldy, x, ldx, xg, ldxg, q + n * ldq, ldq, scale + n * lds, mn(n), lds,
                                   kLen, G, acc);
      for (; n < N; ++n)
        GemvBlock<V, Bits, 1, MB>(y + n, ldy, x, ldx, xg, ldxg, q + n * ldq, ldq, scale + n * lds, mn(n), lds, kLen,
                                  G, acc);
    }
  };
};

// xg[i * ng + g] = the sum of x row i over group g, from its 32-value chunk sums xsum[i * ldxs + c].
inline void GroupSums(float* xg, const float* xsum, int64_t ldxs, int64_t rows, int64_t kLen, int64_t G) {
  int64_t ng = (kLen + G - 1) / G, chunks = kLen / 32, cpg = G / 32;
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t g = 0; g < ng; ++g) {
      float s = 0.0f;
      for (int64_t c = g * cpg; c < std::min(chunks, (g + 1) * cpg); ++c) s += xsum[i * ldxs + c];
      xg[i * ng + g] = s;
    }
}

// The GEMV over blocks of up to kMB rows of x (element type X: fp32, or bf16 bits for the
// AVX512-BF16 W4 route), Rows<MB> the row walker of one block. With xsum (W4), each block's x
// group sums (at most kQuantMaxGroupSums: the tiling keeps min(mTile, 4) x kTile / 32 under it)
// come first, from the 32-value chunk sums: the W4 min term per row is then one vector dot
// (mins . group sums) instead of a serial chain per group.
template <int kMB, class X, template <int> class Rows>
void GemvBlocks(float* y, int64_t ldy, const X* x, int64_t ldx, const float* xsum, int64_t ldxs, const uint8_t* q,
                int64_t ldq, const float* scale, const float* min, int64_t lds, int64_t M, int64_t N, int64_t kLen,
                int64_t G, bool acc) {
  int64_t ng = (kLen + G - 1) / G;
  float xg[kQuantMaxGroupSums];
  for (int64_t m = 0; m < M;) {
    int64_t mb = std::min<int64_t>(kMB, M - m);
    if (xsum) GroupSums(xg, xsum + m * ldxs, ldxs, mb, kLen, G);
    float* ym = y + m * ldy;
    const X* xm = x + m * ldx;
    switch (mb) {
      case 1: Rows<1>::Run(ym, ldy, xm, ldx, xg, ng, q, ldq, scale, min, lds, N, kLen, G, acc); break;
      case 2: Rows<2>::Run(ym, ldy, xm, ldx, xg, ng, q, ldq, scale, min, lds, N, kLen, G, acc); break;
      case 3: Rows<kMB >= 3 ? 3 : 1>::Run(ym, ldy, xm, ldx, xg, ng, q, ldq, scale, min, lds, N, kLen, G, acc); break;
      default: Rows<kMB >= 4 ? 4 : 1>::Run(ym, ldy, xm, ldx, xg, ng, q, ldq, scale, min, lds, N, kLen, G, acc); break;
    }
    m += mb;
  }
}

template <class V>
void GemvW4(float* y, int64_t ldy, const float* x, int64_t ldx, const float* xsum, int64_t ldxs, const uint8_t* q,
            int64_t ldq, const float* scale, const float* min, int64_t lds, int64_t M, int64_t N, int64_t kLen,
            int64_t G, bool acc) {
  GemvBlocks<V::kMB, float, RowsOf<V, 4>::template Rows>(y, ldy, x, ldx, xsum, ldxs, q, ldq, scale, min, lds, M, N,
                                                         kLen, G, acc);
}

template <class V>
void GemvW8(float* y, int64_t ldy, const float* x, int64_t ldx, const int8_t* q, int64_t ldq, const float* scale,
            int64_t lds, int64_t M, int64_t N, int64_t kLen, int64_t G, bool acc) {
  GemvBlocks<V::kMB, float, RowsOf<V, 8>::template Rows>(y, ldy, x, ldx, nullptr, 0,
                                                         reinterpret_cast<const uint8_t*>(q), ldq, scale, nullptr, lds,
                                                         M, N, kLen, G, acc);
}

template <class V>
void DequantW4(float* dst, const uint8_t* q, const float* scale, const float* min, int64_t kLen, int64_t G) {
  for (int64_t k = 0; k < kLen; k += 32) {
    typename V::reg w[V::kVecs];
    V::UnpackW4(q + k / 2, w);
    typename V::reg s = V::set1(scale[k / G]), m = V::set1(min[k / G]);
    for (int v = 0; v < V::kVecs; ++v) V::store(dst + k + V::kW4Off[v], V::fma(w[v], s, m));
  }
}

template <class V>
void DequantW8(float* dst, const int8_t* q, const float* scale, int64_t kLen, int64_t G) {
  for (int64_t k = 0; k < kLen; k += 32) {
    typename V::reg w[V::kVecs];
    V::UnpackW8(q + k, w);
    // Each register's values lie in one group, also at G = 16 (8 or 16 values per register).
    for (int v = 0; v < V::kVecs; ++v)
      V::store(dst + k + V::kW8Off[v], V::mul(w[v], V::set1(scale[(k + V::kW8Off[v]) / G])));
  }
}

template <class V>
constexpr QuantSimdOps MakeQuantOps(const char* isa) {
  return QuantSimdOps{isa, GemvW4<V>, GemvW8<V>, nullptr, nullptr, nullptr, DequantW4<V>, DequantW8<V>};
}
