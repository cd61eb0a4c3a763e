// One float out of an SSE register, for the few-row NT Mmads' sums (HSum4 leaves four per register). Reading
// them back from a vector store instead made each scalar read wait on the store (ascendc/simd_avx2.cpp,
// BlockNTRows). Included by the AVX2 tables inside their namespace and target pragmas, as
// simd_hsum4.h is.
#pragma once

// Lane i of v; i is a constant after unrolling, so this is one shuffle (none for lane 0).
inline float LaneOf(__m128 v, int i) {
  switch (i) {
    case 0: return _mm_cvtss_f32(v);
    case 1: return _mm_cvtss_f32(_mm_movehdup_ps(v));
    case 2: return _mm_cvtss_f32(_mm_movehl_ps(v, v));
    default: return _mm_cvtss_f32(_mm_shuffle_ps(v, v, 3));
  }
}
