// A few activation rows times an int4 weight, with AVX-512 VNNI: y[m, n] = sum_g sum_{k in g} w[n, k] * xq[m, k],
// w[n, k] = (q[n, k] - 8) * s[n, g] + z[n, g] (shared_model/quantize.py's int4 format), q in [0, 15].
//
// Each activation row is rounded to int8 in the weight's groups (a = max|x_g| / 127, xq = nearbyint(x / a), as
// shared_model/int4_gemv.py's reference does). Per group, with S = sum xq (an integer):
//   sum_k w * xq * a = a * (s * (sum_k q * xq - 8 * S) + z * S)
// The codes are the unsigned operand of vpdpbusd and xq the signed one; each group's dot products start from -8 * S
// (in lane 0), so the integer part is exact, then are scaled in fp32 by s * a, taken 16 groups at a time from one
// vector (lane g); the z * a * S terms go into lanes of the same accumulator. Codes are stored two per byte in
// blocks of 64 inputs: byte i of a block holds input i in its low nibble and input 32 + i in its high nibble. Each
// weight row is read once for all the activation rows (at most kMaxRows), several weight rows per pass for
// independent chains. Weight rows are split over torch's intra-op threads.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kMaxRows = 4;  // activation rows per call: a decode batch (more rows take the dense path)

struct Activations {
  int8_t* xq;          // [M, K], 64-byte aligned rows
  float* scale;        // [M, Gp]: a (0 past the last group)
  float* scaled_sum;   // [M, Gp]: a * S, S = sum of the group's xq
  const __m512i* start;  // [M, G]: each group's dot products start from -8 * S (lane 0)
  int64_t padded;      // Gp: the groups rounded up to 16
};

// 16 inputs as fp32
inline __m512 load_x(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load_x(const at::BFloat16* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
inline __m512 load_x(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// Per-thread buffers, reused from call to call (a call allocates nothing once they are large enough).
struct Buffers {
  std::vector<int8_t> xq;
  std::vector<float> scale, scaled_sum;
  std::vector<__m512i> start;
};

template <typename X>
Activations quantize_rows(const X* x, int64_t m, int64_t k, int64_t group) {
  static thread_local Buffers buf;
  const int64_t groups = k / group, padded = (groups + 15) / 16 * 16;
  buf.xq.resize(m * k + 64);
  buf.scale.assign(m * padded, 0.f);
  buf.scaled_sum.assign(m * padded, 0.f);
  buf.start.resize(m * groups);
  Activations a{reinterpret_cast<int8_t*>((reinterpret_cast<uintptr_t>(buf.xq.data()) + 63) & ~uintptr_t(63)),
                buf.scale.data(), buf.scaled_sum.data(), buf.start.data(), padded};
  const __m512 zero = _mm512_setzero_ps();
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      const X* xg = x + r * k + g * group;
      __m512 amax = zero;
      __mmask16 bad = 0;
      for (int64_t i = 0; i < group; i += 16) {
        const __m512 v = load_x(xg + i);
        const __m512 nan_if_bad = _mm512_mul_ps(v, zero);  // NaN where v is NaN or +-Inf
        bad |= _mm512_cmp_ps_mask(nan_if_bad, nan_if_bad, _CMP_UNORD_Q);
        amax = _mm512_max_ps(amax, _mm512_abs_ps(v));
      }
      // NaN or Inf in a group: a NaN scale, so every output of the row is NaN (the sampler then refuses it); a
      // group too small for its reciprocal counts as zero, as in the reference
      const float s = _mm512_reduce_max_ps(amax) / 127.f;
      const bool finite = bad == 0, tiny = !(s >= std::numeric_limits<float>::min());
      const float scale = finite ? (tiny ? 0.f : s) : std::numeric_limits<float>::quiet_NaN();
      const __m512 inv = _mm512_set1_ps(finite && !tiny ? 1.f / s : 0.f);
      __m512i total = _mm512_setzero_si512();
      int8_t* q = a.xq + r * k + g * group;
      for (int64_t i = 0; i < group; i += 16) {
        // round half to even as the reference's torch.round; within [-127, 127] (0 for a non-finite group)
        __m512 v = _mm512_roundscale_ps(_mm512_mul_ps(load_x(xg + i), inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        if (!finite) v = zero;
        const __m512i iv = _mm512_cvtps_epi32(v);
        total = _mm512_add_epi32(total, iv);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i), _mm512_cvtsepi32_epi8(iv));
      }
      const int32_t sum = _mm512_reduce_add_epi32(total);
      a.scale[r * padded + g] = scale;
      a.scaled_sum[r * padded + g] = scale * static_cast<float>(sum);
      buf.start[r * groups + g] = _mm512_maskz_set1_epi32(1, -8 * sum);  // lane 0; the others zero
    }
  }
  return a;
}

// 32 bytes of codes -> the block's 64 codes in input order, one per byte
inline __m512i unpack(const uint8_t* p) {
  const __m512i both = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  const __m512i shifted = _mm512_mask_srli_epi16(both, 0xFFFF0000u, both, 4);  // upper half: the high nibbles
  return _mm512_and_si512(shifted, _mm512_set1_epi8(0x0F));
}

// 16 (or `count`) values of a row's scales or zeros as fp32
inline __m512 load16(const float* p, __mmask16 mask) { return _mm512_maskz_loadu_ps(mask, p); }
inline __m512 load16(const at::BFloat16* p, __mmask16 mask) {
  const __m256i bits = _mm256_maskz_loadu_epi16(mask, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
inline __m512 load16(const at::Half* p, __mmask16 mask) { return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, p)); }

// M activation rows times R weight rows per pass (R * M accumulators in registers).
template <int M, int R, typename S>
void rows_kernel(const Activations& a, const uint8_t* codes, const S* sz, float* y, int64_t n, int64_t k,
                 int64_t group) {
  const int64_t groups = k / group, blocks = group / 64;
  at::parallel_for(0, (n + R - 1) / R, 16 / R, [&](int64_t begin, int64_t end) {
    for (int64_t pass = begin; pass < end; ++pass) {
      const int64_t r0 = pass * R, rows = std::min<int64_t>(R, n - r0);
      __m512 acc[R][M];
      for (int i = 0; i < R; ++i)
        for (int r = 0; r < M; ++r) acc[i][r] = _mm512_setzero_ps();
      for (int64_t g0 = 0; g0 < groups; g0 += 16) {
        const int64_t count = std::min<int64_t>(16, groups - g0);
        const __mmask16 mask = static_cast<__mmask16>((1u << count) - 1);
        // per weight row: s * a for these 16 groups (one lane each), and z * a * S summed into the accumulator
        __m512 sa[R][M];
        for (int i = 0; i < R; ++i) {
          const int64_t row = r0 + std::min<int64_t>(i, rows - 1);  // past the end: a copy of the last row, unused
          const S* scales = sz + row * 2 * groups + g0;                // [N, 2, G]: scales, then zeros
          const __m512 s = load16(scales, mask), z = load16(scales + groups, mask);
          for (int r = 0; r < M; ++r) {
            sa[i][r] = _mm512_mul_ps(s, _mm512_loadu_ps(&a.scale[r * a.padded + g0]));
            acc[i][r] = _mm512_fmadd_ps(z, _mm512_loadu_ps(&a.scaled_sum[r * a.padded + g0]), acc[i][r]);
          }
        }
        for (int64_t j = 0; j < count; ++j) {
          const int64_t g = g0 + j;
          const __m512i lane = _mm512_set1_epi32(static_cast<int>(j));
          __m512i dot[R][M];
          for (int i = 0; i < R; ++i)
            for (int r = 0; r < M; ++r) dot[i][r] = a.start[r * groups + g];
          for (int64_t b = 0; b < blocks; ++b) {
            const int64_t off = g * group + b * 64;
            for (int i = 0; i < R; ++i) {
              const int64_t row = r0 + std::min<int64_t>(i, rows - 1);
              const __m512i w = unpack(codes + row * (k / 2) + off / 2);
              for (int r = 0; r < M; ++r) {
                dot[i][r] = _mm512_dpbusd_epi32(dot[i][r], w, _mm512_load_si512(a.xq + r * k + off));
              }
            }
          }
          for (int i = 0; i < R; ++i)
            for (int r = 0; r < M; ++r) {
              const __m512 scale = _mm512_permutexvar_ps(lane, sa[i][r]);
              acc[i][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[i][r]), scale, acc[i][r]);
            }
        }
      }
      for (int i = 0; i < rows; ++i)
        for (int r = 0; r < M; ++r) y[r * n + r0 + i] = _mm512_reduce_add_ps(acc[i][r]);
    }
  });
}

template <typename S>
void dispatch_rows(const Activations& a, int64_t m, const uint8_t* codes, const S* sz, float* y, int64_t n, int64_t k,
                   int64_t group) {
  switch (m) {  // R * M <= 8: accumulators and dot products stay in registers
    case 1: return rows_kernel<1, 4>(a, codes, sz, y, n, k, group);
    case 2: return rows_kernel<2, 2>(a, codes, sz, y, n, k, group);
    case 3: return rows_kernel<3, 2>(a, codes, sz, y, n, k, group);
    default: return rows_kernel<4, 1>(a, codes, sz, y, n, k, group);
  }
}

// The operator: x [M, K] (M <= kMaxRows) in fp32 or a 16-bit float, codes uint8 [N, K / 2], scales_and_zeros
// [N, 2, K / group] (each row's scales, then its zeros) in fp32, bf16 or fp16, read as stored; the result [M, N]
// in x's dtype.
torch::Tensor int4_gemv(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scales_and_zeros,
                        int64_t group) {
  TORCH_CHECK(x.is_cpu() && codes.is_cpu() && scales_and_zeros.is_cpu(), "int4_gemv: CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && x.size(0) >= 1 && x.size(0) <= kMaxRows, "int4_gemv: x must be [M, K] with M in 1..",
              kMaxRows);
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kByte && codes.is_contiguous(),
              "int4_gemv: codes must be uint8 [N, K / 2]");
  const int64_t m = x.size(0), k = x.size(1), n = codes.size(0);
  TORCH_CHECK(group > 0 && group % 64 == 0 && k % group == 0, "int4_gemv: group must be a multiple of 64 dividing K");
  TORCH_CHECK(codes.size(1) * 2 == k, "int4_gemv: shapes do not match (codes hold two inputs a byte)");
  TORCH_CHECK(scales_and_zeros.dim() == 3 && scales_and_zeros.size(0) == n && scales_and_zeros.size(1) == 2 &&
                  scales_and_zeros.size(2) == k / group && scales_and_zeros.is_contiguous(),
              "int4_gemv: scales_and_zeros must be [N, 2, K / group], contiguous");
  const auto xc = x.contiguous();
  Activations a;
  switch (xc.scalar_type()) {
    case at::kFloat: a = quantize_rows(xc.data_ptr<float>(), m, k, group); break;
    case at::kBFloat16: a = quantize_rows(xc.data_ptr<at::BFloat16>(), m, k, group); break;
    case at::kHalf: a = quantize_rows(xc.data_ptr<at::Half>(), m, k, group); break;
    default: TORCH_CHECK(false, "int4_gemv: x must be fp32, bf16 or fp16");
  }
  static thread_local std::vector<float> out;
  out.resize(m * n);
  const auto* cp = codes.data_ptr<uint8_t>();
  float* yp = out.data();
  switch (scales_and_zeros.scalar_type()) {
    case at::kFloat: dispatch_rows(a, m, cp, scales_and_zeros.data_ptr<float>(), yp, n, k, group); break;
    case at::kBFloat16: dispatch_rows(a, m, cp, scales_and_zeros.data_ptr<at::BFloat16>(), yp, n, k, group); break;
    case at::kHalf: dispatch_rows(a, m, cp, scales_and_zeros.data_ptr<at::Half>(), yp, n, k, group); break;
    default: TORCH_CHECK(false, "int4_gemv: scales_and_zeros must be fp32, bf16 or fp16");
  }
  auto y = torch::empty({m, n}, x.options());  // rounded once from the fp32 sums, in x's dtype
  switch (y.scalar_type()) {
    case at::kFloat: std::copy(out.begin(), out.end(), y.data_ptr<float>()); break;
    case at::kBFloat16: std::copy(out.begin(), out.end(), y.data_ptr<at::BFloat16>()); break;
    default: std::copy(out.begin(), out.end(), y.data_ptr<at::Half>()); break;
  }
  return y;
}

}  // namespace

// The schema beside int8_gemv's (TORCH_LIBRARY in int8_gemv.cpp); its fake kernel is registered from Python
// (shared_model/cpu_kernels.py).
TORCH_LIBRARY_FRAGMENT(tandem_cpu, m) {
  m.def("int4_gemv(Tensor x, Tensor codes, Tensor scales_and_zeros, int group) -> Tensor");
}
TORCH_LIBRARY_IMPL(tandem_cpu, CPU, m) { m.impl("int4_gemv", &int4_gemv); }
