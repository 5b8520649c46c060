// The float vector primitives the hand-written CPU kernels (the decode and extend attention,
// sampling) are written in: one vector of kLanes fp32 lanes, AVX-512 (16) or AVX2 with FMA
// (8), whichever the kernel is built for (native_kernel.py picks the flags). Only this code
// differs between the two ISAs.
#pragma once

#include <c10/util/BFloat16.h>

#include <immintrin.h>

#include <cstdint>

#include "cpu_vector_exp.h"

namespace {

// ---- the vector primitives: one float vector of kLanes lanes ----

#if defined(__AVX512F__)
constexpr int kLanes = 16;
using Vec = __m512;

inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline Vec vload(const c10::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline void vstore(float* p, Vec v) { _mm512_storeu_ps(p, v); }
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vset1(float x) { return _mm512_set1_ps(x); }
inline Vec vmul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
inline Vec vsub(Vec a, Vec b) { return _mm512_sub_ps(a, b); }
inline Vec vadd(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline Vec vfmadd(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline float vsum(Vec v) { return _mm512_reduce_add_ps(v); }
inline float vmax(Vec v) { return _mm512_reduce_max_ps(v); }
inline Vec vmaximum(Vec a, Vec b) { return _mm512_max_ps(a, b); }
// lanes that are NaN, lanes of a equal to b, and lanes of a >= b, as bit masks (lane i: bit i)
inline uint32_t vnan_lanes(Vec v) { return _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q); }
inline uint32_t vequal_lanes(Vec a, Vec b) { return _mm512_cmp_ps_mask(a, b, _CMP_EQ_OQ); }
inline uint32_t vge_lanes(Vec a, Vec b) { return _mm512_cmp_ps_mask(a, b, _CMP_GE_OQ); }
inline Vec vexp(Vec x) { return exp512(x); }  // cpu_vector_exp.h
// v's lanes where a >= b (ordered: NaN is not), the others 0
inline Vec vzero_unless_ge(Vec v, Vec a, Vec b) {
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(a, b, _CMP_GE_OQ), v);
}
// v's first n lanes, the others `other`
inline Vec vfirst(Vec v, int n, float other) {
  const __mmask16 valid = n == kLanes ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1);
  return _mm512_mask_mov_ps(_mm512_set1_ps(other), valid, v);
}
// v's lanes lo..hi - 1 (0 <= lo <= hi <= kLanes), the others `other`
inline Vec vbetween(Vec v, int lo, int hi, float other) {
  const __mmask16 valid = __mmask16(((1u << hi) - 1) & ~((1u << lo) - 1));
  return _mm512_mask_mov_ps(_mm512_set1_ps(other), valid, v);
}

// The 16 sums of 16 vectors' lanes (out[t] = sum of v[t]'s lanes), by a transposing tree:
// ~3 instructions a vector, against ~8 for a horizontal sum of each. `v` is 64-byte aligned.
inline Vec sum_lanes(const float (*v)[kLanes]) {
  __m512 pairs[8];
  for (int j = 0; j < 8; ++j) {  // per 128-bit lane: 2 vectors' partial sums, 2 each
    const __m512 a = _mm512_load_ps(v[2 * j]), b = _mm512_load_ps(v[2 * j + 1]);
    pairs[j] = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  }
  __m512 quads[4];
  for (int j = 0; j < 4; ++j) {  // per 128-bit lane: 4 vectors' partial sums
    const __m512d a = _mm512_castps_pd(pairs[2 * j]), b = _mm512_castps_pd(pairs[2 * j + 1]);
    quads[j] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  __m512 halves[2];
  for (int j = 0; j < 2; ++j) {  // add 128-bit lanes pairwise
    const __m512 a = quads[2 * j], b = quads[2 * j + 1];
    halves[j] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(2, 0, 2, 0)),
                              _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
  }
  return _mm512_add_ps(_mm512_shuffle_f32x4(halves[0], halves[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(halves[0], halves[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

#elif defined(__AVX2__) && defined(__FMA__)
constexpr int kLanes = 8;
using Vec = __m256;

inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline Vec vload(const c10::BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
inline void vstore(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vset1(float x) { return _mm256_set1_ps(x); }
inline Vec vmul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
inline Vec vsub(Vec a, Vec b) { return _mm256_sub_ps(a, b); }
inline Vec vadd(Vec a, Vec b) { return _mm256_add_ps(a, b); }
inline Vec vfmadd(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
// One lane reduction for the sum and the max: the halves, then lanes 0-1 with 2-3, then 0 with 1.
template <class Op>
inline float reduce(Vec v, Op op) {
  __m128 x = op(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = op(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(op(x, _mm_movehdup_ps(x)));
}
inline float vsum(Vec v) {
  return reduce(v, [](__m128 a, __m128 b) { return _mm_add_ps(a, b); });
}
inline float vmax(Vec v) {
  return reduce(v, [](__m128 a, __m128 b) { return _mm_max_ps(a, b); });
}
inline Vec vmaximum(Vec a, Vec b) { return _mm256_max_ps(a, b); }
inline uint32_t vnan_lanes(Vec v) {
  return static_cast<uint32_t>(_mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
}
inline uint32_t vequal_lanes(Vec a, Vec b) {
  return static_cast<uint32_t>(_mm256_movemask_ps(_mm256_cmp_ps(a, b, _CMP_EQ_OQ)));
}
inline uint32_t vge_lanes(Vec a, Vec b) {
  return static_cast<uint32_t>(_mm256_movemask_ps(_mm256_cmp_ps(a, b, _CMP_GE_OQ)));
}
inline Vec vexp(Vec x) { return exp256(x); }  // cpu_vector_exp.h
inline Vec vzero_unless_ge(Vec v, Vec a, Vec b) {
  return _mm256_and_ps(v, _mm256_cmp_ps(a, b, _CMP_GE_OQ));
}
inline Vec vfirst(Vec v, int n, float other) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256 valid = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n), lane));
  return _mm256_blendv_ps(_mm256_set1_ps(other), v, valid);
}
inline Vec vbetween(Vec v, int lo, int hi, float other) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i below_hi = _mm256_cmpgt_epi32(_mm256_set1_epi32(hi), lane);
  const __m256i from_lo = _mm256_cmpgt_epi32(lane, _mm256_set1_epi32(lo - 1));
  const __m256 valid = _mm256_castsi256_ps(_mm256_and_si256(below_hi, from_lo));
  return _mm256_blendv_ps(_mm256_set1_ps(other), v, valid);
}

// The 8 sums of 8 vectors' lanes (out[t] = sum of v[t]'s lanes): two rounds of pairwise
// horizontal adds leave each 128-bit half holding 4 vectors' partial sums; the halves add.
inline Vec sum_lanes(const float (*v)[kLanes]) {
  __m256 pairs[4];
  for (int j = 0; j < 4; ++j)
    pairs[j] = _mm256_hadd_ps(_mm256_load_ps(v[2 * j]), _mm256_load_ps(v[2 * j + 1]));
  const __m256 low = _mm256_hadd_ps(pairs[0], pairs[1]);   // vectors 0-3, per half
  const __m256 high = _mm256_hadd_ps(pairs[2], pairs[3]);  // vectors 4-7, per half
  return _mm256_add_ps(_mm256_permute2f128_ps(low, high, 0x20),
                       _mm256_permute2f128_ps(low, high, 0x31));
}

#else
#error "the CPU kernels need AVX-512 (-mavx512f) or AVX2 with FMA (-mavx2 -mfma)"
#endif

}  // namespace
