// The quantized linear's own SIMD micro-kernels: GEMV over int4/int8 weights
// dequantized in registers, and row dequantization (GEMM packing, embedding
// rows). One table per ISA (AVX-512 F/BW/VL, AVX2+FMA, portable C++), chosen
// at first use from CPUID; ATB_QUANT_ISA=avx512-i16|avx512|avx2|portable in the
// environment, or SelectQuantSimd, forces one so tests run every path the CPU
// can execute (and "avx512-i16-simde", the AVX512-VNNI W4 GEMV built against
// SIMDe). Kept apart from the AscendC vector table (ascendc/simd.h) so the two
// evolve independently.
//
// Weight layouts (rows of kPad = K rounded up to 32 values, padding q = 0):
//   W8  int8, row-major, one byte per value.
//   W4  16 bytes per 32 values along K: byte j of a chunk holds value j in its
//       low nibble and value j + 16 in its high nibble (GGUF's Q4_0/Q4_1 block
//       layout, so GGUF blocks load without repacking). One AVX-512 load of 16
//       bytes widened to 16 int32 lanes gives values 0..15 (AND 0xF) and
//       16..31 (>> 4), both in natural x order: no shuffles.
// Scales (and W4 mins) arrive here as fp32 [N, lds]: the kernels widen a tile's
// fp16/bf16/fp32 scales into UB first. The int16 routes (AVX2) take them as stored
// instead (QuantScaleRows) and widen each row block's while the block before it computes.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "ascendc/dtype.h"

namespace atb {

// The group scales (and W4 mins) of a GEMV's N rows as stored: row n at element n * lds of scale/min,
// of type `type`. Unless fp32 they span whole rows (lds = the row's groups) and the GEMV widens them into
// scratch/minScratch (N x lds fp32 each, UB)
// a row block ahead of its use, so their loads overlap the previous block's arithmetic where a
// separate widening pass over the tile stalled on them (quant_linear_kernel.cpp).
struct QuantScaleRows {
  const void* scale = nullptr;
  const void* min = nullptr;  // W4 only
  int64_t lds = 0;
  AscendC::DataType type = AscendC::DataType::FLOAT32;
  float* scratch = nullptr;
  float* minScratch = nullptr;
};

// Bound on min(M, 4) x kLen / 32 of one gemv_w4 call (its x group sums live on the stack).
constexpr int64_t kQuantMaxGroupSums = 8192;
// The one group size below a 32-value chunk, W8 only (GGUF's Q6_K: a scale per 16 values): each chunk holds
// two groups, each of its SIMD registers' values one group.
constexpr int64_t kQuantHalfChunkGroup = 16;

// gemv_w4_i16's x layouts (InterleaveXInt16ForW4): int16 pairs of chunks for the 256-bit vpmaddwd GEMV
// (quant_simd_avx2.cpp), byte planes for the AVX512-VNNI vpdpbusd one (quant_simd_avx512_vnni.cpp).
enum class W4XLayout { kPairs, kBytePlanes };

struct QuantSimdOps {
  const char* isa;
  // W4 GEMV over one K chunk of kLen values (a multiple of 32) and groups of G
  // values (a multiple of 32; the last group may be shorter; W8 also takes G = 16):
  //   y[m*ldy + n] (+)= sum_g scale[n*lds + g] * sum_{k in g} q(n, k) * x[m*ldx + k]
  //                     + min[n*lds + g] * sum_{k in g} x[m*ldx + k]
  // with the group sums of x given per 32-value chunk: xsum[m*ldxs + c].
  // q(n, k) is row n at q + n*ldq bytes. Every weight byte is loaded once per
  // block of up to 4 rows of x.
  void (*gemv_w4)(float* y, int64_t ldy, const float* x, int64_t ldx, const float* xsum, int64_t ldxs,
                  const uint8_t* q, int64_t ldq, const float* scale, const float* min, int64_t lds, int64_t M,
                  int64_t N, int64_t kLen, int64_t G, bool accumulate);
  // W8 GEMV, symmetric: y[m*ldy + n] (+)= sum_g scale[n*lds + g] * sum_{k in g} q(n, k) * x[m*ldx + k].
  void (*gemv_w8)(float* y, int64_t ldy, const float* x, int64_t ldx, const int8_t* q, int64_t ldq,
                  const float* scale, int64_t lds, int64_t M, int64_t N, int64_t kLen, int64_t G, bool accumulate);
  // W4 GEMV with bf16 activations: as gemv_w4, x given as bf16 bits (zero-padded to kLen). Null
  // unless the CPU has AVX512-BF16: there the nibbles become bf16 through a 16-entry vpermw table and
  // meet x in vdpbf16ps, 32 weights per instruction, where the fp32 route needs two int->float
  // conversions and two FMAs (it is compute-bound at W4's byte rate). Products of a 4-bit integer
  // and a bf16 value are exact in fp32, so with bf16 x the numbers are those of the fp32 route up to
  // the order of the fp32 additions.
  void (*gemv_w4_bf16)(float* y, int64_t ldy, const uint16_t* x, int64_t ldx, const float* xsum, int64_t ldxs,
                       const uint8_t* q, int64_t ldq, const float* scale, const float* min, int64_t lds, int64_t M,
                       int64_t N, int64_t kLen, int64_t G, bool accumulate);
  // W4 / W8 GEMV with x given as int16 per 32-value chunk: x(m, k) = xq[m*ldx + k] * xscale[m*ldxc + k/32].
  // Null unless the table has it (AVX2: without a bf16 dot product, int->float conversions and FMAs bound
  // the fp32 route at half of W8's and a third of W4's byte rate). vpmaddwd multiplies the unpacked weights
  // (int16) by xq and adds pairs: 16 exact products per instruction; a lane's four products per chunk sum
  // exactly in int32 (|sum| <= 4 * 128 * 32767 < 2^24, so its conversion to fp32 is exact too), then
  // t = fma(sum, xscale, t) per chunk and scale * t per group as the fp32 route does. The kernel gives it
  // only 16-bit activations (quantize_x_i16), which int16 with a power-of-two scale represents exactly
  // wherever a value is within 2^7 (bf16) or 2^4 (fp16) of its chunk's largest.
  // Their scales come as stored (QuantScaleRows). gemv_w4_i16 takes xq as InterleaveXInt16ForW4 lays it out
  // for w4_i16_x (ldx a multiple of 128), gemv_w8_i16 as QuantizeXInt16 writes it.
  void (*gemv_w4_i16)(float* y, int64_t ldy, const int16_t* xq, int64_t ldx, const float* xscale, int64_t ldxc,
                      const float* xsum, int64_t ldxs, const uint8_t* q, int64_t ldq, const QuantScaleRows& scales,
                      int64_t M, int64_t N, int64_t kLen, int64_t G, bool accumulate);
  void (*gemv_w8_i16)(float* y, int64_t ldy, const int16_t* xq, int64_t ldx, const float* xscale, int64_t ldxc,
                      const int8_t* q, int64_t ldq, const QuantScaleRows& scales, int64_t M, int64_t N, int64_t kLen,
                      int64_t G, bool accumulate);
  // One row, kLen values (a multiple of 32): dst[k] = fma(q(k), scale[k / G], min[k / G]) (W4),
  // q(k) * scale[k / G] (W8); one rounding, as gguf's own dequantization.
  void (*dequant_w4)(float* dst, const uint8_t* q, const float* scale, const float* min, int64_t kLen, int64_t G);
  void (*dequant_w8)(float* dst, const int8_t* q, const float* scale, int64_t kLen, int64_t G);
  // How gemv_w4_i16 takes x (InterleaveXInt16ForW4).
  W4XLayout w4_i16_x = W4XLayout::kPairs;
};

// x (kLen fp32 values that came from fp16/bf16, kLen a multiple of 32) as int16 per 32-value chunk for the
// gemv_*_i16 routes: scale[c] = 2^(e - 14), e the exponent of the chunk's largest |x|, and xq = x / scale
// rounded to nearest even (exact for 16-bit inputs within 2^7 of that largest value; |xq| <= 32767 since
// such a value has at most 11 significant bits). A chunk of zeros gets scale 0; a chunk holding a NaN or an
// infinity gets scale NaN, so every output it feeds is NaN, as in the fp32 route.
void QuantizeXInt16(int16_t* xq, float* scale, const float* x, int64_t kLen);

// QuantizeXInt16's xq (kLen values, a multiple of 32) in the order gemv_w4_i16 reads W4 weights, as stored:
// each 16-bit word of a chunk's 16 bytes holds the values 2w and 2w + 16 (byte 2w's nibbles) and 2w + 1 and
// 2w + 17 (byte 2w + 1's). dst holds kLen rounded up to 128 values, zeros past kLen; it may be xq (rewritten
// in place).
//   kPairs: two chunks per 32-byte load. Per pair of chunks c = 2p and c + 1, 64 values at dst + 64 p, four
//     runs of 16: run j's first 8 from chunk c, its last 8 from chunk c + 1, value w of each half being x[2w],
//     x[2w + 16], x[2w + 1], x[2w + 17] of its chunk for j = 0, 1, 2, 3.
//   kBytePlanes: four chunks per 64-byte load, whose nibbles unpack to bytes (lo: value j of chunk i at byte
//     16 i + j; hi: value j + 16 there). Per four chunks from c = 4p, 256 bytes at dst + 128 p: four planes
//     of 64 bytes, xl of the lo order, xl of the hi order, xh of lo, xh of hi, where xq = 256 xh + xl
//     (xh = xq >> 8 as int8, xl = xq & 255 as uint8).
void InterleaveXInt16ForW4(int16_t* dst, const int16_t* xq, int64_t kLen, W4XLayout layout);

const QuantSimdOps& QuantSimd();
const QuantSimdOps* QuantPortableOps();
const QuantSimdOps* QuantAvx2Ops();    // null when not compiled in
// The AVX2 table's int16 GEMVs built for a CPU that also runs AVX-512 (their far weight prefetch at the
// distance measured there), which the avx512-i16 path takes; null when not compiled in.
struct QuantInt16Gemvs {
  decltype(QuantSimdOps::gemv_w4_i16) w4;
  decltype(QuantSimdOps::gemv_w8_i16) w8;
};
const QuantInt16Gemvs* QuantAvx2Int16GemvsForAvx512Host();
const QuantSimdOps* QuantAvx512Ops();  // null when not compiled in
// The AVX512-VNNI W4 GEMV (x in kBytePlanes), which the avx512-i16 path takes where the CPU has VNNI; null
// when not compiled in.
decltype(QuantSimdOps::gemv_w4_i16) QuantAvx512VnniW4Gemv();
decltype(QuantSimdOps::gemv_w4_i16) QuantAvx512VnniW4GemvSimde();  // the same against SIMDe (test-only)
// "auto", "avx512-i16" (quant_simd.cpp), "avx512", "avx2", "portable" or the test-only "avx512-i16-simde";
// throws when the CPU cannot run it.
void SelectQuantSimd(const std::string& isa);
// The paths this CPU can run, fastest first down to "portable", then "avx512-i16-simde" where built.
std::vector<std::string> QuantIsaPaths();

}  // namespace atb
