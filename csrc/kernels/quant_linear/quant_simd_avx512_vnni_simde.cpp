// The AVX512-VNNI W4 GEMV compiled a second time against SIMDe (test-only quantized path
// "avx512-i16-simde"): its portable implementations of the intrinsics run that code's logic on any CPU.
// Built when setup.py found SIMDe's headers (the simde-py package); otherwise the path is absent.
#include "quant_simd.h"

#if __has_include(<simde/x86/avx512.h>)
#define ATB_QUANT_SIMDE 1
#include "quant_simd_avx512_vnni.cpp"
#else
namespace atb {
decltype(QuantSimdOps::gemv_w4_i16) QuantAvx512VnniW4GemvSimde() { return nullptr; }
}  // namespace atb
#endif
