// e^x on float vectors, inline, for the hand-written CPU attention kernels (decode and extend):
// not ATen's Sleef exp, whose call spills the vector registers the kernels' loops hold
// (queries and sums, ~30) and loads them back.
//
// e^x = 2^n e^r with n = round(x log2 e), r = x - n ln 2 (ln 2 in two parts), |r| <= ln 2 / 2,
// e^r to degree 6 (relative error ~1.2e-7, about an fp32 step). x is clamped below at
// kExpLowest (under fp32's normal range): it gives ~1e-38 there, not 0, and -inf (a masked
// lane, masked again after) stays finite.
#pragma once

#include <immintrin.h>

namespace sessionserve_exp {

constexpr float kExpLowest = -87.3f;
constexpr float kLog2E = 1.44269504f;
constexpr float kLn2High = 0.693145752f, kLn2Low = 1.42860677e-6f;
constexpr float kExpTaylor[] = {1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f};

}  // namespace sessionserve_exp

#if defined(__AVX512F__)
// scalef applies 2^n
inline __m512 exp512(__m512 x) {
  using namespace sessionserve_exp;
  x = _mm512_max_ps(x, _mm512_set1_ps(kExpLowest));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2E)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2High), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Low), r);
  __m512 p = _mm512_set1_ps(kExpTaylor[0]);
  for (int i = 1; i < 7; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpTaylor[i]));
  return _mm512_scalef_ps(p, n);
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
// 2^n put in the exponent bits (no scalef in AVX2), x also clamped above so that n + 127
// stays a normal exponent
inline __m256 exp256(__m256 x) {
  using namespace sessionserve_exp;
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(kExpLowest)), _mm256_set1_ps(88.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2E)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2High), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Low), r);
  __m256 p = _mm256_set1_ps(kExpTaylor[0]);
  for (int i = 1; i < 7; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpTaylor[i]));
  const __m256i two_n = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(two_n));
}
#endif
