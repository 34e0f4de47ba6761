// Activation rows times an int8 weight (values in [-127, 127], as shared_model.quantize makes them; -128 is not
// checked for, per call, and would take the wrong sign in `one_row`), with AVX-512 VNNI:
// y[m, n] = scale[n] * sum_g s_mg * sum_{k in g} w[n, k] * xq[m, k].
//
// Each activation row is quantized once per call to int8 in groups of `group` inputs (s_mg = max|x_mg| / 127,
// xq = nearbyint(x * (1 / s_mg)), as shared_model/int8_gemv.py's reference does). The products run on vpdpbusd,
// which multiplies unsigned by signed bytes: the weight's bytes go in offset by 128 (w + 128 in [1, 255], one XOR a
// loaded vector, shared by every activation row), the signed xq as they are, and each lane's 128 * sum xq over the
// group (computed once a call) is taken off the sum again: the int32 lanes are exactly sum w * xq (at most 256
// products of |255| x |127| a lane: no overflow). Each group's lanes are then scaled in fp32 and added up, in the
// same order at any row count, so a row's bits do not depend on the others in the call.
//
// Passes: kRows weight rows at a time, split over torch's intra-op threads (a thread done with its share takes
// passes from the back of a slower one's: balanced.h), the rows the thread reads next prefetched into L2
// meanwhile (measured with benchmarks/gemv_probe.py: docs/benchmarks-archive.md §7; L2 rather than L1:
// docs/benchmarks.md §43). One row runs eight weight rows against it (`one_row`: the sign moved onto the weight
// instead of the offset, the same bits); more run four weight rows against two activation rows at a time, the
// pass's weight rows staying in L1 for the next two.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

#include "balanced.h"
#include "kernels.h"
#include "line_aligned.h"

namespace {

template <typename T>
using Aligned = std::vector<T, tandem_aligned::LineAligned<T>>;

// The activation rows as the products take them: xq [m, k] (64-byte aligned rows), each group's scale s [m, groups]
// and the offset's share of each lane, 128 * sum xq over the lane's bytes of the group: off [m, groups] vectors.
struct Quantized {
  Aligned<int8_t> xq;
  Aligned<__m512i> off;
  std::vector<float> scale;
};

// One group's scale s = max|x| / 127 and the reciprocal the codes are rounded with: a group holding NaN or Inf gets a
// NaN scale, so every output is NaN, as the float product would be (the sampler then refuses the row); a group too
// small for its reciprocal counts as zero (reciprocal 0), as in the reference.
template <typename X>
inline std::pair<float, float> group_scale(const X* x, int64_t group) {
  float amax = 0.f;
  bool finite = true;
  for (int64_t i = 0; i < group; ++i) {
    const float v = static_cast<float>(x[i]);
    finite = finite && std::isfinite(v);
    amax = std::max(amax, std::fabs(v));
  }
  const float s = amax / 127.f;
  const bool zero = !(s >= std::numeric_limits<float>::min());
  if (!finite) return {std::numeric_limits<float>::quiet_NaN(), 0.f};
  return zero ? std::pair{0.f, 0.f} : std::pair{s, 1.f / s};
}

// 64 inputs rounded to int8 with the group's reciprocal: within [-127, 127]; 0 where the group is not finite.
template <typename X>
inline __m512i codes64(const X* x, float inv) {
  alignas(64) int8_t q[64];
  for (int j = 0; j < 64; ++j) {
    const float v = std::nearbyint(static_cast<float>(x[j]) * inv);
    q[j] = static_cast<int8_t>(std::isfinite(v) ? std::clamp(v, -127.f, 127.f) : 0.f);
  }
  return _mm512_load_si512(q);
}

template <typename X>
Quantized quantize_rows(const X* xp, int64_t m, int64_t k, int64_t group) {
  const int64_t groups = k / group;
  Quantized a{Aligned<int8_t>(m * k), Aligned<__m512i>(m * groups), std::vector<float>(m * groups)};
  at::parallel_for(0, m, 1, [&](int64_t begin, int64_t end) {  // each row its own slices of a
    const __m512i bias = _mm512_set1_epi8(static_cast<char>(0x80));  // 128 as an unsigned byte
    for (int64_t r = begin; r < end; ++r)
      for (int64_t g = 0; g < groups; ++g) {
        const X* x = xp + r * k + g * group;
        const auto [s, inv] = group_scale(x, group);
        a.scale[r * groups + g] = s;
        __m512i off = _mm512_setzero_si512();
        for (int64_t i = 0; i < group; i += 64) {
          const __m512i q = codes64(x + i, inv);
          _mm512_store_si512(a.xq.data() + r * k + g * group + i, q);
          off = _mm512_dpbusd_epi32(off, bias, q);
        }
        a.off[r * groups + g] = off;
      }
  });
  return a;
}

// One row, eight weight rows a pass: |xq| as the unsigned operand and xq's sign moved onto the weight (one masked
// subtraction a vector). The same int32 lanes as `dots` (exactly sum w * xq) and the same fp32 steps after them, so
// the same bits; measured faster for one row than `dots<8, 1>` (docs/benchmarks.md §43).
template <typename X, typename S>
void one_row(const X* xp, const int8_t* wp, const S* sp, int64_t n, int64_t k, int64_t group, X* yp) {
  constexpr int64_t kRows = 8;
  const int64_t groups = k / group, regs = group / 64;
  Aligned<int8_t> xabs(k);  // |xq|, the sign of each byte as a mask, one scale per group
  std::vector<__mmask64> negative(k / 64);
  std::vector<float> scale(groups);
  for (int64_t g = 0; g < groups; ++g) {
    const auto [s, inv] = group_scale(xp + g * group, group);
    scale[g] = s;
    for (int64_t i = g * group; i < (g + 1) * group; i += 64) {
      const __m512i q = codes64(xp + i, inv);
      negative[i / 64] = _mm512_movepi8_mask(q);
      _mm512_store_si512(xabs.data() + i, _mm512_abs_epi8(q));
    }
  }
  tandem_balanced::balanced_passes((n + kRows - 1) / kRows, 64 / kRows, [&](int64_t pass, bool forward) {
    const __m512i zero = _mm512_setzero_si512();
    const int64_t r0 = pass * kRows, rows = std::min(kRows, n - r0);
    __m512 acc[kRows];
    for (int64_t i = 0; i < kRows; ++i) acc[i] = _mm512_setzero_ps();
    // the pass this thread reads next (a prefetch past the end never faults)
    const int8_t* next = wp + (forward ? std::min(r0 + kRows, n - 1) : std::max<int64_t>(r0 - kRows, 0)) * k;
    for (int64_t g = 0; g < groups; ++g) {
      __m512i dot[kRows];
      for (int64_t i = 0; i < kRows; ++i) dot[i] = zero;
      for (int64_t r = 0; r < regs; ++r) {
        const int64_t off = g * group + r * 64;
        for (int64_t i = 0; i < kRows; ++i)
          _mm_prefetch(reinterpret_cast<const char*>(next + i * k + off), _MM_HINT_T1);
        const __m512i xa = _mm512_load_si512(xabs.data() + off);
        const __mmask64 neg = negative[off / 64];
        for (int64_t i = 0; i < rows; ++i) {
          const __m512i wv = _mm512_loadu_si512(wp + (r0 + i) * k + off);
          dot[i] = _mm512_dpbusd_epi32(dot[i], xa, _mm512_mask_sub_epi8(wv, neg, zero, wv));
        }
      }
      const __m512 s = _mm512_set1_ps(scale[g]);
      for (int64_t i = 0; i < rows; ++i) acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[i]), s, acc[i]);
    }
    for (int64_t i = 0; i < rows; ++i)  // rounded once to X (to nearest even, as Tensor.to)
      yp[r0 + i] = static_cast<X>(_mm512_reduce_add_ps(acc[i]) * static_cast<float>(sp[r0 + i]));
  });
}

// W weight rows (row[0..W), `rows` of them real) times A activation rows from `first`; y[(first + j) * n + r0 + i].
template <int W, int A, typename X, typename S>
inline void dots(const Quantized& a, int64_t first, const int8_t* const row[W], int64_t rows, const int8_t* next,
                 int64_t k, int64_t group, const S* scales, int64_t r0, int64_t n, X* y) {
  const int64_t groups = k / group;
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512 acc[W][A];
  for (int i = 0; i < W; ++i)
    for (int j = 0; j < A; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512i dot[W][A];
    for (int i = 0; i < W; ++i)
      for (int j = 0; j < A; ++j) dot[i][j] = _mm512_setzero_si512();
    for (int64_t c = g * group; c < (g + 1) * group; c += 64) {
      if (next != nullptr)  // a prefetch past the end never faults
        for (int i = 0; i < W; ++i) _mm_prefetch(reinterpret_cast<const char*>(next + i * k + c), _MM_HINT_T1);
      __m512i xv[A];
#pragma GCC unroll 8
      for (int j = 0; j < A; ++j) xv[j] = _mm512_load_si512(a.xq.data() + (first + j) * k + c);
#pragma GCC unroll 8
      for (int i = 0; i < W; ++i) {
        const __m512i wu = _mm512_xor_si512(_mm512_loadu_si512(row[i] + c), flip);  // w + 128, unsigned
#pragma GCC unroll 8
        for (int j = 0; j < A; ++j) dot[i][j] = _mm512_dpbusd_epi32(dot[i][j], wu, xv[j]);
      }
    }
    for (int j = 0; j < A; ++j) {
      const __m512i off = a.off[(first + j) * groups + g];
      const __m512 s = _mm512_set1_ps(a.scale[(first + j) * groups + g]);
      for (int i = 0; i < W; ++i)
        acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(dot[i][j], off)), s, acc[i][j]);
    }
  }
  for (int j = 0; j < A; ++j)  // rounded once to X (to nearest even, as Tensor.to)
    for (int64_t i = 0; i < rows; ++i)
      y[(first + j) * n + r0 + i] =
          static_cast<X>(_mm512_reduce_add_ps(acc[i][j]) * static_cast<float>(scales[r0 + i]));
}

// W weight rows a pass; activation rows A at a time (the rest one at a time).
template <int W, int A, typename X, typename S>
void run(const Quantized& a, int64_t m, const int8_t* wp, const S* sp, int64_t n, int64_t k, int64_t group, X* yp) {
  tandem_balanced::balanced_passes((n + W - 1) / W, 64 / W, [&](int64_t pass, bool forward) {
    const int64_t r0 = pass * W, rows = std::min<int64_t>(W, n - r0);
    const int8_t* row[W];
    for (int i = 0; i < W; ++i) row[i] = wp + (r0 + std::min<int64_t>(i, rows - 1)) * k;  // past the end: unused
    const int8_t* next = wp + (forward ? std::min(r0 + W, n - 1) : std::max<int64_t>(r0 - W, 0)) * k;
    int64_t j = 0;
    for (; j + A <= m; j += A) dots<W, A>(a, j, row, rows, j == 0 ? next : nullptr, k, group, sp, r0, n, yp);
    for (; j < m; ++j) dots<W, 1>(a, j, row, rows, j == 0 ? next : nullptr, k, group, sp, r0, n, yp);
  });
}

// X: the activation's and the result's element type, S: the scales' (fp32 or a 16-bit float, read as fp32: exact).
template <typename X, typename S>
torch::Tensor int8_gemv_typed(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& scales,
                              int64_t group) {
  const int64_t m = x.size(0), n = w.size(0), k = w.size(1);
  TORCH_CHECK(x.size(1) == k && scales.size(0) == n, "int8_gemv: shapes do not match");
  TORCH_CHECK(group > 0 && group % 64 == 0 && group <= 256 && k % group == 0,
              "int8_gemv: group must be 64, 128 or 256 and divide K");
  auto y = torch::empty({m, n}, x.options());
  if (m == 0 || n == 0) return y;
  const int8_t* wp = w.data_ptr<int8_t>();
  const S* sp = scales.data_ptr<S>();
  X* yp = y.data_ptr<X>();
  if (m == 1) {
    one_row(x.data_ptr<X>(), wp, sp, n, k, group, yp);
  } else {
    run<4, 2>(quantize_rows(x.data_ptr<X>(), m, k, group), m, wp, sp, n, k, group, yp);
  }
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

// The operator: x [K] or [M, K] and scales [N] in fp32 or a 16-bit float, read in place (no conversion copies: three
// fewer small tensors a call); the result [N] or [M, N] in x's dtype, computed in fp32 and rounded once.
torch::Tensor int8_gemv(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& scales, int64_t group) {
  TORCH_CHECK(x.is_cpu() && w.is_cpu() && scales.is_cpu(), "int8_gemv: CPU tensors only");
  TORCH_CHECK(x.dim() == 1 || x.dim() == 2, "int8_gemv: x must be [K] or [M, K]");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kChar && w.is_contiguous(), "int8_gemv: w must be int8 [N, K]");
  TORCH_CHECK(scales.dim() == 1, "int8_gemv: scales must be [N]");
  const auto xc = (x.dim() == 1 ? x.unsqueeze(0) : x).contiguous();  // [M, K]
  const auto sc = scales.contiguous();
  torch::Tensor y;
  switch (x.scalar_type()) {
    case at::kFloat: y = with_scales<float>(xc, w, sc, group); break;
    case at::kBFloat16: y = with_scales<at::BFloat16>(xc, w, sc, group); break;
    case at::kHalf: y = with_scales<at::Half>(xc, w, sc, group); break;
    default: TORCH_CHECK(false, "int8_gemv: x must be fp32, bf16 or fp16, got ", x.scalar_type());
  }
  return x.dim() == 1 ? y[0] : y;  // [N] or [M, N]
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
  m.def("int8_gemv", &int8_gemv, "activation rows times an int8 weight (VNNI)",
        pybind11::call_guard<pybind11::gil_scoped_release>());
}
