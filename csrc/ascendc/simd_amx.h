// AMX-BF16 forms of mmad_dp_bf16_packed (the bf16 prefill GEMM over k-pair-packed weights) and
// mmad_dp_bf16_packed_x (the same with x packed, the batch path), included by
// simd_avx512.cpp inside its anonymous namespace, so it is built twice as that file is:
// * natively (target amx-tile, amx-bf16) for the table "avx512-amx", which simd.cpp offers where CPUID
//   reports AMX-BF16 and the kernel grants this process the tile state (arch_prctl ARCH_REQ_XCOMP_PERM);
// * in the SIMDe build, over a plain C++ emulation of the six tile instructions used here, for the
//   test-only table "avx512-amx-simde": a CPU without AMX runs this code's blocking, tails and layout.
//
// Why: on Sapphire Rapids one core's tdpbf16ps does 1024 bf16 multiply-adds per cycle, about 8x what its
// two vdpbf16ps ports do (2.65 TFLOP/s against ~0.3 measured on one core here, operands in L1), and the
// k-pair panels pack_bf16_pairs lays out are exactly AMX's B operand: 16 k pairs of a 16-row panel are a
// 16 x 64-byte tile, one 1 KiB run. A is x's rows as they lie (16 rows, 32 k each, lda apart).
//
// Numerics: each element of C is its 32-k chunks in order, each chunk one tdpbf16ps into the fp32
// accumulator. Per chunk the hardware sums the even k's exact products in k order and the odd k's likewise,
// each rounded to fp32 at every step, then adds (even + odd) to C. On this AMX Xeon (family 6, model 167)
// that matched every one of 5.1M elements of random tiles with magnitudes across 2^-26 .. 2^25, where a
// single chain over k (this emulation's earlier form) matched 56% and a tree of the 32 products 91%; bf16
// denormal inputs and fp32 denormal results are flushed, per Intel (not probed, nor emulated). Rows past M,
// columns past N and k past K are zeros in padded copies, never read from the caller's memory. A row's bits
// therefore depend neither on M, N nor on the blocking, and a K split at a multiple of 32 changes nothing
// (C goes through memory in fp32). They differ in the last bits from the vdpbf16ps table's, whose chain
// adds one pair at a time (measured: most elements differ by an ulp or so).
#if defined(ATB_AVX512_NATIVE)
#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16")
#endif

// Tiles: 0-3 the 2 x 2 accumulators C[i][j] (16 x 16 fp32 each), 4-5 A's two row tiles, 6-7 B's two panels.
// Every tile is configured 16 rows of 64 bytes; tails are padded copies, so the configuration never changes.
constexpr int64_t kAmxRows = 16;   // rows of a tile (A rows, k pairs of B, rows of C)
constexpr int64_t kAmxChunk = 32;  // k per tdpbf16ps: 16 pairs

struct alignas(64) AmxTileConfig {
  uint8_t palette = 1, startRow = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  AmxTileConfig() {
    for (int t = 0; t < 8; ++t) {
      colsb[t] = 64;
      rows[t] = kAmxRows;
    }
  }
};

#if defined(ATB_AVX512_NATIVE)
// The tile configuration is per thread and anything else on the thread (oneDNN's AMX kernels share the
// OpenMP pool) may change it, so every call loads its own and releases the tiles after.
inline void AmxConfigure() {
  static const AmxTileConfig config;
  _tile_loadconfig(&config);
}
inline void AmxRelease() { _tile_release(); }
// GCC's tile intrinsics paste their tile numbers into the asm text, so each tile's op is spelled out.
template <int T>
void AmxZero();
template <int T>
void AmxLoad(const void* p, int64_t strideBytes);
template <int T>
void AmxStore(void* p, int64_t strideBytes);
template <int C, int A, int B>
void AmxDp();
#define ATB_AMX_TILE(T)                                                                                   \
  template <>                                                                                             \
  inline void AmxZero<T>() {                                                                              \
    _tile_zero(T);                                                                                        \
  }                                                                                                       \
  template <>                                                                                             \
  inline void AmxLoad<T>(const void* p, int64_t strideBytes) {                                            \
    _tile_loadd(T, p, strideBytes);                                                                       \
  }                                                                                                       \
  template <>                                                                                             \
  inline void AmxStore<T>(void* p, int64_t strideBytes) {                                                 \
    _tile_stored(T, p, strideBytes);                                                                      \
  }
ATB_AMX_TILE(0)
ATB_AMX_TILE(1)
ATB_AMX_TILE(2)
ATB_AMX_TILE(3)
ATB_AMX_TILE(4)
ATB_AMX_TILE(5)
ATB_AMX_TILE(6)
ATB_AMX_TILE(7)
#undef ATB_AMX_TILE
#define ATB_AMX_DP(C, A, B)        \
  template <>                      \
  inline void AmxDp<C, A, B>() {   \
    _tile_dpbf16ps(C, A, B);       \
  }
ATB_AMX_DP(0, 4, 6)
ATB_AMX_DP(1, 4, 7)
ATB_AMX_DP(2, 5, 6)
ATB_AMX_DP(3, 5, 7)
#undef ATB_AMX_DP
#else
// The emulation: eight thread-local 1 KiB tiles. Its dot product adds each pair's two products in k order
// in fp32 (no flushes), so its last bits are its own; the tests hold every table to float64.
struct AmxTile {
  alignas(64) uint8_t bytes[kAmxRows][64];
};
inline AmxTile* AmxTiles() {
  thread_local AmxTile tiles[8];
  return tiles;
}
inline void AmxConfigure() {}
inline void AmxRelease() {}
template <int T>
inline void AmxZero() {
  std::memset(AmxTiles()[T].bytes, 0, sizeof(AmxTile));
}
template <int T>
inline void AmxLoad(const void* p, int64_t strideBytes) {
  for (int64_t r = 0; r < kAmxRows; ++r)
    std::memcpy(AmxTiles()[T].bytes[r], static_cast<const uint8_t*>(p) + r * strideBytes, 64);
}
template <int T>
inline void AmxStore(void* p, int64_t strideBytes) {
  for (int64_t r = 0; r < kAmxRows; ++r)
    std::memcpy(static_cast<uint8_t*>(p) + r * strideBytes, AmxTiles()[T].bytes[r], 64);
}
inline float AmxBf16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
// tdpbf16ps as the hardware sums (Numerics above): the even and the odd k's products apart, each in k order,
// then C += (even + odd).
template <int C, int A, int B>
inline void AmxDp() {
  AmxTile &c = AmxTiles()[C], &a = AmxTiles()[A], &b = AmxTiles()[B];
  for (int m = 0; m < kAmxRows; ++m)
    for (int n = 0; n < 16; ++n) {
      float s, even = AmxBf16(a.bytes[m]) * AmxBf16(b.bytes[0] + 4 * n);
      float odd = AmxBf16(a.bytes[m] + 2) * AmxBf16(b.bytes[0] + 4 * n + 2);
      for (int j = 1; j < 16; ++j) {
        even += AmxBf16(a.bytes[m] + 4 * j) * AmxBf16(b.bytes[j] + 4 * n);
        odd += AmxBf16(a.bytes[m] + 4 * j + 2) * AmxBf16(b.bytes[j] + 4 * n + 2);
      }
      std::memcpy(&s, c.bytes[m] + 4 * n, 4);
      s += even + odd;
      std::memcpy(c.bytes[m] + 4 * n, &s, 4);
    }
}
#endif

// One row tile of A: its full chunks at a (strideBytes apart), its K-tail chunk (16 x 32, zero-padded) at tail.
struct AmxRowTile {
  const uint16_t* a;
  int64_t strideBytes;
  const uint16_t* tail;
};

// The MT x NT accumulator tiles (0, 1 | 2, 3) from zero, from C (ld floats apart) or into it.
template <int MT, int NT>
inline void AmxZeroC() {
  AmxZero<0>();
  if constexpr (NT == 2) AmxZero<1>();
  if constexpr (MT == 2) AmxZero<2>();
  if constexpr (MT == 2 && NT == 2) AmxZero<3>();
}
template <int MT, int NT>
inline void AmxLoadC(const float* c, int64_t ld) {
  AmxLoad<0>(c, ld * 4);
  if constexpr (NT == 2) AmxLoad<1>(c + 16, ld * 4);
  if constexpr (MT == 2) AmxLoad<2>(c + 16 * ld, ld * 4);
  if constexpr (MT == 2 && NT == 2) AmxLoad<3>(c + 16 * ld + 16, ld * 4);
}
template <int MT, int NT>
inline void AmxStoreC(float* c, int64_t ld) {
  AmxStore<0>(c, ld * 4);
  if constexpr (NT == 2) AmxStore<1>(c + 16, ld * 4);
  if constexpr (MT == 2) AmxStore<2>(c + 16 * ld, ld * 4);
  if constexpr (MT == 2 && NT == 2) AmxStore<3>(c + 16 * ld + 16, ld * 4);
}

// A block's operands: MT row tiles of A, NT panels (p0 at b, p1 at b + panelStride; their K tails at bTail,
// bTail + 512), over `chunks` full 32-k chunks and, if hasTail, the K tail. next: the row tiles of the block
// after this one, whose first chunks are prefetched while this one's last run (prefetchA only).
struct AmxBlockOperands {
  AmxRowTile a[2];
  const uint16_t* b;
  int64_t panelStride;
  const uint16_t* bTail;
  int64_t chunks;
  bool hasTail;
  bool prefetchA;
  AmxRowTile next[2];
};

// Chunks ahead whose A rows are prefetched into L1 (the prefill form, A = x's rows), from K = kAmxPrefetchMinK
// on. A tile load reads 16 rows lda apart, 64 bytes of each; once a block's two row tiles overflow L1 (32 rows
// of K = 1536 are 96 KiB) the products wait on those loads from L2. AMX Xeon, one core, a 384-row pass
// against 64 weight rows, hot in L2, GFLOP/s without prefetch -> 1, 2, 4 chunks ahead: K = 1536 728 -> 962,
// 1002, 989 (into L2 with prefetcht1: no faster than none). Where x's rows fit, the prefetches only take load
// slots from the tile loads: 2 threads, 128 x 576 by 1536 rows, us, four alternating runs, none -> every K:
// 138-156 -> 154-173 (-> 141-155 with this bound).
constexpr int64_t kAmxPrefetchChunks = 4;
constexpr int64_t kAmxPrefetchMinK = 1024;

// Prefetches (into L1) the 64-byte pieces of chunk ch of the MT row tiles.
template <int MT>
inline void AmxPrefetchChunk(const AmxRowTile (&t)[2], int64_t ch) {
  for (int i = 0; i < MT; ++i) {
    const char* p = reinterpret_cast<const char*>(t[i].a + ch * kAmxChunk);
#pragma GCC unroll 16
    for (int64_t r = 0; r < kAmxRows; ++r) _mm_prefetch(p + r * t[i].strideBytes, _MM_HINT_T0);
  }
}

// The accumulators += chunks [c0, c1) of the block, then the K tail if `tail`: per chunk 4 tile loads, 4
// tdpbf16ps.
template <int MT, int NT>
inline void AmxChunks(const AmxBlockOperands& o, int64_t c0, int64_t c1, bool tail) {
  auto step = [](const uint16_t* a0, int64_t s0, const uint16_t* a1, int64_t s1, const uint16_t* b0,
                 const uint16_t* b1) {
    // Each product issued as soon as its two tiles are loaded, so the later loads overlap the earlier
    // products (the tiles are not renamed: a load waits for the product still reading its tile).
    AmxLoad<4>(a0, s0);
    AmxLoad<6>(b0, 64);
    AmxDp<0, 4, 6>();
    if constexpr (NT == 2) {
      AmxLoad<7>(b1, 64);
      AmxDp<1, 4, 7>();
    }
    if constexpr (MT == 2) {
      AmxLoad<5>(a1, s1);
      AmxDp<2, 5, 6>();
    }
    if constexpr (MT == 2 && NT == 2) AmxDp<3, 5, 7>();
  };
  for (int64_t ch = c0; ch < c1; ++ch) {
    if (o.prefetchA) {
      const int64_t ahead = ch + kAmxPrefetchChunks;
      if (ahead < o.chunks) AmxPrefetchChunk<MT>(o.a, ahead);
      else if (o.next[0].a && ahead - o.chunks < o.chunks) AmxPrefetchChunk<2>(o.next, ahead - o.chunks);
    }
    step(o.a[0].a + ch * kAmxChunk, o.a[0].strideBytes, o.a[1].a + ch * kAmxChunk, o.a[1].strideBytes,
         o.b + ch * kAmxRows * 32, o.b + o.panelStride + ch * kAmxRows * 32);
  }
  if (tail) step(o.a[0].tail, 64, o.a[1].tail, 64, o.bTail, o.bTail + kAmxRows * 32);
}

// The plain block: C (rows x cols of it valid, ldc apart) (+)= A . B over all of K. A partial block goes
// through a 32 x 32 copy of its C, so no tile touches C past rows or cols.
template <int MT, int NT>
void AmxBlock(float* C, int64_t ldc, int64_t rows, int64_t cols, const AmxBlockOperands& o, bool acc) {
  alignas(64) float part[32 * 32];
  const bool whole = rows == MT * kAmxRows && cols == NT * kAmxRows;
  float* c = whole ? C : part;
  const int64_t ld = whole ? ldc : 32;
  if (!whole && acc) {
    std::memset(part, 0, sizeof(part));
    for (int64_t r = 0; r < rows; ++r) std::memcpy(part + r * 32, C + r * ldc, cols * sizeof(float));
  }
  if (acc) AmxLoadC<MT, NT>(c, ld);
  else AmxZeroC<MT, NT>();
  AmxChunks<MT, NT>(o, 0, o.chunks, o.hasTail);
  AmxStoreC<MT, NT>(c, ld);
  if (!whole)
    for (int64_t r = 0; r < rows; ++r) std::memcpy(C + r * ldc, part + r * 32, cols * sizeof(float));
}

// The walk both forms share: zero-padded copies of the tails, then blocks of 2 row tiles x 2 panels (32 x 32
// of C: 4 tile loads per 4 tdpbf16ps), all of K per block; per pair of panels (2 x 16 rows x K of B, from the
// caller's packed tile in L2) every pair of row tiles. block(MT, NT, C, rows, cols, operands, n0, m0).
template <class Block>
void AmxForBlocks(float* C, int64_t ldc, const uint16_t* A, int64_t lda, const uint16_t* Bp, int64_t M, int64_t N,
                  int64_t K, bool prefetchA, Block&& block) {
  const int64_t pairs = (K + 1) / 2, panelStride = 32 * pairs;
  const int64_t chunks = K / kAmxChunk, tailK = K % kAmxChunk;
  const int64_t rowTiles = (M + kAmxRows - 1) / kAmxRows, panels = (N + kAmxRows - 1) / kAmxRows;
  const int64_t lastRows = M - (rowTiles - 1) * kAmxRows;
  // Zero-padded copies (per thread; tile-sized pieces of 16 x 32 bf16 = 512 words): each row tile's K tail,
  // each panel's K tail (its pairs past the last full chunk; the next panel's pairs follow them in Bp), and
  // the last row tile's full chunks when it has fewer than 16 rows.
  thread_local std::vector<uint16_t> scratch;
  const int64_t tileWords = kAmxRows * kAmxChunk, padWords = lastRows < kAmxRows ? kAmxRows * chunks * kAmxChunk : 0;
  const int64_t aTailWords = tailK ? rowTiles * tileWords : 0, bTailWords = tailK ? panels * tileWords : 0;
  scratch.assign(size_t(aTailWords + bTailWords + padWords), 0);
  uint16_t* aTail = scratch.data();
  uint16_t* bTail = aTail + aTailWords;
  uint16_t* aPad = bTail + bTailWords;
  if (tailK) {
    for (int64_t m = 0; m < M; ++m)
      std::memcpy(aTail + m * kAmxChunk, A + m * lda + chunks * kAmxChunk, size_t(tailK) * 2);
    const int64_t tailPairs = pairs - chunks * kAmxRows;
    for (int64_t p = 0; p < panels; ++p)
      std::memcpy(bTail + p * tileWords, Bp + p * panelStride + chunks * kAmxRows * 32, size_t(tailPairs) * 64);
  }
  for (int64_t r = 0; padWords && r < lastRows; ++r)
    std::memcpy(aPad + r * chunks * kAmxChunk, A + ((rowTiles - 1) * kAmxRows + r) * lda,
                size_t(chunks * kAmxChunk) * 2);
  auto rowTile = [&](int64_t t) {
    if (t >= rowTiles) return AmxRowTile{A, lda * 2, aTail};  // no such tile: a block of one row tile
    const uint16_t* tail = aTail + t * tileWords;
    if (t == rowTiles - 1 && padWords) return AmxRowTile{aPad, chunks * kAmxChunk * 2, tail};
    return AmxRowTile{A + t * kAmxRows * lda, lda * 2, tail};
  };
  using One = std::integral_constant<int, 1>;
  using Two = std::integral_constant<int, 2>;
  AmxConfigure();
  for (int64_t p = 0; p < panels; p += 2) {
    const int64_t n0 = p * kAmxRows, cols = std::min<int64_t>(2 * kAmxRows, N - n0);
    for (int64_t t = 0; t < rowTiles; t += 2) {
      const int64_t m0 = t * kAmxRows, rows = std::min<int64_t>(2 * kAmxRows, M - m0);
      // The next block's row tiles: the next two, or the first two again for the next pair of panels.
      const int64_t nt = t + 2 < rowTiles ? t + 2 : p + 2 < panels ? 0 : -1;
      const AmxRowTile none{nullptr, 0, nullptr};
      const AmxBlockOperands o{{rowTile(t), rowTile(t + 1)}, Bp + p * panelStride, panelStride,
                               bTail + p * tileWords, chunks, tailK != 0, prefetchA,
                               {nt < 0 ? none : rowTile(nt), nt < 0 ? none : rowTile(nt + 1)}};
      float* c = C ? C + m0 * ldc + n0 : nullptr;
      const bool twoRows = rows > kAmxRows, twoCols = cols > kAmxRows;
      if (twoRows && twoCols) block(Two{}, Two{}, c, rows, cols, o, n0, m0);
      else if (twoRows) block(Two{}, One{}, c, rows, cols, o, n0, m0);
      else if (twoCols) block(One{}, Two{}, c, rows, cols, o, n0, m0);
      else block(One{}, One{}, c, rows, cols, o, n0, m0);
    }
  }
  AmxRelease();
}

// mmad_dp_bf16_packed on AMX (contract: simd.h; numerics: above).
void MmadAmxBf16Packed(float* C, int64_t ldc, const uint16_t* A, int64_t lda, const uint16_t* Bp, int64_t M,
                       int64_t N, int64_t K, bool acc) {
  AmxForBlocks(C, ldc, A, lda, Bp, M, N, K, /*prefetchA=*/K >= kAmxPrefetchMinK,
               [&](auto mt, auto nt, float* c, int64_t rows, int64_t cols, const AmxBlockOperands& o, int64_t,
                   int64_t) { AmxBlock<decltype(mt)::value, decltype(nt)::value>(c, ldc, rows, cols, o, acc); });
}

// A 32 x 32 fp32 tile (ld 32) and the rows x cols of C (ldc apart) as its transpose, C[j][i] = part[i][j],
// moved a 16 x 16 block at a time through registers (Transpose16x16), the edges masked: as scalar copies
// these took about as long as the block's tile products (the batch-16 decode GEMV: 32 weight rows x 16 rows
// of x, 512 scalar moves per block). The same bits. AMX Xeon, 2 threads, bf16, M = 16: in L2, us, 1536x576
// 49.5 -> 38.4, 576x1536 39.6 -> 35.1, the 49152x576 LM head 1793 -> 1622; SmolLM2's batch-16 weight stream
// from DRAM (every linear of a decode step), ms, three alternating runs: 14.0-14.3 -> 13.3-14.0.
inline void CopyPartToCT(float* C, int64_t ldc, const float* part, int64_t rows, int64_t cols) {
  for (int64_t ib = 0; ib < rows; ib += 16)
    for (int64_t jb = 0; jb < cols; jb += 16) {
      __m512i r[16], t[16];
#pragma GCC unroll 16
      for (int i = 0; i < 16; ++i) r[i] = _mm512_load_si512(part + (ib + i) * 32 + jb);
      Transpose16x16(r, t);
      const __mmask16 m = Tail(std::min<int64_t>(16, rows - ib));
      const int64_t n = std::min<int64_t>(16, cols - jb);
      for (int64_t j = 0; j < n; ++j) MaskStore(C + (jb + j) * ldc + ib, m, _mm512_castsi512_ps(t[j]));
    }
}
inline void CopyCTToPart(float* part, const float* C, int64_t ldc, int64_t rows, int64_t cols) {
  for (int64_t jb = 0; jb < 32; jb += 16)
    for (int64_t ib = 0; ib < 32; ib += 16) {
      __m512i r[16], t[16];
      const __mmask16 m = Tail(std::max<int64_t>(0, std::min<int64_t>(16, rows - ib)));
#pragma GCC unroll 16
      for (int j = 0; j < 16; ++j)
        r[j] = jb + j < cols ? _mm512_castps_si512(MaskLoad(m, C + (jb + j) * ldc + ib)) : _mm512_setzero_si512();
      Transpose16x16(r, t);
#pragma GCC unroll 16
      for (int i = 0; i < 16; ++i) _mm512_store_si512(part + (ib + i) * 32 + jb, t[i]);
    }
}

// The transposed block (mmad_dp_bf16_packed_x): the block's rows are weight rows and its columns x's, so the
// tiles' C^T goes to C (ldc apart) through a 32 x 32 copy, C[j][i] = part[i][j].
template <int MT, int NT>
void AmxBlockT(float* C, int64_t ldc, int64_t rows, int64_t cols, const AmxBlockOperands& o, bool acc) {
  alignas(64) float part[32 * 32];
  if (acc) {
    CopyCTToPart(part, C, ldc, rows, cols);
    AmxLoadC<MT, NT>(part, 32);
  } else {
    AmxZeroC<MT, NT>();
  }
  AmxChunks<MT, NT>(o, 0, o.chunks, o.hasTail);
  AmxStoreC<MT, NT>(part, 32);
  CopyPartToCT(C, ldc, part, rows, cols);
}

// mmad_dp_bf16_packed_x (contract: simd.h): the same walk with the roles swapped, W's N rows as A and x's
// panels as B.
void MmadAmxBf16PackedX(float* C, int64_t ldc, const uint16_t* Xp, const uint16_t* W, int64_t ldw, int64_t M,
                        int64_t N, int64_t K, bool acc) {
  // A is the weight rows, streamed from DRAM once per call (batch decode): prefetches of its next chunks into
  // L1 measured no faster.
  AmxForBlocks(nullptr, 0, W, ldw, Xp, N, M, K, /*prefetchA=*/false,
               [&](auto mt, auto nt, float*, int64_t rows, int64_t cols, const AmxBlockOperands& o, int64_t x0,
                   int64_t w0) {
                 AmxBlockT<decltype(mt)::value, decltype(nt)::value>(C + x0 * ldc + w0, ldc, rows, cols, o, acc);
               });
}

#if defined(ATB_AVX512_NATIVE)
#pragma GCC pop_options
#endif
