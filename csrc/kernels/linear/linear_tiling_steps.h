// The steps the float linear's tiling (linear_tiling.cpp) and the quantized linear's
// (quant_linear_tiling.cpp) share: the shape checks, the STREAM kernel's row split and UB
// search, and the GEMM kernel's UB search and work split. Each kernel family brings its
// own UB model (a callable LinearTilingData -> bytes) and the way its K chunk may shrink.
#pragma once
#include <algorithm>
#include <cstdint>
#include <limits>

#include "ascendc/error.h"
#include "kernels/common/tiling_utils.h"
#include "linear_tiling.h"

namespace atb {

// How a tiling may shrink its K chunk: while kTile > floor, to half of it rounded up to align.
struct KHalving {
  int64_t floor;
  int64_t align;
  bool CanHalve(int64_t kTile) const { return kTile > floor; }
  int64_t Halve(int64_t kTile) const { return AscendC::AlignUp(AscendC::CeilDiv(kTile, 2), align); }
};
// A K chunk that must stay whole (the bf16 dot-product GEMM takes all of K in one call).
constexpr KHalving kKeepKWhole{std::numeric_limits<int64_t>::max(), 1};

// UB an NPU's vector unit stages the epilogue's rows in: the output queue, BUFFER_NUM x T [mTile, nTile], and
// RESIDUAL's residual queue, the same. (LinearIo on the CPU writes straight to the output rows: see
// OutputTile in linear_io.h; the tilings keep this UB, so they are the NPU's.)
inline int64_t LinearIoUb(int64_t mt, int64_t nt, int64_t elt, LinearEpilogue ep) {
  return (ep == LINEAR_RESIDUAL ? 2 : 1) * AscendC::BUFFER_NUM * UbSlot(mt * nt * elt);
}

// The checks every linear tiling makes (errors start with "<op> tiling:"), then m, k, the segments'
// rows and the rows the cores split. segRows: n of each segment.
LinearTilingData LinearShapeTiling(const char* op, int64_t m, int64_t k, const int64_t* segRows, int64_t numSegments,
                                   LinearEpilogue ep, AscendC::DataType dtype, const AscendC::SocInfo& soc);

// STREAM: the cores split t.rows in blocks of 4 (the micro-kernels' weight-row block), on the host only
// as many cores as weightBytes (the weight traffic a core's share is counted in) pay for; the first
// tile is all M rows (up to 32), 64 weight rows and all kCols columns of K.
void StreamRowSplit(LinearTilingData& t, int64_t weightBytes, int64_t kCols, const AscendC::SocInfo& soc);

// STREAM: shrinks the tile until ub(t) fits the SoC's UB: K first down to 512 (x is re-widened per K
// chunk, cheap), then the row tile, then M (each extra M pass re-streams the weights: prefill shapes),
// then K down to its floor.
template <class UbBytes>
void StreamShrink(LinearTilingData& t, KHalving k, const char* op, const AscendC::SocInfo& soc, UbBytes ub) {
  while (ub(t) > soc.ub_size) {
    if (t.kTile > 512) {
      t.kTile = k.Halve(t.kTile);
    } else if (t.nTile > 8) {
      t.nTile = AscendC::AlignUp(t.nTile / 2, 4);
    } else if (t.mTile > 1) {
      t.mTile = AscendC::CeilDiv(t.mTile, 2);
    } else if (k.CanHalve(t.kTile)) {
      t.kTile = k.Halve(t.kTile);
    } else {
      AscendC::ThrowError(op, " tiling: UB of ", soc.ub_size, " bytes is too small");
    }
  }
  t.ubBytes = ub(t);
}

// GEMM: the smallest segment's N (a row tile never crosses a segment, so it bounds nTile).
int64_t MinSegmentRows(const LinearTilingData& t);

// GEMM with a packed fp32 weight tile: 32 weight rows (a multiple of 8 for a smaller segment) by 256
// of the kCols columns.
void GemmPackedTile(LinearTilingData& t, int64_t kCols);

// GEMM: the work units, (row tile of one segment, M pass), split over the cube cores.
void GemmUnitSplit(LinearTilingData& t, LinearEpilogue ep, const AscendC::SocInfo& soc);

// Rows of x per cube tile pass: a multiple of the micro-kernel's 6 rows.
constexpr int64_t kGemmMTile = 48;

// GEMM, once nTile and kTile are set: mTile and mPass (a packed weight tile is reused by mPass rows: the
// more, the cheaper its packing), shrunk until ub(t) fits the SoC's UB (mPass, then K, then the row
// tile, then mTile), then the work split.
template <class UbBytes>
void GemmShrinkAndSplit(LinearTilingData& t, KHalving k, LinearEpilogue ep, const char* op,
                        const AscendC::SocInfo& soc, UbBytes ub) {
  t.mTile = std::min(t.m, kGemmMTile);
  t.mPass = std::min<int64_t>(AscendC::AlignUp(t.m, t.mTile), 8 * kGemmMTile);
  while (ub(t) > soc.ub_size) {
    if (t.mPass > 2 * t.mTile) {
      t.mPass = AscendC::AlignUp(t.mPass / 2, t.mTile);
    } else if (k.CanHalve(t.kTile)) {
      t.kTile = k.Halve(t.kTile);
    } else if (t.nTile > 8) {
      t.nTile /= 2;
    } else if (t.mTile > 6) {
      t.mTile = AscendC::AlignUp(t.mTile / 2, 6);
      t.mPass = t.mTile;
    } else {
      AscendC::ThrowError(op, " tiling: UB of ", soc.ub_size, " bytes is too small");
    }
  }
  GemmUnitSplit(t, ep, soc);
  t.ubBytes = ub(t);
}

}  // namespace atb
