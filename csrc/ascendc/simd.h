// The vector and cube "instructions" of the CPU AI core: one table of function
// pointers per ISA (AVX-512, AVX2+FMA+F16C, portable C++), chosen once at
// start-up from the CPU's features (and, for AVX-512, the OS's XSAVE support
// of the zmm state), so one build runs correctly on any x86-64 or aarch64 CPU.
// All arithmetic is fp32; the 16-bit types only ever appear as storage.
// ATB_ISA=avx512|avx2|portable|avx512-simde in the environment forces a table
// ("avx512-simde": the AVX-512 source built against SIMDe, for tests on CPUs
// without AVX-512; present when the build found SIMDe).
#pragma once
#include <cstdint>

namespace AscendC {

struct SimdOps {
  const char* isa;
  // Elementwise, fp32: dst may alias a source.
  void (*add)(float* dst, const float* a, const float* b, int64_t n);
  void (*sub)(float* dst, const float* a, const float* b, int64_t n);
  void (*mul)(float* dst, const float* a, const float* b, int64_t n);
  void (*max)(float* dst, const float* a, const float* b, int64_t n);
  void (*muls)(float* dst, const float* a, float s, int64_t n);
  void (*adds)(float* dst, const float* a, float s, int64_t n);
  void (*axpy)(float* dst, const float* a, float s, int64_t n);  // dst += s * a
  void (*exp)(float* dst, const float* a, int64_t n);
  void (*silu)(float* dst, const float* a, int64_t n);            // a * sigmoid(a)
  void (*silu_mul)(float* dst, const float* g, const float* u, int64_t n);  // silu(g) * u
  void (*duplicate)(float* dst, float v, int64_t n);
  // Reductions, fp32.
  float (*reduce_sum)(const float* a, int64_t n);
  float (*reduce_max)(const float* a, int64_t n);
  float (*sum_squares)(const float* a, int64_t n);
  float (*dot)(const float* a, const float* b, int64_t n);
  // Conversions between storage types and fp32 (round-to-nearest-even).
  void (*f16_to_f32)(float* dst, const uint16_t* src, int64_t n);
  void (*bf16_to_f32)(float* dst, const uint16_t* src, int64_t n);
  void (*f32_to_f16)(uint16_t* dst, const float* src, int64_t n);
  void (*f32_to_bf16)(uint16_t* dst, const float* src, int64_t n);
  // Cube analogue (Mmad), fp32 accumulation, B in its storage type:
  //   nt: C[m][n] (+)= sum_k A[m][k] * B[n][k]   (B rows are K-contiguous: weights, K cache)
  //   nn: C[m][n] (+)= sum_k A[m][k] * B[k][n]   (B rows are N-contiguous: V cache)
  // accumulate=false overwrites C. Leading dimensions are in elements.
  void (*mmad_nt_f32)(float* C, int64_t ldc, const float* A, int64_t lda, const float* B, int64_t ldb,
                      int64_t M, int64_t N, int64_t K, bool accumulate);
  void (*mmad_nt_f16)(float* C, int64_t ldc, const float* A, int64_t lda, const uint16_t* B, int64_t ldb,
                      int64_t M, int64_t N, int64_t K, bool accumulate);
  void (*mmad_nt_bf16)(float* C, int64_t ldc, const float* A, int64_t lda, const uint16_t* B, int64_t ldb,
                       int64_t M, int64_t N, int64_t K, bool accumulate);
  void (*mmad_nn_f32)(float* C, int64_t ldc, const float* A, int64_t lda, const float* B, int64_t ldb,
                      int64_t M, int64_t N, int64_t K, bool accumulate);
  void (*mmad_nn_f16)(float* C, int64_t ldc, const float* A, int64_t lda, const uint16_t* B, int64_t ldb,
                      int64_t M, int64_t N, int64_t K, bool accumulate);
  void (*mmad_nn_bf16)(float* C, int64_t ldc, const float* A, int64_t lda, const uint16_t* B, int64_t ldb,
                       int64_t M, int64_t N, int64_t K, bool accumulate);
  // Rotary embedding of `rows` head rows (row r at src/dst + r * pitch elements)
  // in the storage type, with HF's roundings: each product x*cos and
  // rotate(x)*sin is rounded to the storage type, then their sum is.
  // Columns [0, rotary) rotate, [rotary, headDim) are copied when dst != src.
  // neox: rotate(x) = (-x[h:], x[:h]), h = rotary/2; interleave (GPT-J):
  // rotate(x)[2i] = -x[2i+1], rotate(x)[2i+1] = x[2i]. cos/sin: fp32 [rotary].
  // dst may alias src.
  void (*rope_f32)(float* dst, const float* src, const float* cos, const float* sin, int64_t rows, int64_t pitch,
                   int64_t headDim, int64_t rotary, bool interleave);
  void (*rope_f16)(uint16_t* dst, const uint16_t* src, const float* cos, const float* sin, int64_t rows,
                   int64_t pitch, int64_t headDim, int64_t rotary, bool interleave);
  void (*rope_bf16)(uint16_t* dst, const uint16_t* src, const float* cos, const float* sin, int64_t rows,
                    int64_t pitch, int64_t headDim, int64_t rotary, bool interleave);
  // silu(g) * u in the storage type, HF's roundings: silu(g) rounded to the
  // storage type, then the product. Every element takes the same SIMD path
  // (tails too), so results do not depend on where a tile starts.
  void (*silu_mul_f16)(uint16_t* dst, const uint16_t* g, const uint16_t* u, int64_t n);
  void (*silu_mul_bf16)(uint16_t* dst, const uint16_t* g, const uint16_t* u, int64_t n);
  // The linears' epilogues from their fp32 sums straight to the storage type, with the roundings HF performs
  // between its separate ops (every value rounded to the storage type where HF's tensor holds it):
  //   swiglu_out:   dst = T(T(silu(T(g))) * T(u))   (gate and up sums; silu_mul_* on the rounded sums)
  //   residual_out: dst = T(T(a) + r)               (a projection's sum plus the residual row r, in T)
  // The same bits as those compositions (each value rounded in the lanes instead of stored and reloaded), in
  // one pass: the linear epilogues made each a chain of 3-5 vector calls per 64-value run.
  void (*swiglu_out_f16)(uint16_t* dst, const float* g, const float* u, int64_t n);
  void (*swiglu_out_bf16)(uint16_t* dst, const float* g, const float* u, int64_t n);
  void (*residual_out_f16)(uint16_t* dst, const float* a, const uint16_t* r, int64_t n);
  void (*residual_out_bf16)(uint16_t* dst, const float* a, const uint16_t* r, int64_t n);
  // RMSNorm's output, HF's roundings: dst = T(w * T(h * rstd)), h the row and w the weight in fp32 (muls, the
  // round trip through T, mul and the store of a Cast chain, in one pass).
  void (*rms_scale_out_f16)(uint16_t* dst, const float* h, const float* w, float rstd, int64_t n);
  void (*rms_scale_out_bf16)(uint16_t* dst, const float* h, const float* w, float rstd, int64_t n);
  // Lane-accumulating NT Mmad, the cube's L0C accumulator kept per SIMD lane:
  //   lanes[(m * N + n) * 8 + j] (+)= sum over k in [0, K), k % 8 == j, of A[m][k] * B[n][k]
  // in increasing k (one fma per step); K must be a multiple of 8. Splitting K into chunks (multiples
  // of 8) leaves every lane's sum bit-identical, so a linear's result does not depend on how its tiling
  // splits K; and the AVX2 and native AVX-512 tables give the same bits (8 lanes in both).
  void (*mmad_nt_lanes_f32)(float* lanes, const float* A, int64_t lda, const float* B, int64_t ldb, int64_t M,
                            int64_t N, int64_t K, bool accumulate);
  void (*mmad_nt_lanes_f16)(float* lanes, const float* A, int64_t lda, const uint16_t* B, int64_t ldb, int64_t M,
                            int64_t N, int64_t K, bool accumulate);
  void (*mmad_nt_lanes_bf16)(float* lanes, const float* A, int64_t lda, const uint16_t* B, int64_t ldb, int64_t M,
                             int64_t N, int64_t K, bool accumulate);
  // NT Mmad for a few A rows (decode attention: the query heads that share one
  // KV head, M <= 8 per pass): each B row is loaded and widened once for all
  // M rows instead of once per row pair. Each element: one vector width of
  // fp32 lanes over k (8 AVX2, 16 AVX-512), a fixed reduction tree, the k
  // tail; independent of M, N and blocking (not of the table).
  void (*mmad_nt_rows_f32)(float* C, int64_t ldc, const float* A, int64_t lda, const float* B, int64_t ldb,
                           int64_t M, int64_t N, int64_t K, bool accumulate);
  void (*mmad_nt_rows_f16)(float* C, int64_t ldc, const float* A, int64_t lda, const uint16_t* B, int64_t ldb,
                           int64_t M, int64_t N, int64_t K, bool accumulate);
  void (*mmad_nt_rows_bf16)(float* C, int64_t ldc, const float* A, int64_t lda, const uint16_t* B, int64_t ldb,
                            int64_t M, int64_t N, int64_t K, bool accumulate);
  // NN Mmad for a few A rows (decode attention's P x V, M <= 8 per pass): per k,
  // a panel of B is widened once and feeds all M rows' register accumulators.
  // Every element is one fma chain over k in order, whatever M or N.
  void (*mmad_nn_rows_f32)(float* C, int64_t ldc, const float* A, int64_t lda, const float* B, int64_t ldb,
                           int64_t M, int64_t N, int64_t K, bool accumulate);
  void (*mmad_nn_rows_f16)(float* C, int64_t ldc, const float* A, int64_t lda, const uint16_t* B, int64_t ldb,
                           int64_t M, int64_t N, int64_t K, bool accumulate);
  void (*mmad_nn_rows_bf16)(float* C, int64_t ldc, const float* A, int64_t lda, const uint16_t* B, int64_t ldb,
                            int64_t M, int64_t N, int64_t K, bool accumulate);
  // Cube analogue with A stored transposed (attention's P^T tile), all fp32:
  //   tn: C[m][n] (+)= sum_k A[k][m] * B[k][n]
  void (*mmad_tn_f32)(float* C, int64_t ldc, const float* A, int64_t lda, const float* B, int64_t ldb,
                      int64_t M, int64_t N, int64_t K, bool accumulate);
  // The online softmax's two passes over a score tile S [rows][n] (rows ld elements apart), fp32, vertical:
  // each of the n columns on its own, so a column's result depends neither on n nor on where it lies.
  //   col_max:     m[c] = max(m[c], S[r][c]) over r < rows, a NaN S skipped; returns whether any S was NaN.
  //   exp_sub_acc: dst[r][c] = exp(S[r][c] - b[c]), then sum[c] += dst[r][c] in increasing r (dst may alias S).
  //                Only for S - b <= 0 (b at least the column's max): the exp is 2^(x log2 e), a degree-6
  //                polynomial on the fraction (~2 ulp), 0 below 2^-126; NaN and -inf give 0.
  bool (*col_max)(float* m, const float* S, int64_t ld, int64_t rows, int64_t n);
  void (*exp_sub_acc)(float* dst, const float* S, int64_t ld, const float* b, float* sum, int64_t rows, int64_t n);
  // Reduces n groups of 8 lanes (mmad_nt_lanes' output): dst[i] = ((l0 + l4) + (l2 + l6)) + ((l1 + l5) +
  // (l3 + l7)) of lanes[8i ..], the same tree on every table.
  void (*sum_lanes8)(float* dst, const float* lanes, int64_t n);
  // Widening transpose (the GEMM's packed B operand: weight rows to [k][n] fp32), exact:
  //   dst[k * ldd + n] = fp32(src[n * lds + k]),  n < N, k < K
  void (*transpose_f32)(float* dst, int64_t ldd, const float* src, int64_t lds, int64_t N, int64_t K);
  void (*transpose_f16)(float* dst, int64_t ldd, const uint16_t* src, int64_t lds, int64_t N, int64_t K);
  void (*transpose_bf16)(float* dst, int64_t ldd, const uint16_t* src, int64_t lds, int64_t N, int64_t K);
  // The benchmarks' streaming-read probe: the sum (mod 2^64) of the n words at p, read as 4 interleaved runs
  // (n / 4 words each, whole 64-byte lines; the rest after) with the table's widest loads. A roofline is the
  // fastest read the core can do: on Zen 3 this pattern read 5-35% faster than one run of 16-byte loads.
  uint64_t (*read_sum)(const uint64_t* p, int64_t n);
  // bf16 x bf16 NT Mmad on AVX512-BF16's vdpbf16ps; null on tables (and CPUs) without it:
  //   C[m][n] (+)= sum_k A[m][k] * B[n][k], A and B bf16 rows, K-contiguous (x and the weights as they lie).
  // Each element: 16 fp32 lanes, lane j adding the exact products of k = 32i + 2j + 1, then 32i + 2j, for
  // i = 0, 1, ... (vdpbf16ps: bf16 denormal inputs and fp32 denormal sums flush to zero), the k tail
  // zero-padded, then a fixed reduction tree; independent of M, N and blocking, so a caller gets the same
  // bits however it tiles M and N (it must pass all of K). The GEMM micro-kernel for bf16 prefill and batch
  // decode: twice the multiply-adds per instruction of fp32 FMA, no widening and no packing (per second: twice
  // FMA's on Zen 4, half of it on the AMX Xeon, linear_tiling.h).
  void (*mmad_nt_dp_bf16)(float* C, int64_t ldc, const uint16_t* A, int64_t lda, const uint16_t* B, int64_t ldb,
                          int64_t M, int64_t N, int64_t K, bool accumulate);
  // The bf16 GEMM over k-pair-packed weights (AVX512-BF16; null elsewhere), prefill's micro-kernel.
  // pack_bf16_pairs lays W [N, K] (rows ldw apart) out as panels of 16 rows; for every k pair j a panel
  // holds its 16 rows' (2j, 2j + 1) values side by side: dst[p][j][n][2] = W[16p + n][2j + (0|1)], panel p at
  // dst + p * 32 * ceil(K/2), rows past N and the odd K's last value zero. vdpbf16ps then multiplies one
  // broadcast pair of x by 16 output columns at once: an accumulator is 16 elements of C, with no horizontal
  // sum and no re-read of x per weight row (mmad_nt_dp_bf16 pays both). mmad_dp_bf16_packed:
  //   C[m][n] (+)= sum_k A[m][k] * W[n][k], A bf16 rows (lda), Bp pack_bf16_pairs(W, N, K),
  // each element one chain over the k pairs in order (exact pair products, vdpbf16ps' flushes), so the bits
  // do not depend on M, N or the blocking, and a K split at an even k (accumulate) changes nothing. The AMX
  // tables' form (simd_amx.h) sums 32-k chunks, one tdpbf16ps each: also independent of M, N and the
  // blocking, a K split at a multiple of 32 changing nothing, but other last bits.
  void (*pack_bf16_pairs)(uint16_t* dst, const uint16_t* W, int64_t ldw, int64_t N, int64_t K);
  void (*mmad_dp_bf16_packed)(float* C, int64_t ldc, const uint16_t* A, int64_t lda, const uint16_t* Bp,
                              int64_t M, int64_t N, int64_t K, bool accumulate);
  // The quantized weights' B operand for mmad_dp_bf16_packed (AVX512-BF16 tables; null elsewhere): the bf16
  // weight matrix the stored rows stand for, laid out as pack_bf16_pairs lays out W [N, K] (values past K and
  // rows past N zero), in one pass from the stored bytes (value layouts: quant_simd.h; only bytes that hold
  // values below K are read). Each weight dequantized in fp32 with one rounding, as dequant_w4 / dequant_w8
  // do (W4 fma(q, scale, min), W8 q * scale), then rounded to bf16 to nearest even (fp32 denormals read as
  // zero, as vdpbf16ps and AMX read bf16 ones): a bf16 model's weights. Row n's group g at
  // scale[n * lds + g] (and min[...]), fp32; G a power of two (W4 32, 64, 128; W8 also 16) or, per channel,
  // any G at least K. Against the integer values exact in bf16 with each group's sums scaled on every output
  // (the form this replaced), a W4 G32 GEMM on AMX ran 1.6-1.8x faster: those per-group fmas, not the tiles,
  // set its pace; a weight dequantized once per M pass costs about what packing a bf16 one does.
  void (*pack_q4_pairs_dequant)(uint16_t* dst, const uint8_t* q, int64_t ldq, int64_t N, int64_t K,
                                const float* scale, const float* min, int64_t lds, int64_t G);
  void (*pack_q8_pairs_dequant)(uint16_t* dst, const int8_t* q, int64_t ldq, int64_t N, int64_t K,
                                const float* scale, int64_t lds, int64_t G);
  // Flash attention's bf16 P . V (AVX512-BF16 tables; null elsewhere) runs as mmad_dp_bf16_packed with V^T as
  // the A operand and P as the packed B, so neither the fp32 P tile nor anything per tile is transposed:
  // transpose_b16: dst[k * ldd + n] = src[n * lds + k] for 16-bit words, n < N, k < K (V rows to V^T, once per
  //   call and K/V tile).
  // exp_pack_pairs_bf16 (below): P^T as the packed B, straight from the scores.
  void (*transpose_b16)(uint16_t* dst, int64_t ldd, const uint16_t* src, int64_t lds, int64_t N, int64_t K);
  // Where the streaming kernels' software prefetches go (paged attention's K/V rows): true, L2
  // (prefetcht1); false, L1 (prefetcht0). On Zen 4 (AVX-512) a request into L1 holds one of L1's few
  // miss buffers until DRAM answers, and L2 measured faster; on Zen 3 (AVX2) only L1 has been measured
  // (a gain over no prefetch), so the AVX2 and portable tables keep it.
  bool prefetch_to_l2;
  // The few-row bf16 GEMM with x packed rather than the weights (AVX512-BF16 tables; null elsewhere), batch
  // decode's:
  //   C[m][n] (+)= sum_k X[m][k] * W[n][k], Xp = pack_bf16_pairs(X, M, K) (X's rows as the panels), W's rows as
  // they lie (ldw apart), all of K per call. The weights are read where they lie, once per 16 rows of x, and C
  // comes out transposed (a weight row's outputs for a panel of x in one accumulator). On the AMX tables the
  // weight rows go straight to the tiles as A operands and x's panels are the B operands: each element its
  // 32-k chunks in order, one tdpbf16ps each (the tail zero-padded). On the vector unit each element is
  // mmad_dp_bf16_packed's chain (its bits). Either way independent of M, N and the blocking.
  void (*mmad_dp_bf16_packed_x)(float* C, int64_t ldc, const uint16_t* Xp, const uint16_t* W, int64_t ldw,
                                int64_t M, int64_t N, int64_t K, bool accumulate);
  // (See transpose_b16.) The online softmax's exp pass fused with P^T's packing: from the score tile S [K][N]
  // (rows ld apart, N contiguous; keys down the rows, query rows along them)
  //   P[k][n] = 2^(S[k][n] * scale + b[n])  (one fma, then a degree-5 2^x: 1.5e-7 relative; -inf, NaN and
  //             anything below -127 give 0), sum[n] += P[k][n] in increasing k,
  //   dst[p][j][n][2] = bf16(P[2j + (0|1)][16p + n])  (pack_bf16_pairs' layout; nearest even, denormals to
  //             zero as the bf16 GEMMs read them anyway), values past K and columns past N zero.
  // (Base 2: the caller folds log2 e into scale and b, saving the exp a multiply.)
  void (*exp_pack_pairs_bf16)(uint16_t* dst, float* sum, const float* S, int64_t ld, const float* b, float scale,
                              int64_t K, int64_t N);
  // Flash attention's output: acc^T [K][N] (rows lda apart) back to rows, each scaled and rounded to bf16
  // (nearest even), row n of the result at dst + (n / group) * ldg + (n % group) * ldd:
  //   dst_row(n)[k] = bf16(A[k][n] * v[n]),  n < N, k < K.
  void (*store_t_scaled_bf16)(uint16_t* dst, int64_t ldd, int64_t group, int64_t ldg, const float* A, int64_t lda,
                              const float* v, int64_t N, int64_t K);
  // Flash attention's rescale of acc^T by the rows' alpha: C[i][j] *= v[j], i < M, j < N (rows ldc apart).
  // 16-column blocks whose v are all exactly 1 are skipped (x * 1 is x: the same bits).
  void (*mul_cols)(float* C, int64_t ldc, const float* v, int64_t M, int64_t N);
  // Whether mmad_dp_bf16_packed(_x) run on AMX tiles (their own sums; tilings that weigh the tiles' speed).
  bool amx_tiles;
  // The fp32 GEMM with x packed (AVX-512 tables; null elsewhere), batch decode's from 16 rows on:
  //   C[m][n] (+)= sum_k X[m][k] * W[n][k], Xt = X in panels of 16 rows, k-major (panel p at Xt + p * 16 * K,
  // Xt[p][k][r] = X[16p + r][k], rows past M zero), W's rows as they lie (ldw apart), all of K per call. Each
  // element one fma chain over k in order (the fp32 GEMM kernel's MmadTN chain: its bits), C out transposed
  // per 16 x 16 block as in mmad_dp_bf16_packed_x.
  void (*mmad_packed_x_f32)(float* C, int64_t ldc, const float* Xt, const float* W, int64_t ldw, int64_t M,
                            int64_t N, int64_t K, bool accumulate);
  // mmad_nt_lanes over weights repacked 4 rows at a time (AVX-512 tables; bf16 on the AVX2 one), decode's GEMV: the
  // rows4 layout of kernels/linear/linear_rows4.h, B4 at the group of the call's first weight row (a multiple
  // of 4) and its chunk of k = 0, ldg elements from one group to the next. The same lanes and bits as
  // mmad_nt_lanes_* (K a multiple of 8; rows past N in the last group are read but not stored).
  void (*mmad_nt_lanes_rows4_f32)(float* lanes, const float* A, int64_t lda, const float* B4, int64_t ldg,
                                  int64_t M, int64_t N, int64_t K, bool accumulate);
  void (*mmad_nt_lanes_rows4_bf16)(float* lanes, const float* A, int64_t lda, const uint16_t* B4, int64_t ldg,
                                   int64_t M, int64_t N, int64_t K, bool accumulate);
  // mmad_dp_bf16_packed_x / mmad_packed_x_f32 (C = X W^T, no accumulate) over weights in the rows4 layout: B4 at
  // the group of the first weight row, ldg elements from one group to the next (AVX-512 vector tables; null
  // elsewhere, the AMX one included). The same chains, so the same bits; a short last block of rows reads only
  // the groups that hold its rows.
  void (*mmad_dp_bf16_packed_x_rows4)(float* C, int64_t ldc, const uint16_t* Xp, const uint16_t* B4, int64_t ldg,
                                      int64_t M, int64_t N, int64_t K);
  void (*mmad_packed_x_rows4_f32)(float* C, int64_t ldc, const float* Xt, const float* B4, int64_t ldg, int64_t M,
                                  int64_t N, int64_t K);
};

// mmad_nt_lanes_* with few A rows (decode) read the weight rows as 4 runs front to back, one per quarter of
// the call's rows, so the hardware prefetcher follows 4 long streams. Runs shorter than this end before it has
// ramped up (4 runs of 16 rows in 64-row calls read at 0.59 of a plain stream on Zen 4), so calls with fewer
// than 4 x kLanesRunMinRows weight rows keep the 4 adjacent rows per block. Shared by the AVX2 and AVX-512
// tables, which must give the same bits either way.
constexpr int64_t kLanesRunMinRows = 32;

// The active table (selected on first use; never null).
const SimdOps& Simd();
// Tables compiled into this build; null when the build has no such path.
const SimdOps* PortableSimdOps();
const SimdOps* Avx2SimdOps();
const SimdOps* Avx512SimdOps();
// The AVX-512 table plus the AVX512-BF16 entries (mmad_nt_dp_bf16): what "avx512" runs where CPUID reports
// avx512bf16.
const SimdOps* Avx512Bf16SimdOps();
// Avx512Bf16SimdOps with mmad_dp_bf16_packed on AMX tiles (simd_amx.h): "avx512-amx", what "auto" picks
// where CPUID reports AMX-BF16 and the kernel grants the tile state.
const SimdOps* Avx512AmxSimdOps();
const SimdOps* Avx512SimdeSimdOps();
// The SIMDe table with the AMX GEMM over an emulation of the tiles (test-only "avx512-amx-simde").
const SimdOps* Avx512AmxSimdeSimdOps();
// Forces a table by name ("auto", "avx512-amx", "avx512", "avx2", "portable", "avx512-simde",
// "avx512-amx-simde");
// throws if this CPU (or build) cannot run it.
void SelectSimd(const char* isa);
// Names of the tables this CPU and build can run, fastest native first.
const char* AvailableIsas();
// CPU feature flags seen at start-up, e.g. "avx2 fma f16c avx512f".
const char* CpuFeatures();

// How far ahead (bytes) the rows4 decode GEMV (mmad_nt_lanes_rows4_*) requests its weight stream into L2;
// 0 leaves the stream to the hardware prefetcher. That GEMV reads each core's weights as one front-to-back
// stream (kernels/linear/linear_rows4.h), and the hardware prefetchers stop at every 4 KiB page. On an AMX
// Xeon a software prefetch 4-32 KiB ahead made the bf16 batch-1 decode graph step 0.79-0.80x the time of
// none (SmolLM2, per step interleaved; 1 KiB 0.95x, 8 and 32 KiB within 1.5% of 16; TinyLlama-1.1B-shaped
// 0.81x; the AVX2 table's SmolLM2 step 0.71x; fp32 1.00x, its loop waits less on the stream), while Zen 4 had
// measured 1-4% slower with one 0.5-2 KiB ahead. So the default is by vendor: 16 KiB on Intel CPUs, 0
// elsewhere. SetStreamPrefetchBytes changes it (< 0: back to that default; the Python layer applies
// ATB_STREAM_PREFETCH_KB through it at import). Where the prefetch lands only decides speed, never a result.
int64_t StreamPrefetchBytes();
void SetStreamPrefetchBytes(int64_t bytes);

// Whether the fp32 decode GEMV at 1 or 2 rows of x reads the weights' rows4 copy (one front-to-back stream per
// core, prefetched per StreamPrefetchBytes) or the weights as they lie: 4 runs of rows per core, each row read
// 8 values at a time in 256-bit vectors, each run's row two ahead requested into L1 (the AVX2 table's form,
// LanesBlock8; the AVX-512 tables' 512-bit pairs, with L2 requests, serve the copy setting's calls without a
// copy). AMX Xeon, 2 threads, fp32 graph steps, per step interleaved, the weights as they lie against the copy
// at 16 KiB: SmolLM2 batch 1 0.869x the time (60 pairs; q/k/v 0.85, o 0.85, MLP 0.88, LM head 0.82), batch 2
// 0.952x, TinyLlama-1.1B-shaped batch 1 0.950x; the 512-bit pairs with L2 requests over the weights as they lie
// 0.90-0.98x. The copy at every distance from 1 to 64 KiB, into L2 or L1, or read in 256-bit rows stayed
// 0.93-1.07x of the copy at 16 KiB. Zen 4 had measured the copy ahead of the
// runs (linear_rows4.h: fp32 K = 576 0.72 -> 0.94 of the read probe at 42+ GB/s; the graph step 1.014x), and an
// L1 request there holds one of L1's few miss buffers until DRAM answers. So the default is by vendor: as they
// lie on Intel CPUs, the copy elsewhere. SetFp32DecodeReadsCopy changes it (< 0: back to that default; the
// Python layer applies ATB_FP32_DECODE_COPY through it at import). Either way the sums are the same bits.
bool Fp32DecodeReadsCopy();
void SetFp32DecodeReadsCopy(int on);

// Whether batch decode's packed-x GEMM (from kLinearPackedXMinRows rows of x; BlockPackedXRows4 in
// simd_avx512.cpp) reads fp32 weights' rows4 copy for every row shorter than 16 KiB, not only where rows as
// they lie alias in L1 (Rows4PackedX, linear_rows4.h): a block of 16 rows as 4 runs, each streamed front to
// back, where the weights as they lie are 16 rows read a unit at a time. AMX Xeon, 2 threads, SmolLM2 fp32
// decode graph, per step interleaved, the copy against the weights as they lie: batch 12 0.768x the time,
// batch 16 0.792x (per step, ms: MLP 17.9 -> 13.9, q/k/v 4.2 -> 3.0, o 2.6 -> 1.9, LM head 6.9 -> 4.7),
// batch 32 0.848x; a TinyLlama-1.1B-shaped graph's down projection (22 KiB rows; its other K alias already)
// 1.009x at batch 16, hence the row bound (kFp32BatchCopyMaxRowBytes). Zen 4 had measured SmolLM2 fp32
// batch 16 at 1.029x (linear_rows4.h). So the default is by vendor: the copy on Intel CPUs, the weights as
// they lie elsewhere. SetFp32BatchReadsCopy changes it (< 0: back to that default). Either way the sums are
// the same bits.
bool Fp32BatchReadsCopy();
void SetFp32BatchReadsCopy(int on);

}  // namespace AscendC
