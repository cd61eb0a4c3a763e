// The AVX-512 table compiled a second time against SIMDe (test-only table
// "avx512-simde"): its portable implementations of the AVX-512 intrinsics run
// the AVX-512 code's logic on any CPU. Built when setup.py found SIMDe's
// headers (the simde-py package); otherwise the table is absent. So is its AMX form, "avx512-amx-simde"
// (simd_amx.h: the AMX GEMM over an emulation of the tile instructions).
#include "simd.h"

#if __has_include(<simde/x86/avx512.h>)
#define ATB_SIMD_SIMDE 1
#include "simd_avx512.cpp"
#else
namespace AscendC {
const SimdOps* Avx512SimdeSimdOps() { return nullptr; }
const SimdOps* Avx512AmxSimdeSimdOps() { return nullptr; }
}  // namespace AscendC
#endif
