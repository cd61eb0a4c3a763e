#pragma once
#include <cstdint>

#include "ascendc/dtype.h"
#include "ascendc/soc.h"

namespace atb {

// Linear y = x W^T (+ bias): x [M, K], W [N, K] (HF layout), fp32 accumulation,
// y in x's dtype. Two kernels behind one entry, chosen by M:
//   STREAM (M < kLinearGemmMinRows, decode): the N rows split over the cores and
//     every core reads each of its weight rows once for all M rows;
//   GEMM (prefill): a blocked GEMM over (row tile, M pass) work units; weight
//     tiles are packed to fp32 in UB once per M pass and reused by every row of
//     it through the 6x16 register-blocked cube tile. fp16/bf16 weights are
//     widened while packing, so half-precision prefill runs at fp32 FMA speed.
//     bf16 on AVX512-BF16 instead runs vdpbf16ps (twice fp32 FMA's rate on Zen 4; on the
//     AMX Xeon, family 6 model 167, half of it: one core, 12 independent accumulators,
//     0.58 ns per vdpbf16ps zmm against 0.145 ns per vfmadd231ps, so 32 multiply-adds per
//     0.58 ns against 16 per 0.145; there the AMX table takes these shapes) from
//     kLinearDpMinRows rows on: on x and W where they lie (mmad_nt_dp_bf16),
//     from kLinearDpPackedMinRows rows on over weight tiles packed in k pairs
//     (mmad_dp_bf16_packed); in between, on AMX or from kLinearDpPackedXMinRows
//     rows on, over x packed in k pairs (mmad_dp_bf16_packed_x). fp32 from kLinearPackedXMinRows to
//     kLinearPackedXF32MaxRows rows on AVX-512 runs the GEMM kernel over x
//     packed k-major (mmad_packed_x_f32) instead of packed weight tiles.
// Each kernel computes a row of y the same way whatever the other rows (M, the
// row's place in a tile, the core split), but the kernels differ from each
// other in the last bits. rowInvariant runs the GEMM kernel (bf16 dp: packed; fp32 from 10 to 255 rows on
// packed x, with the packed kernel's bits) at every M, so a
// row's bits do not depend on how many rows share the call: a prefill that
// computes only a prompt's uncached suffix gets the rows a whole-prompt
// prefill computes (prefix caching).
//
// Epilogues (tilingKey = dtype * 10 + epilogue), fused so the output is
// written once:
//   PLAIN     y = T(acc + bias), over 1..3 weight segments (fused q/k/v: one
//             launch walks the concatenated row ranges, each segment has its
//             own weight, bias and output; no weight copy);
//   RESIDUAL  y = T(T(acc + bias) + residual)         (o_proj, down_proj);
//   SWIGLU    y = T(T(silu(T(gate))) * T(up))         (gate_proj + up_proj: two
//             segments of equal N read row by row side by side).
// The roundings to T are the ones HF performs between its separate ops, so a
// fused launch gives HF's numbers in fp16/bf16 too.
enum LinearEpilogue : int64_t { LINEAR_PLAIN = 0, LINEAR_RESIDUAL = 1, LINEAR_SWIGLU = 2 };

constexpr int kLinearMaxSegments = 3;
// From this many rows of x on, the GEMM kernel runs (the stream kernel keeps at
// most 32 rows in UB per weight pass).
constexpr int64_t kLinearGemmMinRows = 32;
// bf16 where the SIMD table has the dot-product micro-kernel (mmad_nt_dp_bf16, AVX512-BF16): the GEMM
// kernel runs from this many rows on (batch decode), since with a few rows per weight row fp32 FMA, not
// memory, bounds the stream kernel. Zen 4, 2 threads, SmolLM2's gate+up and down+residual over 30 layers'
// weights (from DRAM), medians of 7 interleaved runs, ms, stream -> dp rows: M = 2 6.85 -> 7.30, 3 6.94 ->
// 7.71, 4 7.72 -> 6.92, 6 9.68 -> 6.75, 12 17.71 -> 10.32 (gate+up alone at 15: 14.0 -> 8.3). The whole
// engine decode step (bf16 graph), ms, 16 -> 4 rows: batch 12 32.1-39.9 -> 17.6-21.7, batch 8 20.0-22.4 ->
// 13.8-15.5, batch 4 11.8-12.3 -> 12.1-13.3 (no gain): so from 6 rows on.
constexpr int64_t kLinearDpMinRows = 6;
// From this many rows on (and at every M under rowInvariant: the engine's prefill) the dp GEMM packs each
// weight tile in k pairs (mmad_dp_bf16_packed) rather than reading weight rows as they lie
// (mmad_nt_dp_bf16): the packing pays for itself once enough rows reuse a tile. Zen 4, 2 threads, SmolLM2's
// projections (q/k/v, gate+up, down+residual, o+residual), us, rows -> packed: M = 16 465 -> 543, 96
// 2201 -> 2131, 2048 68107 -> 58454 (the LM head, 49152 x 576 from DRAM: M = 16 3107 -> 7655, 96 27454 ->
// 29328); one core, hot, 144 x 64 x 576: 167 -> 226 GFLOP/s, vdpbf16ps's peak ~218.
constexpr int64_t kLinearDpPackedMinRows = 128;
// Between kLinearDpMinRows and kLinearDpPackedMinRows rows, where the table has mmad_dp_bf16_packed_x, the dp
// GEMM packs x in k pairs instead (kPackedX: one load of 16 rows of x per k pair for 16 weight rows, no
// horizontal sums): on AMX tables from kLinearDpMinRows rows on, on the vector unit from this many (it fills
// its accumulators' 16 lanes with rows of x, so fewer rows leave lanes idle). Zen 4, SmolLM2 bf16: one core,
// hot weights, us, rows -> packed x: M = 16 gate 576 x 1536 189-197 -> 137-138, down 1536 x 576 142-143 ->
// 134, M = 64 gate 577-728 -> 519-523; 2 threads, 30 layers' gate+up and down+residual, ms: M = 8 4.6 -> 6.8,
// 12 6.9 -> 7.3 (so not below 16). In the batch-16 decode graph, whose weights come from DRAM, the MLP's
// time did not move beyond the run-to-run spread (7.2-8.3 -> 7.4-8.4 ms per step, four alternating runs).
// Packed x costs the same at any M up to 16 (a panel's 16 lanes run whatever the rows), so the rows form wins
// below: the same 30 MLPs from DRAM, in-process interleaved medians, ms, rows -> packed x: M = 8 9.6 -> 11.2,
// 10 9.5 -> 11.3, 12 10.3 -> 11.3, 13 11.0 -> 11.4, 14 10.3-11.8 -> 10.7-11.6, 15 10.8-12.2 -> 10.8-11.6
// (41 rounds at 14 and 15: 1.03-1.04 and 0.99-1.01), so the switch stays at 16.
constexpr int64_t kLinearDpPackedXMinRows = 16;
// fp32 x and weights where the table has mmad_packed_x_f32 (AVX-512): the same form with one vfmadd231ps per k,
// the weight's value broadcast, from this many rows (the stream kernel's 8-lane chains below) up to
// kLinearPackedXF32MaxRows, row-invariant calls included: each element is the packed GEMM kernel's MmadTN
// chain (the same bits), and the GEMM's packing of every weight tile to fp32 per pass is gone. Zen 4, 2
// threads, the same 30 MLPs in fp32, ms, GEMM -> packed x, alternating processes: M = 32 55.7, 43.7 -> 27.3,
// 27.4; 64 83.5, 72.9 -> 53.3, 52.9; 128 128.5, 127.5 -> 104.7, 111.3; 256 230.0, 238.8 -> 217.0, 237.8; 512
// 469.6, 454.8 -> 420.6, 492.8; one call, hot weights, 576 -> 1536, us: M = 32 412 -> 278, 128 2160 -> 1284,
// 512 4831 -> 5150. (bf16's packed x measured mixed at 128-1023 rows: 5-8% faster over the 30 MLPs from DRAM,
// but 1.2-1.3x slower on a hot 1024 x 1024, the routing policy's measured shape; it stays below 128 rows.)
// From 16 rows this measured down to 10: graph steps, Zen 4, 2 threads, per-step interleaved, packed x from 16
// rows -> from 2, the step's time: SmolLM2 fp32 batch 9 1.015x, 10 0.976x, 11 0.927x, 12 0.884x, 14 0.808x;
// TinyLlama-1.1B-shaped (its weights read from their rows4 copy, Rows4PackedX) 8 1.13x, 9 0.955x, 10 0.89x,
// 11 0.85x, 12 0.83x, 14 0.78x. (bf16 keeps 16, the row kernels below: TinyLlama-shaped batch 4 1.19x, 8
// 1.04x, 12 1.11x.)
constexpr int64_t kLinearPackedXMinRows = 10;
constexpr int64_t kLinearPackedXF32MaxRows = 256;
// The packed-x forms read the same k of 16 weight rows at once: rows a multiple of this many bytes apart fall
// in one L1 set (the 4 KiB page offset picks it) and 16 lines evict each other from its 8 ways, so such weights
// keep the row and stream kernels. Zen 4, bf16, M = 16, 2048 x 5632 (4 KiB rows): 1.12-1.33 -> 2.18-2.64 ms;
// 1536-value fp32 rows (6 KiB: two sets of 8) ran 1.2x faster packed. Weights given with their rows4 copy
// where the form reads it (Rows4PackedX: 4 runs, not 16 rows) are exempt.
constexpr int64_t kPackedXAliasBytes = 4096;
// STREAM tiles of at most this many rows of x hold up to kLinearRunsTileRows weight rows (else 64): the lanes
// micro-kernel reads each call's rows in 4 runs front to back, and longer runs stream faster (a 64-row tile's
// 16-row runs did not: 0.59 of a plain read where 128-row ones made 0.68 and a core's whole share 0.90).
constexpr int64_t kLinearRunsMaxRows = 4;
constexpr int64_t kLinearRunsTileRows = 1024;
enum LinearMode : int64_t { LINEAR_STREAM = 0, LINEAR_GEMM = 1 };
// The GEMM kernel's operand forms (tiling `form`, binding key "form"):
//   kF32Tiles  weight tiles widened to fp32 in UB for MmadNN (fp32, fp16, bf16 without AVX512-BF16);
//   kDpRows    bf16 x and W feed mmad_nt_dp_bf16 as they lie, all of K per call (kTile = K);
//   kDpPacked  bf16 weight tiles packed in k pairs for mmad_dp_bf16_packed;
//   kPackedX   the kDpRows tiles, with x packed in panels of 16 rows (by each core, once per pass): k pairs for
//              mmad_dp_bf16_packed_x (bf16), k-major for mmad_packed_x_f32 (fp32).
enum LinearGemmForm : int64_t { kF32Tiles = 0, kDpRows = 1, kDpPacked = 2, kPackedX = 3 };

// A piece of a weight's rows4 copy: rows [row, row + rows) packed on their own (linear_rows4.h), at data.
struct Rows4Piece {
  int64_t row = 0, rows = 0;
  const void* data = nullptr;
};

struct LinearSegment {
  const void* weight = nullptr;  // [n, K]
  const void* bias = nullptr;    // [n] or null
  void* out = nullptr;           // [M, n]
  int64_t n = 0;
  // Optional: the weight's rows4 copy (linear_rows4.h) in pieces sorted by row (one piece: the whole copy; the
  // decode graph's per-core streams: many), which the STREAM kernel reads instead at up to Rows4MaxRows(dtype)
  // rows of x (bf16 1, fp32 2 or 0) where the SIMD table has the kernel (the same bits): a tile that lies in one
  // piece reads it, any other tile the weight as it lies.
  const Rows4Piece* rows4Pieces = nullptr;
  int64_t numRows4Pieces = 0;
};

struct LinearTilingData {
  int64_t m = 0, k = 0;
  int64_t rows = 0;         // rows the cores split: sum of segment n (SWIGLU: n of one segment)
  int64_t numSegments = 1;
  int64_t segRows[kLinearMaxSegments] = {0, 0, 0};
  int64_t blockDim = 1;
  int64_t blockFactor = 0;  // STREAM: weight rows per core (a multiple of 4, the micro-kernel's row block);
                            // GEMM: (row tile, M pass) work units per core
  int64_t mTile = 0;        // x rows per pass (decode: all of M; more passes re-stream the weights)
  int64_t nTile = 0;        // weight rows per UB tile
  int64_t kTile = 0;        // K columns per UB tile (a multiple of 64, or all of K)
  // GEMM mode only:
  int64_t mPass = 0;        // x rows whose fp32 accumulators stay in UB while one weight tile is packed
  int64_t nTiles = 0;       // row tiles over all segments (each inside one segment)
  int64_t mPasses = 0;
  int64_t form = kF32Tiles;  // GEMM mode's operand form (LinearGemmForm): how x and the weights reach the cube
  int64_t ubBytes = 0;
  int64_t tilingKey = 0;     // mode * 100 + dtype * 10 + epilogue
};

// Pure host function of (shapes, dtype, epilogue, SoC, rowInvariant, rows4Copies). segRows: n of each segment.
// rows4Copies: every segment comes with its rows4 copy (LinearSegment::rows4Pieces), which lifts the packed-x
// forms' aliasing rule (kPackedXAliasBytes) where they read the copy (Rows4PackedX).
LinearTilingData LinearTiling(int64_t m, int64_t k, const int64_t* segRows, int64_t numSegments, LinearEpilogue ep,
                              AscendC::DataType dtype, const AscendC::SocInfo& soc, bool rowInvariant = false,
                              bool rows4Copies = false);

// Host entry: tiles (STREAM or GEMM by M; GEMM at every M if rowInvariant) and launches. x [m, k]
// contiguous, every segment's weight [n, k] contiguous, out [m, n] contiguous, all of `dtype`; residual [m, n]
// (RESIDUAL only). Pointers are trusted (validated by the caller).
void Linear(const void* x, int64_t m, int64_t k, const LinearSegment* segs, int64_t numSegments,
            const void* residual, LinearEpilogue ep, AscendC::DataType dtype, const AscendC::SocInfo& soc,
            bool rowInvariant = false);
// The GEMM kernel's launch for a GEMM-mode tiling (called by Linear).
void LinearGemm(const void* x, const LinearSegment* segs, const void* residual, const LinearTilingData& t,
                const AscendC::SocInfo& soc);

}  // namespace atb
