// Many bf16 activation rows times a bf16 weight on CPUs with AVX512_BF16 and no AMX tiles: y[m, n] = sum_k x[m, k]
// * w[n, k], summed in fp32 and rounded once to bf16. The compiled step's rows past row_gemm's (a decode step of
// many streams) where tile_gemm cannot run (shared_model/serving_model.py's row table).
//
// Blocks of 4 weight rows x 4 activation rows: vdpbf16ps multiplies 32 bf16 pairs of a weight row and an activation
// row at once into 16 fp32 lanes, so each of the 16 (weight row, activation row) pairs keeps one accumulator, and a
// block loads 4 + 4 vectors for 16 of them (the weight rows stay in L1 for the next block of activation rows; the
// next weight rows are prefetched into L2 meanwhile). The 16 accumulators are summed across their lanes together
// (a tree of unpacks and adds), the same tree for every one of them, and the 16 sums put in output order and
// rounded to bf16 by one instruction each (vcvtneps2bf16). A pass of 4 weight rows runs every activation block in
// one call, the block inlined into it: per block, only the sums' tree and four 8-byte stores beside the products.
// Passes are split over torch's intra-op threads, a thread done with its share taking passes from the back of a
// slower one's (balanced.h).
//
// Bits: each output's sum runs over k in the same order, from its own weight row and activation row alone, at any
// row count (a block short of rows repeats its last real row, whose outputs are dropped), so a row's bits do not
// depend on the others in the step. vdpbf16ps treats denormal inputs and results as zero (its definition), unlike
// row_gemm's fused multiply-adds, and vcvtneps2bf16 rounds to nearest even as Tensor.to does but flushes a denormal
// sum to zero: the bits differ from row_gemm's and F.linear's in the last places.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cpuid.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>

#include "balanced.h"
#include "kernels.h"

namespace {

constexpr int64_t kW = 4;  // weight rows a block
constexpr int64_t kA = 4;  // activation rows a block

// 16 vectors -> one vector of their 16 sums across lanes, each summed in the same order: (l0 + l2) + (l1 + l3) within
// each 128-bit quarter, then (q0 + q1) + (q2 + q3). Vector i's sum lands in lane kLane[i].
__attribute__((target("avx512f"))) inline __m512 sum16(const __m512 v[16]) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d lo = _mm512_unpacklo_pd(_mm512_castps_pd(a[2 * i]), _mm512_castps_pd(a[2 * i + 1]));
    const __m512d hi = _mm512_unpackhi_pd(_mm512_castps_pd(a[2 * i]), _mm512_castps_pd(a[2 * i + 1]));
    b[i] = _mm512_add_ps(_mm512_castpd_ps(lo), _mm512_castpd_ps(hi));
  }
  for (int i = 0; i < 2; ++i)
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xdd));
  return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xdd));
}

// Where sum16 puts vector i's sum (found once by summing vectors that hold their own index).
const std::array<int, 16>& lanes() {
  static const std::array<int, 16> lane = [] {
    __m512 v[16];
    for (int i = 0; i < 16; ++i) v[i] = _mm512_set1_ps(static_cast<float>(i));
    alignas(64) float out[16];
    _mm512_store_ps(out, sum16(v));
    std::array<int, 16> at{};
    for (int l = 0; l < 16; ++l) at[static_cast<int>(out[l]) / 16] = l;
    return at;
  }();
  return lane;
}

// The permutation that puts a block's sums in output order: activation row j's kW outputs at lanes kW*j .. kW*j+3.
std::array<int32_t, 16> output_order() {
  std::array<int32_t, 16> order{};
  for (int j = 0; j < kA; ++j)
    for (int i = 0; i < kW; ++i) order[j * kW + i] = lanes()[i * kA + j];
  return order;
}

// One block: weight rows w[0..kW) (`rows` real) times activation rows x[0..kA) (`acts` real) over k columns; the
// sums rounded to bf16 together (vcvtneps2bf16: to nearest even, as Tensor.to, a denormal sum flushed to zero).
__attribute__((target("avx512f,avx512bf16,avx512vl"), always_inline)) inline void block(
    const uint16_t* const w[kW], const uint16_t* const x[kA], int64_t k, const uint16_t* next, uint16_t* y,
    int64_t ldy, int64_t rows, int64_t acts, __m512i order) {
  __m512 acc[kW * kA];
  for (int i = 0; i < kW * kA; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t c = 0; c < k; c += 32) {
    if (next != nullptr)  // a prefetch past the end never faults
      for (int i = 0; i < kW; ++i) _mm_prefetch(reinterpret_cast<const char*>(next + i * k + c), _MM_HINT_T1);
    __m512bh xv[kA];
#pragma GCC unroll 4
    for (int j = 0; j < kA; ++j) xv[j] = (__m512bh)_mm512_loadu_si512(x[j] + c);
#pragma GCC unroll 4
    for (int i = 0; i < kW; ++i) {
      const __m512bh wv = (__m512bh)_mm512_loadu_si512(w[i] + c);
#pragma GCC unroll 4
      for (int j = 0; j < kA; ++j) acc[i * kA + j] = _mm512_dpbf16_ps(acc[i * kA + j], wv, xv[j]);
    }
  }
  // [16] bf16, activation row j's outputs at kW * j
  const __m256i out = (__m256i)_mm512_cvtneps_pbh(_mm512_permutexvar_ps(order, sum16(acc)));
  alignas(32) uint16_t bits[16];
  _mm256_store_si256(reinterpret_cast<__m256i*>(bits), out);
  if (rows == kW) {
    for (int64_t j = 0; j < acts; ++j) std::memcpy(y + j * ldy, bits + kW * j, sizeof(uint16_t) * kW);
  } else {
    for (int64_t j = 0; j < acts; ++j)
      for (int64_t i = 0; i < rows; ++i) y[j * ldy + i] = bits[kW * j + i];
  }
}

// One pass: weight rows [r0, r0 + kW) (`rows` real) against every activation row, the weight rows this thread reads
// next (the following pass's, or the previous one's where it takes passes from the back: `forward` false) prefetched
// into L2 during the first block.
__attribute__((target("avx512f,avx512bf16,avx512vl"))) void pass(const uint16_t* x, const uint16_t* w, uint16_t* y,
                                                                 int64_t m, int64_t n, int64_t k, int64_t r0,
                                                                 bool forward,
                                                                 const std::array<int32_t, 16>& order_lanes) {
  const __m512i order = _mm512_loadu_si512(order_lanes.data());
  const int64_t rows = std::min(kW, n - r0);
  const uint16_t* wr[kW];
  for (int64_t i = 0; i < kW; ++i) wr[i] = w + (r0 + std::min(i, rows - 1)) * k;  // past the end: repeated
  const uint16_t* next = w + (forward ? std::min(r0 + kW, n - 1) : std::max<int64_t>(r0 - kW, 0)) * k;
  for (int64_t a0 = 0; a0 < m; a0 += kA) {
    const int64_t acts = std::min(kA, m - a0);
    const uint16_t* xr[kA];
    for (int64_t j = 0; j < kA; ++j) xr[j] = x + (a0 + std::min(j, acts - 1)) * k;
    block(wr, xr, k, a0 == 0 ? next : nullptr, y + a0 * n + r0, n, rows, acts, order);
  }
}

}  // namespace

namespace tandem_kernels {

bool dot_bf16_ready() {
  static const bool ready = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    return __get_cpuid_count(7, 1, &a, &b, &c, &d) && (a & (1u << 5));  // AVX512_BF16
  }();
  return ready;
}

void dot_gemm_rows(const uint16_t* x, const uint16_t* w, uint16_t* y, int64_t m, int64_t n, int64_t k) {
  TORCH_CHECK(dot_bf16_ready(), "dot_gemm: this CPU has no AVX512_BF16");
  TORCH_CHECK(k % 32 == 0, "dot_gemm: K must be a multiple of 32");
  static const std::array<int32_t, 16> order = output_order();
  tandem_balanced::balanced_passes((n + kW - 1) / kW, 4, [&](int64_t p, bool forward) {
    pass(x, w, y, m, n, k, p * kW, forward, order);
  });
}

}  // namespace tandem_kernels

namespace {

// x [M, K], w [N, K] contiguous bf16 (K a multiple of 32) -> [M, N] bf16
torch::Tensor dot_gemm(const torch::Tensor& x, const torch::Tensor& w) {
  TORCH_CHECK(x.is_cpu() && w.is_cpu(), "dot_gemm: CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && w.is_contiguous(), "dot_gemm: x must be [M, K], w contiguous [N, K]");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16, "dot_gemm: x and w must be bf16");
  TORCH_CHECK(x.size(1) == w.size(1), "dot_gemm: shapes do not match");
  const int64_t m = x.size(0), n = w.size(0), k = w.size(1);
  const auto xc = x.contiguous();
  auto y = torch::empty({m, n}, x.options());
  if (m == 0 || n == 0) return y;
  auto bits = [](const torch::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>()); };
  tandem_kernels::dot_gemm_rows(bits(xc), bits(w), bits(y), m, n, k);
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tandem, m) { m.def("dot_gemm(Tensor x, Tensor w) -> Tensor"); }
TORCH_LIBRARY_IMPL(tandem, CPU, m) { m.impl("dot_gemm", &dot_gemm); }

void register_dot_gemm(pybind11::module_& m) {
  m.def("dot_gemm_ready", &tandem_kernels::dot_bf16_ready,
        "Whether dot_gemm runs here (the CPU has AVX512_BF16: vdpbf16ps)");
}
