// One row times an int8 weight (values in [-127, 127], as shared_model.quantize makes them), with AVX-512 VNNI: y[n] = scale[n] * sum_g s_g * sum_{k in g} w[n, k] * xq[k].
//
// The activation row x is quantized once per call to int8 in groups of `group` inputs (s_g = max|x_g| / 127,
// xq = nearbyint(x * (1 / s_g)), as shared_model/int8_gemv.py's reference does); each group's int8 dot products
// run on vpdpbusd (unsigned x signed bytes: |xq| times w with xq's sign moved onto w), are summed in int32 over
// the group (at most 256 products of |127| x |127|: no overflow), then scaled in fp32. Eight weight rows share
// each load of the activation's bytes, while the next eight are prefetched into L2 (measured with
// benchmarks/gemv_probe.py: docs/benchmarks-archive.md §7; L2 rather than L1: docs/benchmarks.md §43). Rows are
// split over torch's intra-op threads.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "kernels.h"

namespace {

constexpr int64_t kRows = 8;  // weight rows per pass over the activation

// X: the activation's and the result's element type, S: the scales' (fp32 or a 16-bit float, read as fp32: exact).
template <typename X, typename S>
torch::Tensor int8_gemv_typed(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& scales,
                              int64_t group) {
  const int64_t n = w.size(0), k = w.size(1);
  TORCH_CHECK(x.is_cpu() && w.is_cpu() && scales.is_cpu(), "int8_gemv: CPU tensors only");
  TORCH_CHECK(x.size(0) == k && scales.size(0) == n, "int8_gemv: shapes do not match");
  TORCH_CHECK(group > 0 && group % 64 == 0 && group <= 256 && k % group == 0,
              "int8_gemv: group must be 64, 128 or 256 and divide K");
  const int64_t groups = k / group, regs = group / 64;

  // The activation: |xq| 64-byte aligned, the sign of each byte as a mask, one scale per group.
  std::vector<int8_t> abs_buffer(k + 64);
  auto* xabs = reinterpret_cast<int8_t*>((reinterpret_cast<uintptr_t>(abs_buffer.data()) + 63) & ~uintptr_t(63));
  std::vector<__mmask64> negative(k / 64);
  std::vector<float> group_scale(groups);
  const X* xp = x.data_ptr<X>();
  for (int64_t g = 0; g < groups; ++g) {
    float amax = 0.f;
    bool finite = true;
    for (int64_t i = g * group; i < (g + 1) * group; ++i) {
      const float v = static_cast<float>(xp[i]);
      finite = finite && std::isfinite(v);
      amax = std::max(amax, std::fabs(v));
    }
    // A group holding NaN or Inf gets a NaN scale, so every output is NaN, as the float product would be (the
    // sampler then refuses the row). A group too small for its reciprocal counts as zero, as in the reference.
    const float s = amax / 127.f;
    const bool zero = !(s >= std::numeric_limits<float>::min());
    group_scale[g] = finite ? (zero ? 0.f : s) : std::numeric_limits<float>::quiet_NaN();
    const float inv = finite && !zero ? 1.f / s : 0.f;
    for (int64_t i = g * group; i < (g + 1) * group; i += 64) {
      alignas(64) int8_t q[64];
      for (int j = 0; j < 64; ++j) {
        const float r = std::nearbyint(static_cast<float>(xp[i + j]) * inv);  // within [-127, 127]; 0 for a non-finite group
        q[j] = static_cast<int8_t>(std::isfinite(r) ? std::clamp(r, -127.f, 127.f) : 0.f);
      }
      const __m512i qv = _mm512_load_si512(q);
      negative[i / 64] = _mm512_movepi8_mask(qv);
      _mm512_store_si512(xabs + i, _mm512_abs_epi8(qv));
    }
  }

  auto y = torch::empty({n}, x.options());
  X* yp = y.data_ptr<X>();
  const int8_t* wp = w.data_ptr<int8_t>();
  const S* sp = scales.data_ptr<S>();
  at::parallel_for(0, (n + kRows - 1) / kRows, 64 / kRows, [&](int64_t begin, int64_t end) {
    const __m512i zero = _mm512_setzero_si512();
    for (int64_t pass = begin; pass < end; ++pass) {
      const int64_t r0 = pass * kRows, rows = std::min(kRows, n - r0);
      __m512 acc[kRows];
      for (int64_t i = 0; i < kRows; ++i) acc[i] = _mm512_setzero_ps();
      // the next pass's rows, prefetched meanwhile (a prefetch past the end never faults)
      const int8_t* next = wp + std::min(r0 + kRows, n - 1) * k;
      for (int64_t g = 0; g < groups; ++g) {
        __m512i dot[kRows];
        for (int64_t i = 0; i < kRows; ++i) dot[i] = zero;
        for (int64_t r = 0; r < regs; ++r) {
          const int64_t off = g * group + r * 64;
          for (int64_t i = 0; i < kRows; ++i)
            _mm_prefetch(reinterpret_cast<const char*>(next + i * k + off), _MM_HINT_T1);
          const __m512i xa = _mm512_load_si512(xabs + off);
          const __mmask64 neg = negative[off / 64];
          for (int64_t i = 0; i < rows; ++i) {
            const __m512i wv = _mm512_loadu_si512(wp + (r0 + i) * k + off);
            dot[i] = _mm512_dpbusd_epi32(dot[i], xa, _mm512_mask_sub_epi8(wv, neg, zero, wv));
          }
        }
        const __m512 s = _mm512_set1_ps(group_scale[g]);
        for (int64_t i = 0; i < rows; ++i) acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[i]), s, acc[i]);
      }
      for (int64_t i = 0; i < rows; ++i)  // rounded once to X (to nearest even, as Tensor.to)
        yp[r0 + i] = static_cast<X>(_mm512_reduce_add_ps(acc[i]) * static_cast<float>(sp[r0 + i]));
    }
  });
  return y;
}

template <typename X>
torch::Tensor with_scales(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& scales, int64_t group) {
  switch (scales.scalar_type()) {
    case at::kFloat: return int8_gemv_typed<X, float>(x, w, scales, group);
    case at::kBFloat16: return int8_gemv_typed<X, at::BFloat16>(x, w, scales, group);
    case at::kHalf: return int8_gemv_typed<X, at::Half>(x, w, scales, group);
    default: TORCH_CHECK(false, "int8_gemv: scales must be fp32, bf16 or fp16, got ", scales.scalar_type());
  }
}

// The operator: x [K] and scales [N] in fp32 or a 16-bit float, read in place (no conversion copies: three fewer
// small tensors a call); the result [N] in x's dtype, computed in fp32 and rounded once.
torch::Tensor int8_gemv(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& scales, int64_t group) {
  TORCH_CHECK(x.is_cpu() && w.is_cpu() && scales.is_cpu(), "int8_gemv: CPU tensors only");
  TORCH_CHECK(x.dim() == 1, "int8_gemv: x must be [K]");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kChar && w.is_contiguous(), "int8_gemv: w must be int8 [N, K]");
  TORCH_CHECK(scales.dim() == 1, "int8_gemv: scales must be [N]");
  const auto xc = x.contiguous();
  const auto sc = scales.contiguous();
  switch (x.scalar_type()) {
    case at::kFloat: return with_scales<float>(xc, w, sc, group);
    case at::kBFloat16: return with_scales<at::BFloat16>(xc, w, sc, group);
    case at::kHalf: return with_scales<at::Half>(xc, w, sc, group);
    default: TORCH_CHECK(false, "int8_gemv: x must be fp32, bf16 or fp16, got ", x.scalar_type());
  }
}

}  // namespace

at::Tensor tandem_kernels::int8_gemv_op(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales,
                                        int64_t group) {
  return int8_gemv(x, w, scales, group);
}

// A C++ operator, so that a step calls it through the dispatcher without a Python wrapper's cost per call;
// its fake kernel for tracing is registered from Python (tandem_native/loader.py).
TORCH_LIBRARY_FRAGMENT(tandem, m) { m.def("int8_gemv(Tensor x, Tensor w, Tensor scales, int group) -> Tensor"); }
TORCH_LIBRARY_IMPL(tandem, CPU, m) { m.impl("int8_gemv", &int8_gemv); }

// Its entry in the library's Python module (module.cpp); the GIL is released while it runs.
void register_int8_gemv(pybind11::module_& m) {
  m.def("int8_gemv", &int8_gemv, "one row times an int8 weight (VNNI)",
        pybind11::call_guard<pybind11::gil_scoped_release>());
}
