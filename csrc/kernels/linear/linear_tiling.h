#pragma once
#include <cstdint>

#include "ascendc/dtype.h"
#include "ascendc/soc.h"

namespace atb {

// Decode-shaped linear y = x W^T (+ bias): x [M, K], W [N, K] (HF layout), fp32
// accumulation, y in x's dtype. Weight-streaming: the N rows split over the
// cores and every core reads each of its weight rows once for all M rows.
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

struct LinearSegment {
  const void* weight = nullptr;  // [n, K]
  const void* bias = nullptr;    // [n] or null
  void* out = nullptr;           // [M, n]
  int64_t n = 0;
};

struct LinearTilingData {
  int64_t m = 0, k = 0;
  int64_t rows = 0;         // rows the cores split: sum of segment n (SWIGLU: n of one segment)
  int64_t numSegments = 1;
  int64_t segRows[kLinearMaxSegments] = {0, 0, 0};
  int64_t blockDim = 1;
  int64_t blockFactor = 0;  // weight rows per core (a multiple of 4, the micro-kernel's row block)
  int64_t mTile = 0;        // x rows per pass (decode: all of M; more passes re-stream the weights)
  int64_t nTile = 0;        // weight rows per UB tile
  int64_t kTile = 0;        // K columns per UB tile (a multiple of 64, or all of K)
  int64_t ubBytes = 0;
  int64_t tilingKey = 0;
};

// Pure host function of (shapes, dtype, epilogue, SoC). segRows: n of each segment.
LinearTilingData LinearTiling(int64_t m, int64_t k, const int64_t* segRows, int64_t numSegments, LinearEpilogue ep,
                              AscendC::DataType dtype, const AscendC::SocInfo& soc);

// Host entry: tiles and launches. x [m, k] contiguous, every segment's weight
// [n, k] contiguous, out [m, n] contiguous, all of `dtype`; residual [m, n]
// (RESIDUAL only). Pointers are trusted (validated by the caller).
void Linear(const void* x, int64_t m, int64_t k, const LinearSegment* segs, int64_t numSegments,
            const void* residual, LinearEpilogue ep, AscendC::DataType dtype, const AscendC::SocInfo& soc);

}  // namespace atb
