// The decode weights' repacked layout ("rows4"): a weight W [N, K] laid out 4 rows at a time so that the
// decode GEMV (SimdOps::mmad_nt_lanes_rows4_*) reads a core's rows as one front-to-back stream, each 64-byte
// line feeding 16 of mmad_nt_lanes' fp32 lanes (4 rows x 4 lanes) with the same sums.
//
// Why: mmad_nt_lanes reads a call's weight rows as they lie, 4 rows per block, each from its own run of the
// rows, 16 bytes of each row per step: 4 interleaved streams per core. The linear at M = 1 over 256 MiB from DRAM
// on Zen 4 (2 threads; fraction of the streaming-read probe in the same round, medians over 900-1700
// interleaved rounds bucketed by the probe's rate), rows as they lie -> rows4:
//   bf16 K = 576: 0.77 -> 0.89 of a 42+ GB/s probe, 0.92 -> 0.97 of a 30-42 GB/s one; K = 1536 0.915 -> 0.923
//   fp32 K = 576: 0.72 -> 0.94 and 0.90 -> 0.99
// Reading the rows as they lie with whole-line loads (4 runs' lines transposed in registers; a C model of the
// kernel) made 0.78 where this layout made 0.88 at 42+ GB/s: the pattern of addresses, not the load width, sets
// the rate. At M = 2 it gains less (bf16 0.78 -> 0.80 and 0.91 -> 0.93, fp32 0.69 -> 0.87 at 42+ GB/s); from 3
// rows of x on it loses (bf16 M = 3 0.62 -> 0.57, M = 4 0.53 -> 0.43 at 42+ GB/s): each row of x costs two
// broadcasts per 8 k where the runs form broadcasts once, and the vector work bounds those calls. In the decode
// graph bf16 lost at 2 rows too (SmolLM2 batch 2, LM-head copy only against every copy, per-process medians of
// in-process rounds 0.87, 0.97, 0.97, 0.97, 0.98 and 1.06; fp32 1.01). So the STREAM kernel reads rows4 copies
// up to Rows4MaxRows rows of x: fp32 2 (0 where the fp32 GEMV reads weights as they lie, on Intel CPUs:
// Fp32DecodeReadsCopy in simd.h), bf16 1. Long rows gain too: a TinyLlama-1.1B-shaped decode
// graph at batch 1 (rows of 4-11 KiB bf16, 8-22 KiB fp32), in-process interleaved rounds, no copies against a
// copy of every projection and the LM head, ms per step: bf16 42.5 -> 38.7, fp32 79.4 -> 71.8 (every round
// 1.05x or more). (A C model of 4 KiB bf16 rows had read them faster as they lie, and a graph measurement had
// agreed, but that graph read only its LM head's copy: the layers' copies did not reach the native graph.)
//
// Layout: groups of 4 rows (the last one padded with zero rows), group g at g * Rows4Ld(K) elements; within a
// group, chunk c (k in [8c, 8c + 8), K padded with zeros to a multiple of 8) at 32c, row r's values
//   2-byte (bf16): r * 8 + k % 8                  (a row's 8 values in one 16-byte lane of the line)
//   4-byte (fp32): (k % 8 / 4) * 16 + r * 4 + k % 4 (two lines: k % 8 in 0-3 of the 4 rows, then 4-7)
// The engine keeps it beside the weights as they lie (prefill, batch decode and torch read those) for the
// projections and LM head of its decode graph, in pieces (Rows4Piece: one per core tile of each launch, each
// packed from its own first row), each core's pieces of the whole step back to back in the order it reads
// them (DecodeGraph::PlanRows4Streams): a core streams one run of memory from the first layer to the LM head.
// Per decode step, interleaved with one copy per weight (SmolLM2, Zen 4, 2 threads, medians of per-pair
// ratios over 1000-1500 pairs): bf16 1.018x (1.02-1.035x in the faster half of the steps), fp32 1.014x;
// TinyLlama-1.1B-shaped bf16 0.998x (300 pairs): its tiles of 1024 rows were long runs already.
// Read in pieces, bf16 at 2 rows of x still does not pay: per step interleaved, SmolLM2 batch 2 1.03x, but
// TinyLlama-shaped 0.91x; fp32 at 3 rows 0.95x (SmolLM2).
// The AVX2 table has the bf16 kernel too (simd_avx2.cpp): batch-1 graph steps with the copy against without,
// per step interleaved on the same Zen 4 under ATB_ISA=avx2: SmolLM2 1.19x (1000 pairs), TinyLlama-shaped
// 1.25x (200). Its fp32 form measured 1.04x and 0.975x and is not kept; at 2 rows bf16 ran 1.13x (SmolLM2)
// and 0.87x (TinyLlama-shaped), so it reads the copy at 1 row, as the AVX-512 tables do.
// Batch decode (the GEMM kernel's packed-x form, from 16 rows of x) reads the copy too (Rows4PackedX): a block of
// 16 weight rows is 4 groups back to back, read as 4 runs where rows as they lie are 16 rows read at once, with
// the same chains (simd_avx512.cpp, BlockPackedXRows4). Rows 4 KiB apart share an L1 set, which had kept such
// weights (TinyLlama's K = 2048 bf16, 1024 / 2048 fp32) out of the form; their copy lifts that rule. Batch-16
// graph steps on Zen 4, 2 threads, per-step interleaved, the copy against the weights as they lie (a
// switch read per launch): SmolLM2 bf16 0.982x the time (q/k/v 0.956, o 0.945, MLP 0.979), fp32 1.029x (MLP
// 1.043, LM head 1.061: fp32 keeps rows as they lie where they do not alias); TinyLlama-1.1B-shaped bf16
// 0.78-0.84x per projection, fp32 0.62-0.71x; on an AMX Xeon SmolLM2 fp32 batch 16 0.792x (Fp32BatchReadsCopy,
// simd.h). (Prefetching the next block as the loop reads, as rows as they
// lie do, is what pays: without it fp32 ran 1.14-1.20x slower, 1 KiB ahead in each run 1.08-1.14x.)
#pragma once
#include <cstdint>

#include "ascendc/dtype.h"
#include "ascendc/tensor.h"

namespace atb {

constexpr int64_t kRows4GroupRows = 4;
// Rows of x up to which the STREAM kernel reads a dtype's rows4 copy (above).
// fp32: 0 where its decode GEMV reads weights as they lie (AscendC::Fp32DecodeReadsCopy, simd.h).
int64_t Rows4MaxRows(AscendC::DataType dtype);

// Elements from one group of 4 rows to the next.
inline int64_t Rows4Ld(int64_t k) { return kRows4GroupRows * AscendC::AlignUp(k, 8); }
inline int64_t Rows4Elems(int64_t n, int64_t k) { return AscendC::CeilDiv(n, kRows4GroupRows) * Rows4Ld(k); }
// Whether the active SIMD table reads dtype's rows4 weights (bf16 and fp32 on the AVX-512 tables, bf16 on AVX2).
bool Rows4Supported(AscendC::DataType dtype);
// Whether the GEMM kernel's packed-x form (batch decode) reads the rows4 copy of weights of this dtype and K
// where it is given (the table has the kernel: the AVX-512 vector tables): bf16 always, fp32 where rows as
// they lie alias in L1 (kPackedXAliasBytes) and, where AscendC::Fp32BatchReadsCopy (simd.h: by default on
// Intel CPUs), for rows shorter than kFp32BatchCopyMaxRowBytes. See the measurements above and there.
bool Rows4PackedX(AscendC::DataType dtype, int64_t k);
// Rows from this many bytes on stream well enough as they lie: with AscendC::Fp32BatchReadsCopy only shorter
// fp32 rows read a copy where they do not alias. AMX Xeon, 2 threads, batch-16 graph steps, per step interleaved, the
// copy against the weights as they lie: SmolLM2's 2.3 and 6 KiB rows 0.792x the step; a TinyLlama-1.1B-shaped
// graph's down projection alone (22 KiB rows; its other K alias) 1.009x.
constexpr int64_t kFp32BatchCopyMaxRowBytes = 16 << 10;
// dst [Rows4Elems(N, K)] = W [N, K] (rows ldw elements apart) in the layout above; bf16 or fp32.
void PackRows4(void* dst, const void* W, int64_t ldw, int64_t N, int64_t K, AscendC::DataType dtype);

}  // namespace atb
