// A few activation rows times an int4 weight, with AVX-512 VNNI: y[m, n] = sum_g sum_{k in g} w[n, k] * xq[m, k],
// w[n, k] = (q[n, k] - 8) * s[n, g] + z[n, g] (shared_model/quantize.py's int4 format), q in [0, 15].
//
// Each activation row is rounded to int8 in the weight's groups (a = max|x_g| / 127, xq = nearbyint(x / a), as
// shared_model/int4_gemv.py's reference does). Per group, with S = sum xq (an integer):
//   sum_k w * xq * a = a * (s * (sum_k q * xq - 8 * S) + z * S)
//
// Layout: one 32-bit lane of a vector per (row, group). Rows are taken in blocks of P = 16 / gcd(G, 16), G groups a
// row, so that a block holds P * G groups, a whole number of tiles of 16: flat index f = p * G + g (row p of the
// block, its group g) is lane f % 16 of tile f / 16. A tile is group / 8 steps of 64 bytes; in step j, lane l holds
// its group's inputs 4j..4j+3 in its low nibbles and group / 2 + 4j..+3 in its high nibbles (shared_model/
// int4_gemv.py's `pack`). So each aligned 64-byte load gives 128 codes, two ANDs split them (low nibbles as they
// are, high nibbles times 16, no shift), and two vpdpbusd (codes unsigned, activations signed) add each group's
// products into that group's own lane: at the end of a tile every lane holds its group's exact integer dot
// product, and one conversion and two FMAs apply the 16 groups' scales and zeros, read as stored in
// [2, N, G] (scales, then zeros: a tile's 16 are contiguous), with no shuffle. The activation bytes are laid out
// the same way once per call (tile t of a block pairs lane l with group (16t + l) % G).
//
// Each pass reads a few weight blocks (several for independent chains, the next pass's prefetched into L2
// meanwhile) and multiplies them by up to 4 activation rows at once, in registers; more rows (at most kMaxRows) go
// 4 at a time, each time over the whole weight, which stays in the cache between them (interleaving the row chunks
// within a pass measured slower). A row's result is the same at any row count. Passes are split over torch's intra-op
// threads.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "line_aligned.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <vector>

#include "int4_layout.h"
#include "kernels.h"

namespace {

constexpr int64_t kMaxRows = 16;   // activation rows per call: decode batches (more rows take the dense path)
constexpr int64_t kChunkRows = 4;  // rows a kernel pass multiplies at once (2 * R * M accumulators in registers)

using tandem_int4::checked_layout;
using tandem_int4::kLanes;
using tandem_int4::Shape;

// One call's activation rows, laid out as a block's codes are.
struct Activations {
  const int8_t* x;            // [M, tiles, steps, 2, 64]: each step's low-nibble, then high-nibble partners
  const float* scale;         // [M, tiles, 16]: a of each lane's group
  const float* sum;           // [M, tiles, 16]: a * S
  const int32_t* eight_sums;  // [M, tiles, 16]: 8 * S
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
  std::vector<int8_t> x, group_bytes;
  tandem_aligned::LineVector<float> scale, sum, group_scale, group_sum;  // group_*: one row's, per group
  tandem_aligned::LineVector<int32_t> eight_sums, group_eight_sums;
};

template <typename X>
Activations quantize_rows(const X* x, int64_t m, const Shape& sh) {
  static thread_local Buffers buf;
  buf.x.resize(m * sh.tiles * sh.steps * 128 + 64);
  buf.scale.resize(m * sh.tiles * kLanes);
  buf.sum.resize(m * sh.tiles * kLanes);
  buf.eight_sums.resize(m * sh.tiles * kLanes);
  buf.group_bytes.resize(sh.groups * sh.group);
  auto* xs = reinterpret_cast<int8_t*>((reinterpret_cast<uintptr_t>(buf.x.data()) + 63) & ~uintptr_t(63));
  const __m512 zero = _mm512_setzero_ps();
  const int64_t half = sh.group / 2;
  buf.group_scale.resize(sh.groups);
  buf.group_sum.resize(sh.groups);
  buf.group_eight_sums.resize(sh.groups);
  float* scale = buf.group_scale.data();
  float* scaled_sum = buf.group_sum.data();
  int32_t* eight = buf.group_eight_sums.data();
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t g = 0; g < sh.groups; ++g) {
      const X* xg = x + r * sh.k + g * sh.group;
      __m512 amax = zero;
      __mmask16 bad = 0;
      for (int64_t i = 0; i < sh.group; i += 16) {
        const __m512 v = load_x(xg + i);
        const __m512 nan_if_bad = _mm512_mul_ps(v, zero);  // NaN where v is NaN or +-Inf
        bad |= _mm512_cmp_ps_mask(nan_if_bad, nan_if_bad, _CMP_UNORD_Q);
        amax = _mm512_max_ps(amax, _mm512_abs_ps(v));
      }
      // NaN or Inf in a group: a NaN scale, so every output of the row is NaN (the sampler then refuses it); a
      // group too small for its reciprocal counts as zero, as in the reference
      const float s = _mm512_reduce_max_ps(amax) / 127.f;
      const bool finite = bad == 0, tiny = !(s >= std::numeric_limits<float>::min());
      const float a = finite ? (tiny ? 0.f : s) : std::numeric_limits<float>::quiet_NaN();
      const __m512 inv = _mm512_set1_ps(finite && !tiny ? 1.f / s : 0.f);
      __m512i total = _mm512_setzero_si512();
      int8_t* q = buf.group_bytes.data() + g * sh.group;
      for (int64_t i = 0; i < sh.group; i += 16) {
        // round half to even as the reference's torch.round; within [-127, 127] (0 for a non-finite group)
        __m512 v = _mm512_roundscale_ps(_mm512_mul_ps(load_x(xg + i), inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        if (!finite) v = zero;
        const __m512i iv = _mm512_cvtps_epi32(v);
        total = _mm512_add_epi32(total, iv);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i), _mm512_cvtsepi32_epi8(iv));
      }
      const int32_t sum = _mm512_reduce_add_epi32(total);
      scale[g] = a;
      scaled_sum[g] = a * static_cast<float>(sum);
      eight[g] = 8 * sum;
    }
    // lane l of tile t pairs with group (16t + l) % G, in every block
    for (int64_t f = 0; f < sh.tiles * kLanes; ++f) {
      const int64_t g = f % sh.groups, t = f / kLanes, lane = f % kLanes, at = (r * sh.tiles + t) * kLanes + lane;
      buf.scale[at] = scale[g];
      buf.sum[at] = scaled_sum[g];
      buf.eight_sums[at] = eight[g];
      const int8_t* q = buf.group_bytes.data() + g * sh.group;
      int8_t* slot = xs + (r * sh.tiles + t) * sh.steps * 128 + lane * 4;
      for (int64_t j = 0; j < sh.steps; ++j, slot += 128) {  // step j: inputs 4j.. (low), half + 4j.. (high)
        std::memcpy(slot, q + 4 * j, 4);
        std::memcpy(slot + 64, q + half + 4 * j, 4);
      }
    }
  }
  return Activations{xs, buf.scale.data(), buf.sum.data(), buf.eight_sums.data()};
}

// 16 consecutive scales or zeros as fp32
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
inline __m512 load16(const at::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }

// Activation rows r0.. of `a` (row r0 as its first).
Activations rows_from(const Activations& a, int64_t r0, const Shape& sh) {
  const int64_t lanes = sh.tiles * kLanes;
  return Activations{a.x + r0 * sh.tiles * sh.steps * 128, a.scale + r0 * lanes, a.sum + r0 * lanes,
                     a.eight_sums + r0 * lanes};
}

// Lane tile t of R blocks (w[i] + off: the tile's first step) times M activation rows: each (row, group) lane's
// a * (s * (dot - 8 * S) + z * S) into out[i * M + r] + t * 16, the blocks' groups starting at first[i]. The
// accumulators live in this function alone, so the compiler keeps them in registers (declared across the whole
// pass, GCC 12 kept half of them on the stack, a store and a reload around every vpdpbusd).
template <int M, int R, typename S>
__attribute__((always_inline)) inline void tile_dots(const Activations& a, const uint8_t* const* w,
                                                     const uint8_t* next, int64_t block_bytes, int64_t off,
                                                     int64_t t, const S* sz, const S* zeros, const int64_t* first,
                                                     float* const* out, const Shape& sh, int64_t act_stride) {
  const __m512i low = _mm512_set1_epi8(0x0F), high = _mm512_set1_epi8(static_cast<char>(0xF0));
  __m512i lo[R * M], hi[R * M];
#pragma GCC unroll 16
  for (int q = 0; q < R * M; ++q) lo[q] = hi[q] = _mm512_setzero_si512();
  const int8_t* xt = a.x + t * sh.steps * 128;
  for (int64_t j = 0; j < sh.steps; ++j, off += 64, xt += 128) {
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i)
      _mm_prefetch(reinterpret_cast<const char*>(next + i * block_bytes + off), _MM_HINT_T1);
    __m512i xl[M], xh[M];
#pragma GCC unroll 8
    for (int r = 0; r < M; ++r)
      xl[r] = _mm512_load_si512(xt + r * act_stride), xh[r] = _mm512_load_si512(xt + r * act_stride + 64);
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
      const __m512i v = _mm512_load_si512(w[i] + off);
      const __m512i vl = _mm512_and_si512(v, low), vh = _mm512_and_si512(v, high);  // vh: 16 x the codes
#pragma GCC unroll 8
      for (int r = 0; r < M; ++r) {
        lo[i * M + r] = _mm512_dpbusd_epi32(lo[i * M + r], vl, xl[r]);
        hi[i * M + r] = _mm512_dpbusd_epi32(hi[i * M + r], vh, xh[r]);
      }
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i) {
    const __m512 s = load16(sz + first[i] + t * kLanes), z = load16(zeros + first[i] + t * kLanes);
#pragma GCC unroll 8
    for (int r = 0; r < M; ++r) {
      const int64_t at = (r * sh.tiles + t) * kLanes;
      const __m512i dot = _mm512_sub_epi32(_mm512_add_epi32(lo[i * M + r], _mm512_srai_epi32(hi[i * M + r], 4)),
                                           _mm512_loadu_si512(a.eight_sums + at));
      const __m512 sa = _mm512_mul_ps(s, _mm512_loadu_ps(a.scale + at));
      const __m512 v = _mm512_fmadd_ps(z, _mm512_loadu_ps(a.sum + at), _mm512_mul_ps(_mm512_cvtepi32_ps(dot), sa));
      _mm512_storeu_ps(out[i * M + r] + t * kLanes, v);
    }
  }
}

// M activation rows times R blocks per pass (2 * R * M integer accumulators in registers).
template <int M, int R, typename S>
void blocks_kernel(const Activations& a, const uint8_t* codes, const S* sz, float* y, int64_t n, const Shape& sh) {
  const int64_t block_bytes = sh.block_rows * sh.k / 2, block_groups = sh.block_rows * sh.groups;
  const int64_t blocks = n / sh.block_rows, act_stride = sh.tiles * sh.steps * 128;
  const S* zeros = sz + n * sh.groups;  // [2, N, G]: the scales, then the zeros
  const int64_t grain = std::max<int64_t>(1, 32 / (R * sh.block_rows));
  at::parallel_for(0, (blocks + R - 1) / R, grain, [&](int64_t begin, int64_t end) {
    // each block's per-(row, group) results: [R, M, tiles * 16]
    static thread_local tandem_aligned::LineVector<float> buffer;
    buffer.resize(R * M * sh.tiles * kLanes);
    float* out[R * M];
    for (int q = 0; q < R * M; ++q) out[q] = buffer.data() + q * sh.tiles * kLanes;
    for (int64_t pass = begin; pass < end; ++pass) {
      const int64_t b0 = pass * R, count = std::min<int64_t>(R, blocks - b0);
      const uint8_t* w[R];
      int64_t first[R];
      for (int i = 0; i < R; ++i) {  // past the end: a copy of the last block, unused
        const int64_t b = b0 + std::min<int64_t>(i, count - 1);
        w[i] = codes + b * block_bytes;
        first[i] = b * block_groups;
      }
      // the next pass's blocks, prefetched meanwhile (a prefetch past the end never faults)
      const uint8_t* next = codes + std::min<int64_t>(b0 + R, blocks - 1) * block_bytes;
      for (int64_t t = 0; t < sh.tiles; ++t)
        tile_dots<M, R>(a, w, next, block_bytes, t * sh.steps * 64, t, sz, zeros, first, out, sh, act_stride);
      // each row of each block: the sum of its G lanes
      for (int i = 0; i < count; ++i)
        for (int r = 0; r < M; ++r)
          for (int64_t p = 0; p < sh.block_rows; ++p) {
            const float* v = out[i * M + r] + p * sh.groups;
            __m512 total = _mm512_setzero_ps();
            for (int64_t g = 0; g < sh.groups; g += kLanes) {
              const int64_t left = std::min<int64_t>(kLanes, sh.groups - g);
              total = _mm512_add_ps(total, _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << left) - 1), v + g));
            }
            y[r * n + (b0 + i) * sh.block_rows + p] = _mm512_reduce_add_ps(total);
          }
    }
  });
}

template <typename S>
void dispatch_rows(const Activations& a, int64_t m, const uint8_t* codes, const S* sz, float* y, int64_t n,
                   const Shape& sh) {
  if (m > kChunkRows) {  // 4 rows at a time, each pass over the whole weight (it stays in the cache between them)
    for (int64_t r0 = 0; r0 < m; r0 += kChunkRows)
      dispatch_rows(rows_from(a, r0, sh), std::min<int64_t>(kChunkRows, m - r0), codes, sz, y + r0 * n, n, sh);
    return;
  }
  switch (m) {  // 2 * R * M vectors of accumulators stay in registers
    case 1: return blocks_kernel<1, 4>(a, codes, sz, y, n, sh);
    case 2: return blocks_kernel<2, 2>(a, codes, sz, y, n, sh);
    case 3: return blocks_kernel<3, 2>(a, codes, sz, y, n, sh);
    default: return blocks_kernel<4, 1>(a, codes, sz, y, n, sh);
  }
}

// The operator: x [M, K] (M <= kMaxRows) in fp32 or a 16-bit float, codes uint8 [N, K / 2] in the blocked layout,
// scales_and_zeros [2, N, K / group] (the scales, then the zeros) in fp32, bf16 or fp16, read as stored; the
// result [M, N] in x's dtype.
torch::Tensor int4_gemv(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scales_and_zeros,
                        int64_t group) {
  TORCH_CHECK(x.is_cpu() && x.dim() == 2 && x.size(0) >= 1 && x.size(0) <= kMaxRows,
              "int4_gemv: x must be a CPU tensor [M, K] with M in 1..", kMaxRows);
  const Shape sh = checked_layout("int4_gemv", codes, scales_and_zeros, group);
  TORCH_CHECK(reinterpret_cast<uintptr_t>(codes.data_ptr()) % 64 == 0, "int4_gemv: codes must be 64-byte aligned");
  TORCH_CHECK(x.size(1) == sh.k, "int4_gemv: shapes do not match (x has ", x.size(1), " inputs, the codes ", sh.k, ")");
  const int64_t m = x.size(0), n = codes.size(0);
  const auto xc = x.contiguous();
  Activations a;
  switch (xc.scalar_type()) {
    case at::kFloat: a = quantize_rows(xc.data_ptr<float>(), m, sh); break;
    case at::kBFloat16: a = quantize_rows(xc.data_ptr<at::BFloat16>(), m, sh); break;
    case at::kHalf: a = quantize_rows(xc.data_ptr<at::Half>(), m, sh); break;
    default: TORCH_CHECK(false, "int4_gemv: x must be fp32, bf16 or fp16");
  }
  static thread_local std::vector<float> out;
  out.resize(m * n);
  const auto* cp = codes.data_ptr<uint8_t>();
  float* yp = out.data();
  switch (scales_and_zeros.scalar_type()) {
    case at::kFloat: dispatch_rows(a, m, cp, scales_and_zeros.data_ptr<float>(), yp, n, sh); break;
    case at::kBFloat16: dispatch_rows(a, m, cp, scales_and_zeros.data_ptr<at::BFloat16>(), yp, n, sh); break;
    case at::kHalf: dispatch_rows(a, m, cp, scales_and_zeros.data_ptr<at::Half>(), yp, n, sh); break;
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

// 16 fp32 values stored as S, rounded to nearest even (as Tensor.to): finite values only (weights are)
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(at::Half* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
inline void store16(at::BFloat16* p, __m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(rounded));
}

// The weight the kernel multiplies by, [N, K] in scales_and_zeros' dtype: (q - 8) * s + z in fp32 (a product,
// then a sum: no fused multiply-add, so that it is bitwise int4_gemv.py's `dequantize` rounded to that dtype), for
// calls of more rows than kMaxRows (prefill chunks), which multiply it by the dense GEMM. Blocks are split over
// torch's intra-op threads.
// Block b's rows (block_rows of them) of that weight, into out (row b * block_rows + p at out + p * K).
template <typename S>
void dequantize_block(const uint8_t* codes, const S* sz, S* out, int64_t n, const Shape& sh, int64_t b) {
  const int64_t block_bytes = sh.block_rows * sh.k / 2, half = sh.group / 2;
  const S* zeros = sz + n * sh.groups;
  const uint8_t* block = codes + b * block_bytes;
  for (int64_t f = 0; f < sh.tiles * kLanes; ++f) {  // lane f % 16 of tile f / 16: (row p, group g)
    const int64_t p = f / sh.groups, g = f % sh.groups, row = b * sh.block_rows + p;
    const __m512 s = _mm512_set1_ps(static_cast<float>(sz[row * sh.groups + g]));
    const __m512 z = _mm512_set1_ps(static_cast<float>(zeros[row * sh.groups + g]));
    const __m512 eight = _mm512_set1_ps(8.f);
    const uint8_t* lane = block + (f / kLanes) * sh.steps * 64 + (f % kLanes) * 4;
    S* dst = out + p * sh.k + g * sh.group;
    // Four steps at a time: their 4 bytes of this lane (one gather, 64 bytes apart) hold the group's inputs
    // 4j..4j+15 in their low nibbles and half + 4j..+15 in their high nibbles, in input order.
    const __m128i stride = _mm_setr_epi32(0, 64, 128, 192), nibble = _mm_set1_epi8(15);
    for (int64_t j = 0; j < sh.steps; j += 4) {
      const __m128i bytes = _mm_i32gather_epi32(reinterpret_cast<const int*>(lane + j * 64), stride, 1);
      const __m128i codes[2] = {_mm_and_si128(bytes, nibble), _mm_and_si128(_mm_srli_epi16(bytes, 4), nibble)};
      for (int h = 0; h < 2; ++h) {
        const __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(codes[h]));
        __m512 product = _mm512_mul_ps(_mm512_sub_ps(q, eight), s);
        asm("" : "+v"(product));  // keeps the compiler from fusing the product and the sum into one FMA
        store16(dst + h * half + 4 * j, _mm512_add_ps(product, z));
      }
    }
  }
}

template <typename S>
void dequantize_blocks(const uint8_t* codes, const S* sz, S* out, int64_t n, const Shape& sh) {
  at::parallel_for(0, n / sh.block_rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) dequantize_block(codes, sz, out + b * sh.block_rows * sh.k, n, sh, b);
  });
}

torch::Tensor int4_dequantize(const torch::Tensor& codes, const torch::Tensor& scales_and_zeros, int64_t group) {
  const Shape sh = checked_layout("int4_dequantize", codes, scales_and_zeros, group);
  TORCH_CHECK(group <= 256, "int4_dequantize: group must be at most 256");
  const int64_t n = codes.size(0), k = sh.k;
  auto out = torch::empty({n, k}, scales_and_zeros.options());
  const auto* cp = codes.data_ptr<uint8_t>();
  switch (scales_and_zeros.scalar_type()) {
    case at::kFloat: dequantize_blocks(cp, scales_and_zeros.data_ptr<float>(), out.data_ptr<float>(), n, sh); break;
    case at::kBFloat16:
      dequantize_blocks(cp, scales_and_zeros.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(), n, sh);
      break;
    case at::kHalf: dequantize_blocks(cp, scales_and_zeros.data_ptr<at::Half>(), out.data_ptr<at::Half>(), n, sh); break;
    default: TORCH_CHECK(false, "int4_dequantize: scales_and_zeros must be fp32, bf16 or fp16");
  }
  return out;
}

}  // namespace

at::Tensor tandem_kernels::int4_gemv_op(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales_and_zeros,
                                        int64_t group) {
  return int4_gemv(x, codes, scales_and_zeros, group);
}

// A fragment of the `tandem` op library (every file adds its own); its fake kernel is registered from Python
// (tandem_native/loader.py).
TORCH_LIBRARY_FRAGMENT(tandem, m) {
  m.def("int4_gemv(Tensor x, Tensor codes, Tensor scales_and_zeros, int group) -> Tensor");
  m.def("int4_dequantize(Tensor codes, Tensor scales_and_zeros, int group) -> Tensor");
}
TORCH_LIBRARY_IMPL(tandem, CPU, m) {
  m.impl("int4_gemv", &int4_gemv);
  m.impl("int4_dequantize", &int4_dequantize);
}
