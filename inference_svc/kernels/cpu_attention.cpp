// Paged attention for the CPU's decode step: each sequence's one query over its cached K/V, read in place from the
// paged cache (no gather), and the step's K/V stores, in two calls per layer instead of a dozen torch ops.
//
// Layout (inference_svc/engine/attention.py): caches [num_blocks, block_size, Hkv, D] in fp32, bf16 or fp16;
// block tables int32 [S, max_blocks]; token slot = block * block_size + offset. Each (sequence, KV head) is one work
// item: the G = Hq / Hkv query heads of the group score every cached token (fp32 dot products), softmax in fp32
// (max subtracted), and the values are summed with those weights in fp32; the output is rounded once to q's dtype.
// Work items are split over torch's intra-op threads only when there is enough work to pay for waking them.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

// 16 elements as fp32
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
inline __m512 load16(const at::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }

template <typename Q, typename C>
void decode_kernel(const Q* q, const C* kc, const C* vc, const int32_t* lens, const int32_t* tables, Q* out, int64_t s,
                   int64_t hq, int64_t hkv, int64_t d, int64_t bs, int64_t max_blocks, float scale) {
  const int64_t group = hq / hkv, chunks = d / 16;
  int64_t longest = 0;
  for (int64_t i = 0; i < s; ++i) longest = std::max<int64_t>(longest, lens[i]);
  const int64_t work = longest * group * d * 2;  // multiply-adds of one item
  const int64_t grain = std::max<int64_t>(1, (1 << 17) / std::max<int64_t>(work, 1));
  at::parallel_for(0, s * hkv, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<__m512> acc(group * chunks);
    std::vector<__m512> query(group * chunks);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t seq = item / hkv, h = item % hkv, len = lens[seq];
      const int32_t* table = tables + seq * max_blocks;
      for (int64_t g = 0; g < group; ++g)
        for (int64_t c = 0; c < chunks; ++c)
          query[g * chunks + c] = _mm512_mul_ps(load16(q + (seq * hq + h * group + g) * d + c * 16), _mm512_set1_ps(scale));
      scores.resize(group * len);
      for (int64_t j = 0; j < len; ++j) {  // scores [G, len]
        const C* key = kc + ((static_cast<int64_t>(table[j / bs]) * bs + j % bs) * hkv + h) * d;
        for (int64_t g = 0; g < group; ++g) {
          __m512 dot = _mm512_setzero_ps();
          for (int64_t c = 0; c < chunks; ++c) dot = _mm512_fmadd_ps(query[g * chunks + c], load16(key + c * 16), dot);
          scores[g * len + j] = _mm512_reduce_add_ps(dot);
        }
      }
      for (int64_t g = 0; g < group; ++g) {  // softmax in place
        float* sc = scores.data() + g * len;
        const float top = *std::max_element(sc, sc + len);
        float total = 0.f;
        for (int64_t j = 0; j < len; ++j) total += (sc[j] = std::exp(sc[j] - top));
        const float inv = 1.f / total;
        for (int64_t j = 0; j < len; ++j) sc[j] *= inv;
      }
      std::fill(acc.begin(), acc.end(), _mm512_setzero_ps());
      for (int64_t j = 0; j < len; ++j) {
        const C* value = vc + ((static_cast<int64_t>(table[j / bs]) * bs + j % bs) * hkv + h) * d;
        for (int64_t c = 0; c < chunks; ++c) {
          const __m512 v = load16(value + c * 16);
          for (int64_t g = 0; g < group; ++g)
            acc[g * chunks + c] = _mm512_fmadd_ps(_mm512_set1_ps(scores[g * len + j]), v, acc[g * chunks + c]);
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        alignas(64) float row[16];
        Q* o = out + (seq * hq + h * group + g) * d;
        for (int64_t c = 0; c < chunks; ++c) {
          _mm512_store_ps(row, acc[g * chunks + c]);
          for (int i = 0; i < 16; ++i) o[c * 16 + i] = static_cast<Q>(row[i]);
        }
      }
    }
  });
}

template <typename Q>
void dispatch_cache(const torch::Tensor& q, const torch::Tensor& kc, const torch::Tensor& vc, const torch::Tensor& lens,
                    const torch::Tensor& tables, torch::Tensor& out, float scale) {
  const int64_t s = q.size(0), hq = q.size(1), d = q.size(2), bs = kc.size(1), hkv = kc.size(2);
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

// q [S, Hq, D]; caches [num_blocks, block_size, Hkv, D] (fp32, bf16 or fp16, both the same); context_lens [S] int32
// (each >= 1, the token being decoded included); block_tables [S, max_blocks] int32 -> [S, Hq, D] in q's dtype.
torch::Tensor decode_attention(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                               const torch::Tensor& context_lens, const torch::Tensor& block_tables, double scale) {
  TORCH_CHECK(q.is_cpu() && k_cache.is_cpu() && v_cache.is_cpu(), "decode_attention: CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous(), "decode_attention: q must be contiguous [S, Hq, D]");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes() &&
                  v_cache.is_contiguous() && v_cache.scalar_type() == k_cache.scalar_type(),
              "decode_attention: caches must be contiguous [num_blocks, block_size, Hkv, D] of one dtype");
  const auto kv = k_cache.scalar_type();
  TORCH_CHECK(kv == at::kFloat || kv == at::kBFloat16 || kv == at::kHalf, "decode_attention: cache dtype ", kv);
  const int64_t s = q.size(0), hq = q.size(1), d = q.size(2), hkv = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == d && d % 16 == 0, "decode_attention: head_dim must match and be a multiple of 16");
  TORCH_CHECK(hkv > 0 && hq % hkv == 0, "decode_attention: query heads must be a multiple of KV heads");
  TORCH_CHECK(context_lens.dim() == 1 && context_lens.size(0) == s && context_lens.scalar_type() == at::kInt &&
                  context_lens.is_contiguous(),
              "decode_attention: context_lens must be int32 [S]");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == s && block_tables.scalar_type() == at::kInt &&
                  block_tables.is_contiguous(),
              "decode_attention: block_tables must be int32 [S, max_blocks]");
  const int64_t bs = k_cache.size(1), nb = k_cache.size(0), mb = block_tables.size(1);
  const auto* lens = context_lens.data_ptr<int32_t>();
  const auto* tables = block_tables.data_ptr<int32_t>();
  for (int64_t i = 0; i < s; ++i) {  // every read stays inside the cache
    TORCH_CHECK(lens[i] >= 1 && lens[i] <= mb * bs, "decode_attention: context length ", lens[i], " out of range");
    for (int64_t b = 0; b < (lens[i] + bs - 1) / bs; ++b)
      TORCH_CHECK(tables[i * mb + b] >= 0 && tables[i * mb + b] < nb, "decode_attention: block id out of range");
  }
  auto out = torch::empty_like(q);
  switch (q.scalar_type()) {
    case at::kFloat: dispatch_cache<float>(q, k_cache, v_cache, context_lens, block_tables, out, scale); break;
    case at::kBFloat16: dispatch_cache<at::BFloat16>(q, k_cache, v_cache, context_lens, block_tables, out, scale); break;
    case at::kHalf: dispatch_cache<at::Half>(q, k_cache, v_cache, context_lens, block_tables, out, scale); break;
    default: TORCH_CHECK(false, "decode_attention: q must be fp32, bf16 or fp16");
  }
  return out;
}

// k, v [T, Hkv, D] written at slot_mapping [T] int64 of both caches (cast to the cache's dtype), in one call.
void store_kv(const torch::Tensor& k, const torch::Tensor& v, torch::Tensor& k_cache, torch::Tensor& v_cache,
              const torch::Tensor& slot_mapping) {
  const int64_t hkv = k_cache.size(2), d = k_cache.size(3);
  auto kf = k_cache.view({-1, hkv, d}), vf = v_cache.view({-1, hkv, d});
  kf.index_copy_(0, slot_mapping, k.to(k_cache.scalar_type()));
  vf.index_copy_(0, slot_mapping, v.to(v_cache.scalar_type()));
}

}  // namespace

// Called from Python directly (a pybind call costs a few microseconds); the GIL is released while they run.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, "paged decode attention over the cache in place",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("store_kv", &store_kv, "store a step's K and V at their slots", pybind11::call_guard<pybind11::gil_scoped_release>());
}
