// One bf16 activation row times a bf16 weight: y[n] = sum_k w[n, k] * x[k], summed in fp32, rounded once to bf16.
//
// bf16 widens to fp32 exactly by a 16-bit shift, so each 16 weights cost a load, a shift and an FMA (no AVX512_BF16
// needed). Four weight rows share each load of the activation, with two accumulators each for independent chains,
// while the next four rows are prefetched (without it the loop waited on memory: 12 GB/s against 21 with it, one
// row of 3072 x 768 weights on 2 threads, benchmarks/gemv_probe.py).
// Rows are split over torch's intra-op threads. The sums run in another order than torch's GEMV, so the result may
// differ from F.linear's in the last bit: it serves the compiled step only (shared_model/fuse.py).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

namespace {

constexpr int64_t kRows = 4;  // weight rows per pass over the activation

inline __m512 widen(const uint16_t* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

// x [K] bf16, w [N, K] bf16 contiguous (K a multiple of 32) -> [N] bf16
torch::Tensor bf16_gemv(const torch::Tensor& x, const torch::Tensor& w) {
  TORCH_CHECK(x.is_cpu() && w.is_cpu(), "bf16_gemv: CPU tensors only");
  TORCH_CHECK(x.dim() == 1 && x.scalar_type() == at::kBFloat16, "bf16_gemv: x must be bf16 [K]");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16 && w.is_contiguous(),
              "bf16_gemv: w must be contiguous bf16 [N, K]");
  const int64_t n = w.size(0), k = w.size(1);
  TORCH_CHECK(x.size(0) == k && k % 32 == 0, "bf16_gemv: shapes do not match (K must be a multiple of 32)");
  const auto xc = x.contiguous();
  const auto* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
  const auto* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  auto y = torch::empty({n}, x.options());
  auto* yp = y.data_ptr<at::BFloat16>();
  at::parallel_for(0, (n + kRows - 1) / kRows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t pass = begin; pass < end; ++pass) {
      const int64_t r0 = pass * kRows, rows = std::min(kRows, n - r0);
      const uint16_t* row[kRows];
      for (int64_t i = 0; i < kRows; ++i) row[i] = wp + (r0 + std::min(i, rows - 1)) * k;  // past the end: unused
      __m512 a[kRows], b[kRows];
      for (int64_t i = 0; i < kRows; ++i) a[i] = b[i] = _mm512_setzero_ps();
      // the next pass's rows, prefetched meanwhile (a prefetch past the end never faults)
      const uint16_t* next = wp + std::min(r0 + kRows, n - 1) * k;
      for (int64_t c = 0; c < k; c += 32) {
        const __m512 x0 = widen(xp + c), x1 = widen(xp + c + 16);
        for (int64_t i = 0; i < kRows; ++i) _mm_prefetch(reinterpret_cast<const char*>(next + i * k + c), _MM_HINT_T0);
        for (int64_t i = 0; i < kRows; ++i) {
          a[i] = _mm512_fmadd_ps(widen(row[i] + c), x0, a[i]);
          b[i] = _mm512_fmadd_ps(widen(row[i] + c + 16), x1, b[i]);
        }
      }
      for (int64_t i = 0; i < rows; ++i) yp[r0 + i] = at::BFloat16(_mm512_reduce_add_ps(_mm512_add_ps(a[i], b[i])));
    }
  });
  return y;
}

}  // namespace

// The schema beside int8_gemv's (TORCH_LIBRARY in int8_gemv.cpp); its fake kernel is registered from Python
// (shared_model/cpu_kernels.py).
TORCH_LIBRARY_FRAGMENT(tandem_cpu, m) { m.def("bf16_gemv(Tensor x, Tensor w) -> Tensor"); }
TORCH_LIBRARY_IMPL(tandem_cpu, CPU, m) { m.impl("bf16_gemv", &bf16_gemv); }
