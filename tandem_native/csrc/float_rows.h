// Reductions over a row of fp32 values, 16 lanes at a time with a masked tail, shared by the kernels that need
// them (the decode attention's softmax, the sampler's argmax).
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

}  // namespace tandem_rows
