// Software prefetch for the decode GEMV micro-kernels, which walk a block of NR adjacent weight rows
// in step (one 64-byte line of each row per step) and then the next block. NR interleaved row streams
// defeat the hardware prefetcher, so each step also prefetches NR lines of the block ahead.
//
// When the rows are whole (the row pitch equals the bytes used per row), the block ahead is one
// contiguous span and is prefetched front to back, NR lines per step: one linear stream. Zen 3,
// 2 threads, cold weights, int16-route W8 GEMV at M = 1, medians of 25 interleaved rounds in one
// process: 1536x576 83 -> 56 us (10.6 -> 15.7 GB/s), 576x1536 79 -> 68 us, against the per-row
// prefetch at the same offset. When the rows are a K slice of longer rows, each row's slice is
// prefetched at the step's offset, as are rows longer than kLinearPrefetchMaxRowBytes (the sweep gained
// nothing at 3 KiB rows and measured 4-6% slower at 4 KiB bf16 rows, 5632x2048). Either way the address is
// base + byte * a + r * b: no branch in the step (a branch and a runtime row count there cost more
// than the prefetch gained). Locality 3 requests into L1 (prefetcht0), 2 into L2 (prefetcht1).
//
// Runs: the same step-by-step prefetch for rows that are not adjacent (each from its own run of rows, the
// lanes GEMV's few-row form), each run's row a fixed number of rows ahead.
//
// PrefetchRowRuns is the prefill GEMMs' counterpart: a tile's short row runs requested together before
// they are unpacked.
//
// A function that does nothing but prefetch must be inlined (ATB_PREFETCH_INLINE): GCC deduces that an
// out-of-line one has no side effects and deletes the calls, prefetches and all.
#pragma once
#include <cstdint>

#define ATB_PREFETCH_INLINE __attribute__((always_inline)) inline

namespace AscendC {

constexpr int64_t kLinearPrefetchMaxRowBytes = 2048;

// One rows4 chunk (32 weights: one 64-byte line of bf16, two of fp32; kernels/linear/linear_rows4.h) at `p`
// requested into L2: the rows4 GEMV's stream, StreamPrefetchBytes ahead (simd.h). Into L1 instead (AMX Xeon,
// SmolLM2 batch-1 graph steps, 16 KiB ahead, per-step interleaved): bf16 1.13x the time; fp32 0.94-0.96x in
// three runs and 1.00x in three runs half an hour later (into L2: 1.00x both times), so both go to L2.
// A prefetch never faults, so a stream's last chunks may request past its end.
template <typename TB>
ATB_PREFETCH_INLINE void PrefetchChunk(const TB* p) {
  __builtin_prefetch(p, 0, 2);
  if constexpr (sizeof(TB) * 32 > 64) __builtin_prefetch(reinterpret_cast<const char*>(p) + 64, 0, 2);
}

template <int NR, int Locality = 3>
class BlockPrefetch {
 public:
  // rows: the current block's first row; pitch: bytes between rows; rowBytes: bytes used per row.
  BlockPrefetch(const void* rows, int64_t pitch, int64_t rowBytes, int blocksAhead = 1)
      : ahead_(static_cast<const char*>(rows) + int64_t(blocksAhead) * NR * pitch),
        perByte_(Linear(pitch, rowBytes) ? NR : 1),
        perRow_(Linear(pitch, rowBytes) ? 64 : pitch) {}

  // Rows `runPitch` bytes apart (one row of each of NR runs), each run's row `rowsAhead` rows (`pitch` bytes
  // each) past the current one, at the step's offset: the lanes GEMV's runs form.
  static BlockPrefetch Runs(const void* rows, int64_t pitch, int64_t runPitch, int rowsAhead) {
    return BlockPrefetch(static_cast<const char*>(rows) + int64_t(rowsAhead) * pitch, 1, runPitch);
  }

  static bool Linear(int64_t pitch, int64_t rowBytes) {
    return pitch == rowBytes && rowBytes <= kLinearPrefetchMaxRowBytes;
  }

  // Once per 64 bytes of row; byte is the offset within the row.
  void At(int64_t byte) const {
    const char* p = ahead_ + byte * perByte_;
    for (int r = 0; r < NR; ++r) __builtin_prefetch(p + r * perRow_, 0, Locality);
  }

 private:
  BlockPrefetch(const char* ahead, int64_t perByte, int64_t perRow) : ahead_(ahead), perByte_(perByte), perRow_(perRow) {}

  const char* ahead_;
  int64_t perByte_, perRow_;
};

// The first `bytes` of each of `rows` rows `pitch` bytes apart, requested at once: a GEMM packing a tile's
// short row runs (a W4 chunk's rows are two cache lines) otherwise waits on each row's first line in turn,
// as its unpacking fills the out-of-order window before the next row's loads issue.
ATB_PREFETCH_INLINE void PrefetchRowRuns(const void* first, int64_t pitch, int64_t rows, int64_t bytes) {
  const char* p = static_cast<const char*>(first);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(p + r * pitch + o);
}

}  // namespace AscendC
