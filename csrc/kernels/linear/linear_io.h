// What the linear kernels (STREAM: linear_kernel.cpp, GEMM: linear_gemm_kernel.cpp, and the
// quantized ones in kernels/quant_linear/, which differ only in how they read weights) share:
// the GM operands of a launch, the fused epilogue on the fp32 sums and the output write,
// each kernel kind's walk over its work (LinearStreamIo, LinearGemmIo),
// and the launch itself.
#pragma once
#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "ascendc/kernel_operator.h"
#include "linear_tiling.h"

namespace atb {

template <typename T>
class LinearIo {
 protected:
  // GM operands.
  void InitIo(AscendC::GM_ADDR x, const LinearSegment* segs, AscendC::GM_ADDR residual, const LinearTilingData& t) {
    t_ = t;
    ep_ = LinearEpilogue(t.tilingKey % 10);
    streams_ = ep_ == LINEAR_SWIGLU ? 2 : 1;
    xGm_.SetGlobalBuffer(reinterpret_cast<T*>(x));
    for (int64_t s = 0; s < t.numSegments; ++s) {
      wGm_[s].SetGlobalBuffer(reinterpret_cast<T*>(const_cast<void*>(segs[s].weight)));
      bias_[s] = reinterpret_cast<const T*>(segs[s].bias);
      yGm_[s].SetGlobalBuffer(reinterpret_cast<T*>(segs[s].out));
    }
    if (ep_ == LINEAR_RESIDUAL) rGm_.SetGlobalBuffer(reinterpret_cast<T*>(residual));
  }

  // The epilogues' roundings, as HF's separate ops: y = T(silu(T(gate)) rounded to T, times T(up)) and
  // y = T(T(sum) + residual), from the fp32 sums in one pass (SimdOps::swiglu_out_* / residual_out_*). They had
  // been Cast/silu_mul/add chains over 64-value stack runs: AMX Xeon, 2 threads, bf16, the engine's batch-16
  // prefill of 128-token prompts spent 12% of its samples in F32ToBf16 and Bf16ToF32 (about 7% from these
  // epilogues), 2.5% after.
  static void SwigluRow(T* y, const float* gate, const float* up, int64_t n) {
    AscendC::SwigluOutRaw(y, gate, up, n);
  }
  static void ResidualRow(T* y, const float* sum, const T* residual, int64_t n) {
    AscendC::ResidualOutRaw(y, sum, residual, n);
  }

  static void AddBias(float* a, const T* bias, int64_t row, int64_t nt) {
    if (bias)
      for (int64_t n = 0; n < nt; ++n) a[n] += AscendC::ToFloat(bias[row + n]);
  }

  // The output tile of segment s, x rows [m, m + mt) by weight rows [row, row + nt), from its fp32 sums
  // (leading dim ld; up: SWIGLU's second stream, segment 1): + their biases, then the roundings HF performs
  // between its separate ops (see linear_tiling.h), written as T straight to the output rows; RESIDUAL reads
  // its residual rows where they lie, each run before the run is written (the decode graph's o_proj and
  // down_proj add into x in place). An NPU's vector unit would stage the rows in UB and copy them out, and the
  // tilings keep that UB (LinearIoUb); on the CPU the staging was a second pass and a memcpy per row: AMX
  // Xeon, bf16, three alternating runs, staged -> straight: SmolLM2's q/k/v, o + residual, gate/up and
  // down + residual at 2048 rows, ms for the four, 8.9-9.6 -> 8.2-9.3; 128 x 576 by 1536 rows 128-143 ->
  // 116-124 us; 512 x 576 by 1536 474-504 -> 405-442 us.
  void OutputTile(int s, int64_t row, int64_t m, float* sums, float* up, int64_t ld, int64_t mt, int64_t nt) {
    const int64_t n = t_.segRows[s];
    for (int64_t i = 0; i < mt; ++i) {
      float* a = sums + i * ld;
      T* out = yGm_[s].GetPhyAddr((m + i) * n + row);
      AddBias(a, bias_[s], row, nt);
      if (ep_ == LINEAR_SWIGLU) {
        float* u = up + i * ld;
        AddBias(u, bias_[1], row, nt);
        SwigluRow(out, a, u, nt);
      } else if (ep_ == LINEAR_RESIDUAL) {
        ResidualRow(out, a, rGm_.GetPhyAddr((m + i) * n + row), nt);
      } else {
        AscendC::CastRaw<T, float>(out, a, nt);
      }
    }
  }

  LinearTilingData t_;
  LinearEpilogue ep_ = LINEAR_PLAIN;
  int streams_ = 1;
  AscendC::TPipe pipe_;
  AscendC::GlobalTensor<T> xGm_, rGm_, wGm_[kLinearMaxSegments], yGm_[kLinearMaxSegments];
  const T* bias_[kLinearMaxSegments] = {nullptr, nullptr, nullptr};
};

// STREAM kernels: each core owns weight rows [first_, last_) of the segments' concatenation (SWIGLU: of
// the gate; the up rows go alongside) and walks them per M pass in [mTile, nTile] tiles, segment by
// segment (PLAIN may span q, k and v). x stays in UB for the whole launch when one pass covers all of M
// and the kCols columns of K. Kernel brings CopyInX(m0, mt, k0, kl) and ProcessTile(s, row, m0, mt, nt,
// xResident), which accumulates the tile's sums into sums_ and ends with OutputSums.
template <typename T, class Kernel>
class LinearStreamIo : protected LinearIo<T> {
 public:
  void Process() {
    if (first_ >= last_) return;
    const LinearTilingData& t = this->t_;
    bool xResident = t.mTile >= t.m && t.kTile >= kCols_;
    if (xResident) self().CopyInX(0, t.m, 0, kCols_);
    for (int64_t m0 = 0; m0 < t.m; m0 += t.mTile) {
      int64_t mt = std::min(t.mTile, t.m - m0);
      int64_t base = 0;
      for (int64_t s = 0; s < (this->ep_ == LINEAR_SWIGLU ? 1 : t.numSegments); ++s) {
        int64_t lo = std::max(first_, base), hi = std::min(last_, base + t.segRows[s]);
        for (int64_t g = lo; g < hi; g += t.nTile)
          self().ProcessTile(int(s), g - base, m0, mt, std::min(t.nTile, hi - g), xResident);
        base += t.segRows[s];
      }
    }
  }

 protected:
  // kCols: K as the kernel's x tiles count it (the quantized kernels pad K to whole chunks).
  void InitStream(AscendC::GM_ADDR x, const LinearSegment* segs, AscendC::GM_ADDR residual, const LinearTilingData& t,
                  int64_t kCols) {
    this->InitIo(x, segs, residual, t);
    kCols_ = kCols;
    first_ = AscendC::GetBlockIdx() * t.blockFactor;
    last_ = std::min(t.rows, first_ + t.blockFactor);
  }

  // Stream st's tile sums, [mt, nt].
  float* Sums(int st) { return sums_[st].template Get<float>().GetPhyAddr(); }

  // The epilogue and write of a tile whose sums are in sums_.
  void OutputSums(int s, int64_t row, int64_t m0, int64_t mt, int64_t nt) {
    this->OutputTile(s, row, m0, Sums(0), this->streams_ == 2 ? Sums(1) : nullptr, nt, mt, nt);
  }

  int64_t kCols_ = 0, first_ = 0, last_ = 0;
  AscendC::TBuf<AscendC::TPosition::VECCALC> sums_[2];  // carved by the kernel, in its UB order

 private:
  Kernel& self() { return static_cast<Kernel&>(*this); }
};

// The packed GEMM kernels' A operand: x [m, k] as fp32 in blocks of kPackedXRows rows, each block k-major
// ([k][kPackedXRows], block b at b * kPackedXRows * k; the last block's missing rows are zeros). Built once
// per call, the blocks split over the cores, into a workspace in GM: each element is converted once rather
// than once per weight tile (N / nTile times, each a strided read from memory), and the cube tile's
// broadcasts of A then read one contiguous run per k step instead of one element from each of 6 rows.
// Zen 3, one core, the tiling's 48 x 64 x 256 tiles, interleaved medians: 1536x576 at M = 128 and 512
// 1.08-1.15x, 576x1536 at M = 128 1.10-1.12x (MmadTN over the blocks against MmadNN over x's rows). Exact:
// every sum is the same fma chain over k, the same bits as from x's rows. The calling thread keeps a
// workspace of up to kWidenKeepBytes for its next call; a larger one (a very long prompt) is freed again
// by the next call. 12 rows: two AVX2 cube tiles (6 rows) or one AVX-512 tile (12).
constexpr int64_t kPackedXRows = 12;
constexpr int64_t kWidenKeepBytes = int64_t(32) << 20;
const float* PackedX(const void* x, int64_t m, int64_t k, AscendC::DataType dtype, const AscendC::SocInfo& soc);

// GEMM kernels: work units are (row tile of one segment, M pass), split over the cores. A unit either
// packs, per K chunk of the kCols columns, its weight tile as the cube's fp32 B operand (Kernel's
// PackWeight(st, seg, row, nt, k0, kl, kv): W[row + n][k0 + k] into bBuf_[st] at [k][n], n < nt, k < kv,
// of a chunk of kl columns whose first kv exist in x) and runs every mTile rows of x of the pass through
// the 6x16 cube tile (MmadTN, x as PackedX's blocks) into the fp32 accumulators cBuf_ kept across K
// chunks (ProcessPackedUnit), or computes its sums its own way; then the epilogue of every mTile rows
// (OutputRows). Kernel brings ProcessUnit(unit).
template <typename T, class Kernel>
class LinearGemmIo : protected LinearIo<T> {
  static constexpr bool kFloat = std::is_same<T, float>::value;

 public:
  void Process() {
    const LinearTilingData& t = this->t_;
    int64_t units = t.nTiles * t.mPasses;
    int64_t first = AscendC::GetBlockIdx() * t.blockFactor;
    int64_t last = std::min(units, first + t.blockFactor);
    // Pass by pass, so the pass's rows of x stay in L2 across this core's row tiles (a unit streams them once
    // per 32 weight rows); unit by unit, every unit took another pass's rows from L3. Units are independent: the
    // same bits. AMX Xeon, 2 threads, bf16, SmolLM2's q/k/v, o + residual, gate/up and down + residual at 2048
    // rows (row-invariant, six 384-row passes), ms for the four, three alternating runs: 11.5-12.2 -> 8.9-10.1.
    for (int64_t p = 0; p < t.mPasses; ++p)
      for (int64_t u = first; u < last; ++u)
        if (u % t.mPasses == p) self().ProcessUnit(UnitAt(u / t.mPasses, p));
  }

 protected:
  // Weight rows [row, row + nt) of segment s by x rows [m0, m0 + mp).
  struct GemmUnit {
    int s;
    int64_t row, nt, m0, mp;
  };

  // The accumulators and, when the unit packs its weights, the B operands: per stream. xPacked: the A operand
  // of packed units, x as PackedX's blocks (null when nothing packs).
  void InitGemm(AscendC::GM_ADDR x, const float* xPacked, const LinearSegment* segs, AscendC::GM_ADDR residual,
                const LinearTilingData& t, int64_t kCols, bool packed) {
    this->InitIo(x, segs, residual, t);
    kCols_ = kCols;
    aGm_.SetGlobalBuffer(const_cast<float*>(xPacked));
    for (int st = 0; st < this->streams_; ++st) {
      if (packed) this->pipe_.InitBuffer(bBuf_[st], t.kTile * t.nTile * sizeof(float));
      this->pipe_.InitBuffer(cBuf_[st], t.mPass * t.nTile * sizeof(float));
    }
  }

  void ProcessPackedUnit(const GemmUnit& u) {
    const LinearTilingData& t = this->t_;
    for (int64_t k0 = 0; k0 < kCols_; k0 += t.kTile) {
      int64_t kl = std::min(t.kTile, kCols_ - k0);
      int64_t kv = std::min(kl, t.k - k0);  // columns that exist in x (the rest is padding)
      for (int st = 0; st < this->streams_; ++st) self().PackWeight(st, st == 1 ? 1 : u.s, u.row, u.nt, k0, kl, kv);
      for (int64_t mt0 = 0; mt0 < u.mp; mt0 += t.mTile)
        Compute(u.m0 + mt0, mt0, std::min(t.mTile, u.mp - mt0), u.nt, k0, kv);
    }
    for (int64_t mt0 = 0; mt0 < u.mp; mt0 += t.mTile) OutputRows(u, mt0, std::min(t.mTile, u.mp - mt0));
  }

  // The bf16 dp GEMM over k-pair-packed weight tiles (tiling kDpPacked): B operands of bf16 pairs, per stream.
  void InitDpPacked() {
    const LinearTilingData& t = this->t_;
    for (int st = 0; st < this->streams_; ++st)
      this->pipe_.InitBuffer(bBuf_[st], AscendC::AlignUp(t.nTile, 16) * AscendC::AlignUp(t.kTile, 2) * 2);
  }

  // kDpPacked: per K chunk, each stream's weight tile packed in k pairs into bBuf_ (Kernel's PackPairs(st,
  // seg, row, nt, k0, kv, dst): W[row + n][k0 + k], n < nt, k < kv, the kv columns that exist in x, as
  // pack_bf16_pairs lays them out), then every mTile rows of x of the pass against it on x's rows as they lie
  // (Kernel's DpMmad(st, m0, k0, C, ldc, A, lda, Bp, mt, nt, kv, accumulate): A = x[m0 :, k0 :], mt rows,
  // kv columns; mmad_dp_bf16_packed), accumulating in UB across chunks (a split at an even k changes no bit); then the epilogue of
  // every mTile rows.
  void ProcessDpPackedUnit(const GemmUnit& u) {
    if constexpr (std::is_same<T, AscendC::bfloat16_t>::value) {
      const LinearTilingData& t = this->t_;
      for (int64_t k0 = 0; k0 < kCols_; k0 += t.kTile) {
        int64_t kv = std::min(t.kTile, t.k - k0);
        if (kv <= 0) break;  // only padding left (quantized K)
        for (int st = 0; st < this->streams_; ++st)
          self().PackPairs(st, st == 1 ? 1 : u.s, u.row, u.nt, k0, kv, bBuf_[st].template Get<uint16_t>().GetPhyAddr());
        // All of the pass's rows in one call: the micro-kernels block M themselves (AMX: 32-row blocks, so
        // a call per 48-row mTile left every second block half empty), and the sums do not depend on it.
        const uint16_t* a = AscendC::StorageBits(this->xGm_.GetPhyAddr(u.m0 * t.k + k0));
        for (int st = 0; st < this->streams_; ++st)
          self().DpMmad(st, u.m0, k0, cBuf_[st].template Get<float>().GetPhyAddr(), t.nTile, a, t.k,
                        bBuf_[st].template Get<uint16_t>().GetPhyAddr(), u.mp, u.nt, kv, k0 > 0);
      }
      for (int64_t mt0 = 0; mt0 < u.mp; mt0 += t.mTile) OutputRows(u, mt0, std::min(t.mTile, u.mp - mt0));
    }
  }

  // The epilogue and write of the unit's x rows [m0 + mt0, m0 + mt0 + mt) from the accumulators.
  void OutputRows(const GemmUnit& u, int64_t mt0, int64_t mt) {
    int64_t ld = this->t_.nTile;
    float* gate = cBuf_[0].template Get<float>().GetPhyAddr(mt0 * ld);
    float* up = this->streams_ == 2 ? cBuf_[1].template Get<float>().GetPhyAddr(mt0 * ld) : nullptr;
    this->OutputTile(u.s, u.row, u.m0 + mt0, gate, up, ld, mt, u.nt);
  }

  int64_t kCols_ = 0;
  AscendC::GlobalTensor<float> aGm_;
  AscendC::TBuf<AscendC::TPosition::VECCALC> bBuf_[2], cBuf_[2];

 private:
  Kernel& self() { return static_cast<Kernel&>(*this); }

  // Row tile -> (segment, first row, rows): tiles never cross a segment boundary.
  GemmUnit UnitAt(int64_t tile, int64_t pass) const {
    const LinearTilingData& t = this->t_;
    int s = 0;
    int64_t row = tile * t.nTile;
    if (this->ep_ != LINEAR_SWIGLU) {
      while (row >= AscendC::AlignUp(t.segRows[s], t.nTile)) {
        row -= AscendC::AlignUp(t.segRows[s], t.nTile);
        ++s;
      }
    }
    int64_t m0 = pass * t.mPass;
    return {s, row, std::min(t.nTile, t.segRows[s] - row), m0, std::min(t.mPass, t.m - m0)};
  }

  // C[mt0 : mt0 + mt, :nt] (+)= x[m : m + mt, k0 : k0 + kv] . packed, per stream: x's rows from the
  // PackedX blocks they lie in (A transposed, lda = kPackedXRows), a block (or the part of one in range) at
  // a time.
  void Compute(int64_t m, int64_t mt0, int64_t mt, int64_t nt, int64_t k0, int64_t kv) {
    const LinearTilingData& t = this->t_;
    for (int64_t r = m; r < m + mt;) {
      int64_t block = r / kPackedXRows, first = r % kPackedXRows;
      int64_t rows = std::min(kPackedXRows - first, m + mt - r);
      const float* a = aGm_.GetPhyAddr(block * kPackedXRows * t.k + k0 * kPackedXRows + first);
      AscendC::MmadParams p{rows, nt, kv, kPackedXRows, t.nTile, t.nTile, k0 > 0};
      for (int st = 0; st < this->streams_; ++st)
        AscendC::MmadTN(cBuf_[st].template Get<float>().GetPhyAddr((mt0 + r - m) * t.nTile), a,
                        bBuf_[st].template Get<float>().GetPhyAddr(), p);
      r += rows;
    }
  }
};

inline AscendC::GM_ADDR GmAddr(const void* p) { return reinterpret_cast<AscendC::GM_ADDR>(const_cast<void*>(p)); }

// KernelLaunch of Kernel<T> (Init(init...) + Process) for the tiling's dtype.
template <template <typename> class Kernel, class... InitArgs>
void LaunchLinearKernel(const LinearTilingData& t, const AscendC::SocInfo& soc, const InitArgs&... init) {
  using AscendC::DataType;
  auto run = [&](auto tag) {
    Kernel<decltype(tag)> op;
    op.Init(init...);
    op.Process();
  };
  auto kernel = [&]() {
    switch (DataType(t.tilingKey / 10 % 10)) {
      case DataType::FLOAT32: return run(float{});
      case DataType::FLOAT16: return run(AscendC::half{});
      case DataType::BFLOAT16: return run(AscendC::bfloat16_t{});
    }
  };
  AscendC::KernelLaunch(t.blockDim, soc.ub_size, kernel);
}

}  // namespace atb
