// Paged attention for the CPU's decode step: each query over its sequence's cached K/V, read in place from the
// paged cache (no gather), and the step's K/V stores, in two calls per layer instead of a dozen torch ops.
//
// Layout (inference_svc/attention/paged.py): caches [num_blocks, block_size, Hkv, D] in fp32, bf16 or fp16;
// block tables int32 [S, max_blocks]; token slot = block * block_size + offset. Consecutive queries of one sequence
// (same block table, context lengths growing by one: a speculative verify item's rows) form a run. Each (run, KV
// head) is one work item: the run's queries times the G = Hq / Hkv query heads of the group score the cached
// tokens, 16 at a time (fp32 dot products: each block of 16 keys converted to fp32 once for all the rows, the 16
// sums in registers), each row over its own context; softmax in fp32 (max subtracted, vectorized exp); the values,
// each read and converted once for up to four rows, are summed with those weights in fp32 accumulators held in
// registers (four rows by four 16-wide chunks of the head at a time); the output is rounded once to q's dtype. Every
// sum runs in the same order whatever the blocking, and a row's arithmetic is the same in a run as alone, so
// results are bitwise independent of the batch. The K and V rows of the next keys are prefetched: one head's rows
// sit Hkv rows apart in blocks scattered over the pool, which the hardware prefetchers do not follow, and a step's
// cache is mostly outside L2 (docs/benchmarks.md §31). Work items are split over torch's intra-op threads only when
// there is enough work to pay for waking them.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "float_rows.h"
#include "kernels.h"
#include "line_aligned.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

using Floats = tandem_aligned::LineVector<float>;

// 16 elements as fp32
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
inline __m512 load16(const at::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }

// softmax of sc[0, len) in place, in fp32: the maximum subtracted, exp16, one division.
inline void softmax_in_place(float* sc, int64_t len) {
  const int64_t full = len / 16 * 16;
  const __mmask16 tail = static_cast<__mmask16>((1u << (len - full)) - 1);
  const __m512 peak = _mm512_set1_ps(tandem_rows::row_max(sc, len));
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j = 0; j < full; j += 16) {
    const __m512 e = tandem_rows::exp16(_mm512_sub_ps(_mm512_loadu_ps(sc + j), peak));
    _mm512_storeu_ps(sc + j, e);
    sum = _mm512_add_ps(sum, e);
  }
  if (tail) {
    const __m512 x = _mm512_sub_ps(_mm512_maskz_loadu_ps(tail, sc + full), peak);
    const __m512 e = _mm512_maskz_mov_ps(tail, tandem_rows::exp16(x));
    _mm512_mask_storeu_ps(sc + full, tail, e);
    sum = _mm512_add_ps(sum, e);
  }
  const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(sum));
  for (int64_t j = 0; j < full; j += 16) _mm512_storeu_ps(sc + j, _mm512_mul_ps(_mm512_loadu_ps(sc + j), inv));
  if (tail) _mm512_mask_storeu_ps(sc + full, tail, _mm512_mul_ps(_mm512_maskz_loadu_ps(tail, sc + full), inv));
}

// out[i] = the sum of v[i]'s 16 lanes, for 16 vectors at once: three rounds of shuffles and adds (45 instructions
// for 16 sums, where one horizontal reduction each would take about 8 apiece in a dependent chain).
inline __m512 hsum16(const __m512* v) {
  __m512 quad[4];  // quad[k], 128-bit lane L: the sums over lane L of v[4k .. 4k+3]
  for (int k = 0; k < 4; ++k) {
    const __m512 a = v[4 * k], b = v[4 * k + 1], c = v[4 * k + 2], e = v[4 * k + 3];
    const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
    const __m512 ce = _mm512_add_ps(_mm512_unpacklo_ps(c, e), _mm512_unpackhi_ps(c, e));
    quad[k] = _mm512_add_ps(_mm512_shuffle_ps(ab, ce, _MM_SHUFFLE(1, 0, 1, 0)),
                            _mm512_shuffle_ps(ab, ce, _MM_SHUFFLE(3, 2, 3, 2)));
  }
  const __m512 x = _mm512_add_ps(_mm512_shuffle_f32x4(quad[0], quad[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_f32x4(quad[0], quad[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 y = _mm512_add_ps(_mm512_shuffle_f32x4(quad[2], quad[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_f32x4(quad[2], quad[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(3, 1, 3, 1)));
}

// Runs of consecutive queries of one sequence: rows i..i+n-1 whose block tables agree (over the blocks the last
// one reads) and whose context lengths grow by one a row (a verify item's tokens, each over its context so far).
// A run is one work item per KV head, so each cached K/V row is read once for all its queries.
struct Run {
  int64_t row, count;
};

std::vector<Run> query_runs(const int32_t* lens, const int32_t* tables, int64_t s, int64_t bs, int64_t max_blocks) {
  std::vector<Run> runs;
  for (int64_t i = 0; i < s;) {
    int64_t n = 1;
    while (i + n < s && lens[i + n] == lens[i + n - 1] + 1 &&
           std::equal(tables + i * max_blocks, tables + i * max_blocks + (lens[i + n] + bs - 1) / bs,
                      tables + (i + n) * max_blocks))
      ++n;
    runs.push_back({i, n});
    i += n;
  }
  return runs;
}

// A block of 16 cached keys as fp32 rows for the scores: an fp32 cache's own rows, any other converted once into
// `buffer` [16, d] (then read by every query row of the item from L1); rows past the `n` real keys read `zeros`.
template <typename C>
inline void keys_as_f32(const C* const* keys, int64_t n, int64_t d, float* buffer, const float* zeros,
                        const float** rows) {
  for (int64_t i = 0; i < 16; ++i) {
    if (i >= n) {
      rows[i] = zeros;
    } else if constexpr (std::is_same_v<C, float>) {
      rows[i] = keys[i];
    } else {
      for (int64_t c = 0; c < d / 16; ++c) _mm512_storeu_ps(buffer + i * d + c * 16, load16(keys[i] + c * 16));
      rows[i] = buffer + i * d;
    }
  }
}

// Ask for a cached K or V row (`bytes` long) ahead of its use, into L2.
inline void prefetch_row(const void* row, int64_t bytes) {
  for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(static_cast<const char*>(row) + b, _MM_HINT_T1);
}

// One query row's scores against a block of keys: out[i] = query . rows[i] for i < n. Sixteen independent dot
// products in registers, each summed chunk by chunk in order, then reduced together (hsum16).
inline void scores16(const float* query, const float* const* rows, int64_t chunks, int64_t n, float* out) {
  __m512 dots[16];
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) dots[i] = _mm512_setzero_ps();
  for (int64_t c = 0; c < chunks; ++c) {
    const __m512 qc = _mm512_loadu_ps(query + c * 16);
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) dots[i] = _mm512_fmadd_ps(qc, _mm512_loadu_ps(rows[i] + c * 16), dots[i]);
  }
  _mm512_mask_storeu_ps(out, static_cast<__mmask16>((1u << n) - 1), hsum16(dots));
}

// acc[r][c0 * 16 ...] += sum over keys j in [j0, j1) of w[r][j] * values[j][c0 * 16 ...], for R rows (stride ldw
// and lda) and NC chunks of 16: R * NC accumulators stay in registers over the keys, each value chunk is converted
// once for the R rows, and each row's sum runs over j in order.
template <int R, int NC, typename C>
void weighted_values(const float* w, int64_t ldw, const C* const* values, int64_t j0, int64_t j1, int64_t c0,
                     float* acc, int64_t lda) {
  __m512 a[R][NC];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int k = 0; k < NC; ++k) a[r][k] = _mm512_loadu_ps(acc + r * lda + (c0 + k) * 16);
  for (int64_t j = j0; j < j1; ++j) {
    __m512 v[NC];
#pragma GCC unroll 4
    for (int k = 0; k < NC; ++k) v[k] = load16(values[j] + (c0 + k) * 16);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m512 s = _mm512_set1_ps(w[r * ldw + j]);
#pragma GCC unroll 4
      for (int k = 0; k < NC; ++k) a[r][k] = _mm512_fmadd_ps(s, v[k], a[r][k]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int k = 0; k < NC; ++k) _mm512_storeu_ps(acc + r * lda + (c0 + k) * 16, a[r][k]);
}

template <typename C>
using WeightedValues = void (*)(const float*, int64_t, const C* const*, int64_t, int64_t, int64_t, float*, int64_t);

// weighted_values for 1-4 rows and 1-4 chunks
template <typename C>
WeightedValues<C> weighted_values_for(int64_t rows, int64_t chunks) {
  static constexpr WeightedValues<C> table[4][4] = {
      {weighted_values<1, 1, C>, weighted_values<1, 2, C>, weighted_values<1, 3, C>, weighted_values<1, 4, C>},
      {weighted_values<2, 1, C>, weighted_values<2, 2, C>, weighted_values<2, 3, C>, weighted_values<2, 4, C>},
      {weighted_values<3, 1, C>, weighted_values<3, 2, C>, weighted_values<3, 3, C>, weighted_values<3, 4, C>},
      {weighted_values<4, 1, C>, weighted_values<4, 2, C>, weighted_values<4, 3, C>, weighted_values<4, 4, C>}};
  return table[rows - 1][chunks - 1];
}

template <typename Q, typename C>
void decode_kernel(const Q* q, const C* kc, const C* vc, const int32_t* lens, const int32_t* tables, Q* out, int64_t s,
                   int64_t hq, int64_t hkv, int64_t d, int64_t bs, int64_t max_blocks, float scale) {
  const int64_t group = hq / hkv, chunks = d / 16;
  const std::vector<Run> runs = query_runs(lens, tables, s, bs, max_blocks);
  int64_t work = 0;  // multiply-adds of the largest item
  for (const Run& run : runs) work = std::max<int64_t>(work, run.count * lens[run.row + run.count - 1] * group * d * 2);
  const int64_t grain = std::max<int64_t>(1, (1 << 17) / std::max<int64_t>(work, 1));
  at::parallel_for(0, static_cast<int64_t>(runs.size()) * hkv, grain, [&](int64_t begin, int64_t end) {
    Floats scores, query, acc, key_block(16 * d), zeros(d, 0.f);
    std::vector<const C*> keys, values;  // [longest]: each cached token's K and V row of head h
    const int64_t row_bytes = d * static_cast<int64_t>(sizeof(C));
    for (int64_t item = begin; item < end; ++item) {
      const Run run = runs[item / hkv];
      const int64_t h = item % hkv, first = lens[run.row], longest = lens[run.row + run.count - 1];
      const int64_t rows = run.count * group;  // (query r, head g) -> row r * group + g, over first + r keys
      const int32_t* table = tables + run.row * max_blocks;
      query.resize(rows * d);  // [rows, d], scaled, fp32
      acc.assign(rows * d, 0.f);  // [rows, d]
      const int64_t ls = (longest + 15) / 16 * 16;  // a scores row's stride: each row starts a cache line
      scores.resize(rows * ls);  // [rows, ls]; row r * group + g holds lens[run.row + r] scores
      for (int64_t r = 0; r < run.count; ++r)
        for (int64_t g = 0; g < group; ++g)
          for (int64_t c = 0; c < chunks; ++c)
            _mm512_storeu_ps(query.data() + (r * group + g) * d + c * 16,
                             _mm512_mul_ps(load16(q + ((run.row + r) * hq + h * group + g) * d + c * 16),
                                           _mm512_set1_ps(scale)));
      keys.resize(longest);
      values.resize(longest);
      for (int64_t j0 = 0; j0 < longest; j0 += bs) {
        const int64_t offset = (static_cast<int64_t>(table[j0 / bs]) * bs * hkv + h) * d;
        for (int64_t j = j0, stop = std::min(longest, j0 + bs); j < stop; ++j) {
          keys[j] = kc + offset + (j - j0) * hkv * d;
          values[j] = vc + offset + (j - j0) * hkv * d;
        }
      }
      for (int64_t i = 0; i < std::min<int64_t>(longest, 32); ++i) prefetch_row(keys[i], row_bytes);
      // scores, 16 keys at a time for every row (a row's scores past its own context are computed, never read)
      for (int64_t j = 0; j < longest; j += 16) {
        const int64_t n = std::min<int64_t>(16, longest - j);
        for (int64_t i = j + 32, stop = std::min(longest, j + 48); i < stop; ++i) prefetch_row(keys[i], row_bytes);
        for (int64_t i = j, stop = std::min(longest, j + 16); i < stop; ++i) prefetch_row(values[i], row_bytes);
        const float* block[16];
        keys_as_f32(keys.data() + j, n, d, key_block.data(), zeros.data(), block);
        for (int64_t row = 0; row < rows; ++row)
          scores16(query.data() + row * d, block, chunks, n, scores.data() + row * ls + j);
      }
      for (int64_t row = 0; row < rows; ++row) softmax_in_place(scores.data() + row * ls, first + row / group);
      // values weighted by the scores, up to four rows at a time: the keys every row of the four sees in
      // registers, then the keys only the later queries of a run see, row by row
      for (int64_t r0 = 0; r0 < rows; r0 += 4) {
        const int64_t n = std::min<int64_t>(4, rows - r0), shared = first + r0 / group;
        for (int64_t c0 = 0; c0 < chunks; c0 += 4)
          weighted_values_for<C>(n, std::min<int64_t>(4, chunks - c0))(scores.data() + r0 * ls, ls,
                                                                        values.data(), 0, shared, c0,
                                                                        acc.data() + r0 * d, d);
        for (int64_t row = r0; row < r0 + n; ++row)
          for (int64_t j = shared; j < first + row / group; ++j)
            for (int64_t c = 0; c < chunks; ++c)
              _mm512_storeu_ps(acc.data() + row * d + c * 16,
                               _mm512_fmadd_ps(_mm512_set1_ps(scores[row * ls + j]), load16(values[j] + c * 16),
                                               _mm512_loadu_ps(acc.data() + row * d + c * 16)));
      }
      for (int64_t row = 0; row < rows; ++row) {
        Q* o = out + ((run.row + row / group) * hq + h * group + row % group) * d;
        for (int64_t e = 0; e < d; ++e) o[e] = static_cast<Q>(acc[row * d + e]);
      }
    }
  });
}

template <typename Q>
void dispatch_cache(const torch::Tensor& q, const torch::Tensor& kc, const torch::Tensor& vc, const torch::Tensor& lens,
                    const torch::Tensor& tables, torch::Tensor& out, float scale) {
  const int64_t s = q.size(-3), hq = q.size(-2), d = q.size(-1), bs = kc.size(1), hkv = kc.size(2);
  const auto* qp = q.data_ptr<Q>();
  auto* op = out.data_ptr<Q>();
  const auto* lp = lens.data_ptr<int32_t>();
  const auto* tp = tables.data_ptr<int32_t>();
  const int64_t mb = tables.size(1);
  switch (kc.scalar_type()) {
    case at::kFloat:
      return decode_kernel(qp, kc.data_ptr<float>(), vc.data_ptr<float>(), lp, tp, op, s, hq, hkv, d, bs, mb, scale);
    case at::kBFloat16:
      return decode_kernel(qp, kc.data_ptr<at::BFloat16>(), vc.data_ptr<at::BFloat16>(), lp, tp, op, s, hq, hkv, d, bs,
                           mb, scale);
    default:
      return decode_kernel(qp, kc.data_ptr<at::Half>(), vc.data_ptr<at::Half>(), lp, tp, op, s, hq, hkv, d, bs, mb, scale);
  }
}

// q [S, Hq, D] (or [1, S, Hq, D]); caches [num_blocks, block_size, Hkv, D] (fp32, bf16 or fp16, both the same);
// context_lens [S] int32 (each >= 1, the token being decoded included); block_tables [S, max_blocks] int32 -> q's
// shape and dtype.
torch::Tensor decode_attention(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                               const torch::Tensor& context_lens, const torch::Tensor& block_tables, double scale) {
  TORCH_CHECK(q.is_cpu() && k_cache.is_cpu() && v_cache.is_cpu(), "decode_attention: CPU tensors only");
  TORCH_CHECK((q.dim() == 3 || (q.dim() == 4 && q.size(0) == 1)) && q.is_contiguous(),
              "decode_attention: q must be contiguous [S, Hq, D] or [1, S, Hq, D]");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes() &&
                  v_cache.is_contiguous() && v_cache.scalar_type() == k_cache.scalar_type(),
              "decode_attention: caches must be contiguous [num_blocks, block_size, Hkv, D] of one dtype");
  const auto kv = k_cache.scalar_type();
  TORCH_CHECK(kv == at::kFloat || kv == at::kBFloat16 || kv == at::kHalf, "decode_attention: cache dtype ", kv);
  const int64_t s = q.size(-3), hq = q.size(-2), d = q.size(-1), hkv = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == d && d % 16 == 0, "decode_attention: head_dim must match and be a multiple of 16");
  TORCH_CHECK(hkv > 0 && hq % hkv == 0, "decode_attention: query heads must be a multiple of KV heads");
  TORCH_CHECK(context_lens.dim() == 1 && context_lens.size(0) == s && context_lens.scalar_type() == at::kInt &&
                  context_lens.is_contiguous(),
              "decode_attention: context_lens must be int32 [S]");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == s && block_tables.scalar_type() == at::kInt &&
                  block_tables.is_contiguous(),
              "decode_attention: block_tables must be int32 [S, max_blocks]");
  tandem_kernels::check_decode_metadata("decode_attention", context_lens.data_ptr<int32_t>(),
                                        block_tables.data_ptr<int32_t>(), s, block_tables.size(1), k_cache.size(1),
                                        k_cache.size(0));
  auto out = torch::empty_like(q);
  switch (q.scalar_type()) {
    case at::kFloat: dispatch_cache<float>(q, k_cache, v_cache, context_lens, block_tables, out, scale); break;
    case at::kBFloat16: dispatch_cache<at::BFloat16>(q, k_cache, v_cache, context_lens, block_tables, out, scale); break;
    case at::kHalf: dispatch_cache<at::Half>(q, k_cache, v_cache, context_lens, block_tables, out, scale); break;
    default: TORCH_CHECK(false, "decode_attention: q must be fp32, bf16 or fp16");
  }
  return out;
}

// src [T, Hkv, D] or [1, T, Hkv, D] (any strides, D contiguous) copied row by row to cache [num_blocks, block_size, Hkv, D] of the same
// dtype at slots[t] (checked by the caller): no temporary tensors (index_copy_ and its cast cost a few microseconds
// each, per layer and step).
void copy_rows(const torch::Tensor& src, torch::Tensor& cache, const int64_t* slots) {
  const int64_t t = src.size(-3), hkv = cache.size(2), d = cache.size(3);
  const int64_t elem = cache.element_size(), s0 = src.stride(-3), s1 = src.stride(-2);
  const auto* from = static_cast<const char*>(src.data_ptr());
  auto* to = static_cast<char*>(cache.data_ptr());
  for (int64_t i = 0; i < t; ++i)
    for (int64_t h = 0; h < hkv; ++h)
      std::memcpy(to + ((slots[i] * hkv + h) * d) * elem, from + (i * s0 + h * s1) * elem, d * elem);
}

// k, v [T, Hkv, D] (or [1, T, Hkv, D]) written at slot_mapping [T] int64 of both caches (cast to the cache's dtype),
// in one call.
void store_kv(const torch::Tensor& k, const torch::Tensor& v, torch::Tensor& k_cache, torch::Tensor& v_cache,
              const torch::Tensor& slot_mapping) {
  const int64_t hkv = k_cache.size(2), d = k_cache.size(3);
  const auto direct = [&](const torch::Tensor& src, const torch::Tensor& cache) {
    return src.scalar_type() == cache.scalar_type() && (src.dim() == 3 || (src.dim() == 4 && src.size(0) == 1)) &&
           src.size(-2) == hkv && src.size(-1) == d && src.stride(-1) == 1 && cache.is_contiguous();
  };
  if (direct(k, k_cache) && direct(v, v_cache) && v_cache.sizes() == k_cache.sizes() &&
      slot_mapping.scalar_type() == at::kLong &&
      slot_mapping.is_contiguous() && slot_mapping.dim() == 1 && slot_mapping.size(0) == k.size(-3) &&
      v.size(-3) == k.size(-3) && v.dim() == k.dim()) {
    const int64_t* slots = slot_mapping.data_ptr<int64_t>();
    const int64_t slots_total = k_cache.size(0) * k_cache.size(1);
    for (int64_t i = 0; i < k.size(-3); ++i)  // all checked before anything is written
      TORCH_CHECK(slots[i] >= 0 && slots[i] < slots_total, "store_kv: slot ", slots[i], " out of range");
    copy_rows(k, k_cache, slots);
    copy_rows(v, v_cache, slots);
    return;
  }
  // a cast, or unusual strides: the rows as [T, Hkv, D] (a leading 1 dropped, nothing else reinterpreted)
  const auto rows = [&](const torch::Tensor& src) {
    TORCH_CHECK((src.dim() == 3 || (src.dim() == 4 && src.size(0) == 1)) && src.size(-2) == hkv && src.size(-1) == d,
                "store_kv: k and v must be [T, Hkv, D] or [1, T, Hkv, D] with the cache's Hkv and D, got ", src.sizes());
    return src.dim() == 4 ? src[0] : src;
  };
  auto kf = k_cache.view({-1, hkv, d}), vf = v_cache.view({-1, hkv, d});
  kf.index_copy_(0, slot_mapping, rows(k).to(k_cache.scalar_type()));
  vf.index_copy_(0, slot_mapping, rows(v).to(v_cache.scalar_type()));
}

// A decode-only step's attention for one layer, in one call: k, v [1, T, Hkv, D] stored at slot_mapping, then q
// [1, T, Hq, D] over the cache -> [1, T, Hq, D] (store_kv, then decode_attention: the same checks and results). It
// spares the per-layer Python of the two calls and their views (about 12 layers a step), and takes the 4-d tensors
// as they are: a select or unsqueeze per tensor cost 1.5-2 us each, 5 a layer.
torch::Tensor decode_step(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, torch::Tensor& k_cache,
                          torch::Tensor& v_cache, const torch::Tensor& slot_mapping, const torch::Tensor& context_lens,
                          const torch::Tensor& block_tables, double scale) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && q.size(0) == 1 && k.size(0) == 1 && v.size(0) == 1,
              "decode_step: q, k and v must be [1, T, heads, D]");
  store_kv(k, v, k_cache, v_cache, slot_mapping);
  return decode_attention(q.contiguous(), k_cache, v_cache, context_lens, block_tables, scale);
}

// ------------------------------------------------------------------------- the compiled graph's attention operator
// `tandem::paged_attention(q, k, v, kv_cache, layer, slot_mapping, context_lens, block_tables, scale)` is what a
// compiled decoder's graph calls for each layer of a decode-only step (every token a decode query: plain decodes,
// verify items): `decode_step` over layer `layer` of the whole cache kv_cache [L, 2, num_blocks, block_size, Hkv, D]
// (K at index 0, V at 1; written in place at slot_mapping, so the schema declares it mutated), with the step's
// metadata as the other arguments. Everything it reads is an argument: no state outside the call.
torch::Tensor graph_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                              torch::Tensor& kv_cache, int64_t layer, const torch::Tensor& slot_mapping,
                              const torch::Tensor& context_lens, const torch::Tensor& block_tables, double scale) {
  TORCH_CHECK(kv_cache.dim() == 6 && kv_cache.size(1) == 2 && kv_cache.is_contiguous(),
              "tandem::paged_attention: kv_cache must be contiguous [L, 2, num_blocks, block_size, Hkv, D]");
  TORCH_CHECK(layer >= 0 && layer < kv_cache.size(0), "tandem::paged_attention: layer ", layer, " out of range");
  auto layer_cache = kv_cache.select(0, layer);  // [2, num_blocks, block_size, Hkv, D]
  auto k_cache = layer_cache.select(0, 0), v_cache = layer_cache.select(0, 1);
  return decode_step(q, k, v, k_cache, v_cache, slot_mapping, context_lens, block_tables, scale);
}

}  // namespace

namespace tandem_kernels {

void check_decode_metadata(const char* op, const int32_t* lens, const int32_t* tables, int64_t s, int64_t max_blocks,
                           int64_t block_size, int64_t num_blocks) {
  for (int64_t i = 0; i < s; ++i) {  // every read stays inside the cache
    TORCH_CHECK(lens[i] >= 1 && lens[i] <= max_blocks * block_size, op, ": context length ", lens[i], " out of range");
    for (int64_t b = 0; b < (lens[i] + block_size - 1) / block_size; ++b)
      TORCH_CHECK(tables[i * max_blocks + b] >= 0 && tables[i * max_blocks + b] < num_blocks, op,
                  ": block id out of range");
  }
}

void decode_attention_rows(const float* q, const float* k_cache, const float* v_cache, const int32_t* lens,
                           const int32_t* tables, float* out, int64_t s, int64_t hq, int64_t hkv, int64_t d,
                           int64_t bs, int64_t max_blocks, float scale) {
  decode_kernel(q, k_cache, v_cache, lens, tables, out, s, hq, hkv, d, bs, max_blocks, scale);
}

void decode_attention_rows(const c10::BFloat16* q, const c10::BFloat16* k_cache, const c10::BFloat16* v_cache,
                           const int32_t* lens, const int32_t* tables, c10::BFloat16* out, int64_t s, int64_t hq,
                           int64_t hkv, int64_t d, int64_t bs, int64_t max_blocks, float scale) {
  decode_kernel(q, k_cache, v_cache, lens, tables, out, s, hq, hkv, d, bs, max_blocks, scale);
}

}  // namespace tandem_kernels

// The graph's operator (its fake kernel for tracing is registered from Python: tandem_native/loader.py)
TORCH_LIBRARY_FRAGMENT(tandem, m) {
  m.def(
      "paged_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) kv_cache, int layer_idx, Tensor slot_mapping, "
      "Tensor context_lens, Tensor block_tables, float scale) -> Tensor");
}
TORCH_LIBRARY_IMPL(tandem, CPU, m) { m.impl("paged_attention", &graph_attention); }

// Called from Python directly (a pybind call costs a few microseconds); the GIL is released while they run.
void register_paged_attention(pybind11::module_& m) {
  m.def("decode_attention", &decode_attention, "paged decode attention over the cache in place",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("store_kv", &store_kv, "store a step's K and V at their slots", pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("decode_step", &decode_step, "store a decode step's K and V, then attend over the cache",
        pybind11::call_guard<pybind11::gil_scoped_release>());
}
