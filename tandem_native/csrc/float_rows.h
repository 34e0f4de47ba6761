// Reductions and elementwise maths over rows of fp32 values, 16 lanes at a time, shared by the kernels that need
// them (the decode attention's softmax, the sampler's argmax, the decode runner's SiLU).
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <limits>

namespace tandem_rows {

// The largest of x[0, n), n >= 1 (exact: a maximum rounds nothing); -inf lanes pad the tail.
inline float row_max(const float* x, int64_t n) {
  const int64_t full = n / 16 * 16;
  const __mmask16 tail = static_cast<__mmask16>((1u << (n - full)) - 1);
  __m512 top = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t i = 0; i < full; i += 16) top = _mm512_max_ps(top, _mm512_loadu_ps(x + i));
  top = _mm512_mask_max_ps(top, tail, top, _mm512_maskz_loadu_ps(tail, x + full));
  return _mm512_reduce_max_ps(top);
}

// exp(x) for x <= 0 (scores minus their maximum), 16 lanes: x = n ln2 + r with |r| <= ln2 / 2 (ln2 split in two
// parts, so r is exact to fp32), e^r by its Taylor polynomial to degree 7 (relative error below 1e-8 there), times
// 2^n. Below -87.3, where e^x is under fp32's smallest normal, the result is 0 or a denormal.
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);  // ln2's leading bits: n * hi is exact
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860682030941723212e-6f), r);
  __m512 p = _mm512_set1_ps(1.f / 5040);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 720));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

}  // namespace tandem_rows
