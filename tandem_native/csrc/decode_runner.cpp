// The decode runner: a decode-only step (one token, a speculative verify item, a token for each of many streams)
// through the whole decoder in one call, for an fp32 or bf16 model whose projections are dense or quantized with a
// row kernel (shared_model/native_decode.py).
//
// It holds each layer's weights from load (the ServingDecoder's own tensors: no copy) and, per step, takes the token
// ids, their positions, the paged KV cache and the step's metadata. Per layer: the input norm, the merged q/k/v
// projection, the q and k heads' norms and RoPE, the K/V stores and the decode attention, the output projection and
// residual, the post-attention norm, the merged gate/up projection, SiLU(gate) * up, the down projection and
// residual; then the final norm, and, where it holds the LM head (`logits`), the head's projection: the step's
// logits come back from the same call, so the memory bus streams the head's weight right after the last layer's.
// The projections are the kernels their modules run for these rows (row_gemm.cpp's row_gemm or, past its rows, AMX
// tile_gemm (dot_gemm without AMX) for a dense weight, by the weight's row table; int8_gemv.cpp's for an int8
// weight's rows; int4_gemv.cpp's for int4 codes) and the attention paged_attention.cpp's, called directly
// (kernels.h); the rest is here, split by rows over torch's intra-op threads where a step has enough of them. What
// a compiled graph spends between its kernels (the dispatcher per operator, a fresh output tensor each, a handle per
// graph input, dynamo's wrappers) is gone.
//
// Arithmetic: every row alone, in the same order at any row count (the kernels' property too), so a row's bits do not
// depend on the others in the step: a verify item's rows score their drafts with a decode row's bits. The norms
// are torch's (the mean of the squares in fp32 as a sum divided by the width, x times 1/sqrt(mean + eps) rounded to
// the dtype, then times the weight, rounded); RoPE, SiLU-mul and the residual adds round each op's result to the
// dtype, as eager does (and the compiled graph, whose inductor kernels emulate those casts). The norms' sums run 16
// lanes at a time, so they differ from torch's and inductor's in the last bits, and in fp32 the compiler may fuse a
// product and a sum into one rounding.
//
// The runner owns its scratch rows (sized for `max_rows` at construction) and serializes its calls on them; the
// GIL is released while it runs.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "float_rows.h"
#include "kernels.h"
#include "line_aligned.h"
#include "tiles.h"

namespace {

// ---------------------------------------------------------------------------------------------- fp32 / bf16 rows
// bf16 is carried as its bits (uint16_t); widening is exact (a 16-bit shift), narrowing rounds to nearest even.
inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16(const uint16_t* p, __mmask16 m) {
  const __m256i bits = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
inline void store16(float* p, __m512 v, __mmask16 m) { _mm512_mask_storeu_ps(p, m, v); }
// v rounded to bf16 (nearest even; NaN stays a quiet NaN, as c10's rounding), the bits in each lane's low half
inline __m512i bf16_bits(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i biased = _mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7fff)), lsb);
  const __m512i rounded = _mm512_srli_epi32(biased, 16);
  return _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
}
inline void store16(uint16_t* p, __m512 v, __mmask16 m) {
  _mm256_mask_storeu_epi16(p, m, _mm512_cvtepi32_epi16(bf16_bits(v)));
}
// v rounded to the dtype and widened back (bf16's rounding of an op's result; nothing for fp32)
inline __m512 round_to(float*, __m512 v) { return v; }
inline __m512 round_to(uint16_t*, __m512 v) { return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits(v), 16)); }

inline __mmask16 lanes(int64_t left) { return left >= 16 ? __mmask16(0xffff) : __mmask16((1u << left) - 1); }

// out[0, n) = weight * (x / sqrt(mean(x^2) + eps)), as shared_model.serving_model.rms_norm_into rounds it
template <typename T>
void rms_norm(const T* x, const T* weight, T* out, int64_t n, float eps) {
  __m512 sum = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __m512 v = load16(x + i, lanes(n - i));
    sum = _mm512_fmadd_ps(v, v, sum);
  }
  const float inv = 1.f / std::sqrt(_mm512_reduce_add_ps(sum) / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = lanes(n - i);
    const __m512 normed = round_to(out, _mm512_mul_ps(load16(x + i, m), _mm512_set1_ps(inv)));
    store16(out + i, _mm512_mul_ps(load16(weight + i, m), normed), m);
  }
}

// x[0, n) += y[0, n), rounded once
template <typename T>
void add_into(T* x, const T* y, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = lanes(n - i);
    store16(x + i, _mm512_add_ps(load16(x + i, m), load16(y + i, m)), m);
  }
}

// out[0, n) = silu(gate) * up, each op's result rounded to the dtype as eager rounds it (the compiled graph too:
// inductor's emulate_precision_casts); silu(g) = g / (1 + e^-g), from e^-|g| so the exponent never overflows
template <typename T>
void silu_mul(const T* gate, const T* up, T* out, int64_t n) {
  const __m512 one = _mm512_set1_ps(1.f);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = lanes(n - i);
    const __m512 g = load16(gate + i, m);
    const __m512 e = tandem_rows::exp16(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(g)));  // e^-|g|
    const __mmask16 negative = _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_LT_OQ);
    const __m512 numerator = _mm512_mask_mul_ps(g, negative, g, e);  // g >= 0: g / (1 + e^-g); else g e^g / (1 + e^g)
    const __m512 silu = round_to(out, _mm512_div_ps(numerator, _mm512_add_ps(one, e)));
    store16(out + i, _mm512_mul_ps(silu, load16(up + i, m)), m);
  }
}

// x1, x2 (the head's halves, `half` each) rotated by cos/sin: out = (x1 c - x2 s, x2 c + x1 s), each product and
// sum rounded to the dtype as eager rounds it (serving_model.rope_into)
template <typename T>
void rope(const T* x, const T* cos, const T* sin, T* out, int64_t half) {
  const auto mul = [out](__m512 a, __m512 b) { return round_to(out, _mm512_mul_ps(a, b)); };
  for (int64_t i = 0; i < half; i += 16) {
    const __mmask16 m = lanes(half - i);
    const __m512 x1 = load16(x + i, m), x2 = load16(x + half + i, m), c = load16(cos + i, m), s = load16(sin + i, m);
    store16(out + i, _mm512_sub_ps(mul(x1, c), mul(x2, s)), m);
    store16(out + half + i, _mm512_add_ps(mul(x2, c), mul(x1, s)), m);
  }
}

template <typename T>
const T* ptr(const torch::Tensor& t) { return static_cast<const T*>(t.data_ptr()); }
template <typename T>
T* mut(torch::Tensor& t) { return static_cast<T*>(t.data_ptr()); }

// One projection y [m, n] = x [m, k] W^T, by the kernel its module runs for these rows: the dense weight through
// its row table's kernel (row_gemm up to row_max rows, tile_gemm up to tile_max: raw rows, nothing allocated), or an
// int8 weight's rows through int8_gemv, or int4 codes' rows through int4_gemv (the operators themselves, over the
// runner's rows viewed as a tensor).
constexpr int64_t kInt4MaxRows = 16;  // int4_gemv.cpp's rows per call
constexpr int64_t kMaxHeadDim = 512;  // a head's scratch row lives on the stack

struct Projection {
  enum Kind { kRowGemm, kInt8Gemv, kInt4Gemv } kind;
  torch::Tensor weight;      // [n, k] dense, int8 [n, k] or int4 codes [n, k / 2]
  torch::Tensor scales;      // int8: [n]; int4: [2, n, k / group]; undefined for dense
  int64_t group, n, k;       // group: int8's activation groups, int4's weight groups (0 for dense)
  int64_t row_max, tile_max;  // dense: row_gemm up to row_max rows, tile_gemm (bf16) up to tile_max; int8: most rows

  // the most rows a call takes
  int64_t most_rows() const {
    return kind == kRowGemm ? std::max(row_max, tile_max) : kind == kInt8Gemv ? row_max : kInt4MaxRows;
  }

  template <typename T>
  void operator()(const T* x, T* y, int64_t m, at::ScalarType dtype) const {
    if (kind == kRowGemm) {
      if constexpr (std::is_same_v<T, uint16_t>) {
        if (m > row_max) {  // the many-row kernel: AMX tiles where usable, else AVX512_BF16 dot products
          if (tandem_tiles::amx_bf16_ready()) return tandem_kernels::tile_gemm_rows(x, ptr<T>(weight), y, m, n, k);
          return tandem_kernels::dot_gemm_rows(x, ptr<T>(weight), y, m, n, k);
        }
      }
      tandem_kernels::row_gemm_rows(x, ptr<T>(weight), y, m, n, k);
      return;
    }
    auto rows = torch::from_blob(const_cast<T*>(x), {m, k}, torch::dtype(dtype));
    const torch::Tensor out = kind == kInt8Gemv ? tandem_kernels::int8_gemv_op(rows, weight, scales, group)
                                                : tandem_kernels::int4_gemv_op(rows, weight, scales, group);
    TORCH_CHECK(out.numel() == m * n && out.scalar_type() == dtype, "DecodeRunner: a ", m, "-row call of a projection ",
                "to ", n, " outputs returned ", out.sizes(), " ", out.scalar_type());
    std::memcpy(y, out.data_ptr(), m * n * sizeof(T));
  }
};

// A projection from Python's description: (kind, weight, scales or None, group, out_features, in_features, row_max,
// tile_max); the last two a dense weight's row table (row_gemm up to row_max rows, tile_gemm up to tile_max: equal
// for none), both the row kernel's most rows for a quantized one (int8_gemv's; int4_gemv's are kInt4MaxRows).
using ProjectionSpec = std::tuple<std::string, torch::Tensor, std::optional<torch::Tensor>, int64_t, int64_t, int64_t,
                                  int64_t, int64_t>;

Projection projection(const ProjectionSpec& spec) {
  const auto& [kind, weight, scales, group, n, k, row_max, tile_max] = spec;
  TORCH_CHECK(kind == "row_gemm" || kind == "int8_gemv" || kind == "int4_gemv",
              "DecodeRunner: unknown projection kind ", kind);
  const auto which = kind == "row_gemm"    ? Projection::kRowGemm
                     : kind == "int8_gemv" ? Projection::kInt8Gemv
                                           : Projection::kInt4Gemv;
  TORCH_CHECK(which == Projection::kRowGemm || scales.has_value(), "DecodeRunner: a ", kind,
              " projection needs scales");
  TORCH_CHECK(which != Projection::kRowGemm || (row_max >= 1 && tile_max >= row_max), "DecodeRunner: a row_gemm ",
              "projection needs 1 <= row_max <= tile_max, got ", row_max, " and ", tile_max);
  TORCH_CHECK(which != Projection::kInt8Gemv || row_max >= 1, "DecodeRunner: an int8_gemv projection needs its most ",
              "rows (at least 1), got ", row_max);
  TORCH_CHECK(tile_max == row_max || (weight.scalar_type() == at::kBFloat16 &&
                                      (tandem_tiles::amx_bf16_ready() || tandem_kernels::dot_bf16_ready())),
              "DecodeRunner: rows past row_gemm's need a bf16 weight and AMX-BF16 tiles or AVX512_BF16");
  return {which, weight, scales.value_or(torch::Tensor()), group, n, k, row_max, tile_max};
}
inline void attend(const float* q, const float* kc, const float* vc, const int32_t* lens, const int32_t* tables,
                   float* out, int64_t s, int64_t hq, int64_t hkv, int64_t d, int64_t bs, int64_t mb, float scale) {
  tandem_kernels::decode_attention_rows(q, kc, vc, lens, tables, out, s, hq, hkv, d, bs, mb, scale);
}
inline void attend(const uint16_t* q, const uint16_t* kc, const uint16_t* vc, const int32_t* lens,
                   const int32_t* tables, uint16_t* out, int64_t s, int64_t hq, int64_t hkv, int64_t d, int64_t bs,
                   int64_t mb, float scale) {
  using B = c10::BFloat16;
  tandem_kernels::decode_attention_rows(reinterpret_cast<const B*>(q), reinterpret_cast<const B*>(kc),
                                        reinterpret_cast<const B*>(vc), lens, tables, reinterpret_cast<B*>(out), s,
                                        hq, hkv, d, bs, mb, scale);
}

struct Layer {
  torch::Tensor input_norm, post_norm;     // [H] each
  Projection qkv, o_proj, gate_up, down;   // [Q + 2 KV, H], [H, Q], [2 I, H], [H, I]
  std::optional<torch::Tensor> qk_norm;    // [Hq + Hkv, D]: q heads', then k heads'
};

class DecodeRunner {
 public:
  // norms: per layer [input_norm, post_norm]; projections: per layer [qkv, o_proj, gate_up, down_proj], each a
  // ProjectionSpec; qk_norms: per layer, or None for a model without q/k norms; embed [V, H]; final_norm [H];
  // rope_cos, rope_sin [P, D / 2]; every float tensor in one dtype (fp32 or bf16), contiguous, on the CPU.
  // lm_head: the LM head's ProjectionSpec ([V, H]), or None for a runner without `logits`.
  DecodeRunner(const std::vector<std::vector<torch::Tensor>>& norms,
               const std::vector<std::vector<ProjectionSpec>>& projections,
               const std::vector<std::optional<torch::Tensor>>& qk_norms, torch::Tensor embed, torch::Tensor final_norm,
               torch::Tensor rope_cos, torch::Tensor rope_sin, int64_t num_heads, int64_t num_kv_heads,
               int64_t head_dim, double eps, double scale, int64_t max_rows,
               const std::optional<ProjectionSpec>& lm_head)
      : embed_(std::move(embed)), final_norm_(std::move(final_norm)), rope_cos_(std::move(rope_cos)),
        rope_sin_(std::move(rope_sin)), hq_(num_heads), hkv_(num_kv_heads), d_(head_dim), eps_(eps), scale_(scale),
        max_rows_(max_rows) {
    TORCH_CHECK(!norms.empty() && norms.size() == qk_norms.size() && norms.size() == projections.size(),
                "DecodeRunner: norms, projections and qk_norms for every layer");
    dtype_ = embed_.scalar_type();
    TORCH_CHECK(dtype_ == at::kFloat || dtype_ == at::kBFloat16, "DecodeRunner: fp32 or bf16 weights only, got ",
                dtype_);
    TORCH_CHECK(hq_ > 0 && hkv_ > 0 && hq_ % hkv_ == 0 && d_ % 16 == 0 && d_ <= kMaxHeadDim && max_rows_ >= 1,
                "DecodeRunner: heads must divide, head_dim be a multiple of 16 up to ", kMaxHeadDim,
                ", max_rows at least 1");
    h_ = embed_.size(1);
    const int64_t q = hq_ * d_, kv = hkv_ * d_;
    check("embed", embed_, {embed_.size(0), h_});
    check("final_norm", final_norm_, {h_});
    check("rope_cos", rope_cos_, {rope_cos_.size(0), d_ / 2});
    check("rope_sin", rope_sin_, {rope_cos_.size(0), d_ / 2});
    for (size_t i = 0; i < norms.size(); ++i) {
      TORCH_CHECK(norms[i].size() == 2 && projections[i].size() == 4, "DecodeRunner: layer ", i,
                  " needs 2 norms and 4 projections");
      const auto& p = projections[i];
      Layer l{norms[i][0], norms[i][1], projection(p[0]), projection(p[1]), projection(p[2]), projection(p[3]),
              qk_norms[i]};
      check("input_norm", l.input_norm, {h_});
      check("post_norm", l.post_norm, {h_});
      TORCH_CHECK(l.gate_up.n % 2 == 0 && (i == 0 || l.gate_up.n == 2 * inter_),
                  "DecodeRunner: gate_up must be [2 I, H], I the same in every layer");
      inter_ = l.gate_up.n / 2;
      check("qkv", l.qkv, q + 2 * kv, h_);
      check("o_proj", l.o_proj, h_, q);
      check("gate_up", l.gate_up, 2 * inter_, h_);
      check("down_proj", l.down, h_, inter_);
      if (l.qk_norm) check("qk_norm", *l.qk_norm, {hq_ + hkv_, d_});
      layers_.push_back(std::move(l));
    }
    TORCH_CHECK(h_ % 32 == 0 && q % 32 == 0 && inter_ % 32 == 0,
                "DecodeRunner: hidden, q and intermediate sizes must be multiples of 32 (row_gemm's K)");
    if (lm_head) {
      head_ = projection(*lm_head);
      TORCH_CHECK(head_->n >= 1, "DecodeRunner: lm_head needs at least one output");
      check("lm_head", *head_, head_->n, h_);
    }
    const int64_t elem = embed_.element_size(), r = max_rows_;
    for (auto* buffer : {&x_, &normed_, &out_}) buffer->resize(r * h_ * elem);
    qkv_.resize(r * (q + 2 * kv) * elem);
    q_.resize(r * q * elem);
    attn_.resize(r * q * elem);
    act_.resize(r * 2 * inter_ * elem);
    mid_.resize(r * inter_ * elem);
  }

  int64_t max_rows() const { return max_rows_; }
  bool has_lm_head() const { return head_.has_value(); }

  // input_ids, positions [T] int64 (T <= max_rows); kv_cache [L, 2, num_blocks, block_size, Hkv, D] in the weights'
  // dtype (written at slot_mapping); slot_mapping [T] int64; context_lens [T] int32; block_tables [T, max_blocks]
  // int32 -> final-norm hidden states [T, H]. Everything is checked before the cache is written.
  torch::Tensor hidden_states(const torch::Tensor& input_ids, const torch::Tensor& positions, torch::Tensor& kv_cache,
                              const torch::Tensor& slot_mapping, const torch::Tensor& context_lens,
                              const torch::Tensor& block_tables) {
    return step(input_ids, positions, kv_cache, slot_mapping, context_lens, block_tables, false);
  }

  // The same step through the LM head: -> logits [T, V] in the weights' dtype, each row the head's kernel for T rows
  // applied to that row's final-norm hidden state (as the head module computes it for those rows).
  torch::Tensor logits(const torch::Tensor& input_ids, const torch::Tensor& positions, torch::Tensor& kv_cache,
                       const torch::Tensor& slot_mapping, const torch::Tensor& context_lens,
                       const torch::Tensor& block_tables) {
    TORCH_CHECK(head_.has_value(), "DecodeRunner: this runner holds no LM head (built with lm_head=None)");
    return step(input_ids, positions, kv_cache, slot_mapping, context_lens, block_tables, true);
  }

 private:
  torch::Tensor step(const torch::Tensor& input_ids, const torch::Tensor& positions, torch::Tensor& kv_cache,
                     const torch::Tensor& slot_mapping, const torch::Tensor& context_lens,
                     const torch::Tensor& block_tables, bool head) {
    const int64_t t = input_ids.numel();
    TORCH_CHECK(t >= 1 && t <= max_rows_, "DecodeRunner: ", t, " rows; it runs 1 to ", max_rows_);
    const auto is = [&](const torch::Tensor& x, at::ScalarType type) {
      return x.is_cpu() && x.scalar_type() == type && x.is_contiguous() && x.dim() == 1 && x.size(0) == t;
    };
    TORCH_CHECK(is(input_ids, at::kLong) && is(positions, at::kLong) && is(slot_mapping, at::kLong),
                "DecodeRunner: input_ids, positions and slot_mapping must be contiguous int64 [T]");
    TORCH_CHECK(is(context_lens, at::kInt), "DecodeRunner: context_lens must be contiguous int32 [T]");
    TORCH_CHECK(block_tables.is_cpu() && block_tables.scalar_type() == at::kInt && block_tables.is_contiguous() &&
                    block_tables.dim() == 2 && block_tables.size(0) == t,
                "DecodeRunner: block_tables must be contiguous int32 [T, max_blocks]");
    TORCH_CHECK(kv_cache.is_cpu() && kv_cache.scalar_type() == dtype_ && kv_cache.is_contiguous() &&
                    kv_cache.dim() == 6 && kv_cache.size(0) == static_cast<int64_t>(layers_.size()) &&
                    kv_cache.size(1) == 2 && kv_cache.size(4) == hkv_ && kv_cache.size(5) == d_,
                "DecodeRunner: kv_cache must be contiguous [L, 2, num_blocks, block_size, Hkv, D] in the weights' "
                "dtype");
    const int64_t nb = kv_cache.size(2), bs = kv_cache.size(3), mb = block_tables.size(1);
    const auto* ids = input_ids.data_ptr<int64_t>();
    const auto* pos = positions.data_ptr<int64_t>();
    const auto* slots = slot_mapping.data_ptr<int64_t>();
    for (int64_t i = 0; i < t; ++i) {
      TORCH_CHECK(ids[i] >= 0 && ids[i] < embed_.size(0), "DecodeRunner: token id ", ids[i], " out of range");
      TORCH_CHECK(pos[i] >= 0 && pos[i] < rope_cos_.size(0), "DecodeRunner: position ", pos[i], " out of range");
      TORCH_CHECK(slots[i] >= 0 && slots[i] < nb * bs, "DecodeRunner: slot ", slots[i], " out of range");
    }
    tandem_kernels::check_decode_metadata("DecodeRunner", context_lens.data_ptr<int32_t>(),
                                          block_tables.data_ptr<int32_t>(), t, mb, bs, nb);
    auto out = torch::empty({t, head ? head_->n : h_}, embed_.options());
    pybind11::gil_scoped_release released;
    std::lock_guard<std::mutex> lock(mutex_);
    const Step step{ids, pos, slots, context_lens.data_ptr<int32_t>(), block_tables.data_ptr<int32_t>(), t, nb, bs, mb};
    if (dtype_ == at::kFloat) {
      run<float>(step, kv_cache, mut<float>(out), head);
    } else {
      run<uint16_t>(step, kv_cache, reinterpret_cast<uint16_t*>(out.data_ptr()), head);
    }
    return out;
  }

  struct Step {
    const int64_t *ids, *pos, *slots;
    const int32_t *lens, *tables;
    int64_t t, num_blocks, block_size, max_blocks;
  };

  void check(const char* what, const torch::Tensor& w, std::vector<int64_t> shape) const {
    TORCH_CHECK(w.is_cpu() && w.scalar_type() == dtype_ && w.is_contiguous() && w.sizes() == at::IntArrayRef(shape),
                "DecodeRunner: ", what, " must be a contiguous CPU tensor of shape ", at::IntArrayRef(shape),
                " in the embedding's dtype; got ", w.sizes(), " ", w.scalar_type());
  }

  // a projection's shape, and a dense one's weight ([n, k] in the dtype; the quantized operators check theirs)
  void check(const char* what, const Projection& p, int64_t n, int64_t k) const {
    TORCH_CHECK(p.n == n && p.k == k, "DecodeRunner: ", what, " must map ", k, " inputs to ", n, " outputs, got ",
                p.k, " to ", p.n);
    if (p.kind == Projection::kRowGemm) check(what, p.weight, {n, k});
    TORCH_CHECK(p.kind == Projection::kRowGemm || (p.weight.dim() == 2 && p.weight.size(0) == n),
                "DecodeRunner: ", what, "'s quantized weight must have ", n, " rows");
    TORCH_CHECK(max_rows_ <= p.most_rows(), "DecodeRunner: ", what, "'s kernel takes at most ", p.most_rows(),
                " rows a call (", p.kind == Projection::kRowGemm ? "its row table's" : p.kind == Projection::kInt8Gemv
                ? "int8_gemv's" : "int4_gemv's", "): max_rows ", max_rows_, " is more");
  }

  template <typename T>
  static T* rows(tandem_aligned::LineVector<char>& buffer) { return reinterpret_cast<T*>(buffer.data()); }

  // Rows [0, t) of `body(i)`, split over torch's intra-op threads `grain` rows at a time at least.
  template <typename F>
  static void each_row(int64_t t, int64_t grain, const F& body) {
    at::parallel_for(0, t, grain, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) body(i);
    });
  }

  // the step's final-norm hidden states [t, H] into `result`, or with `head` its logits [t, V]
  template <typename T>
  void run(const Step& s, torch::Tensor& kv_cache, T* result, bool head) {
    const int64_t t = s.t, q_size = hq_ * d_, kv_size = hkv_ * d_, qkv_size = q_size + 2 * kv_size;
    const int64_t half = d_ / 2, layer_stride = 2 * s.num_blocks * s.block_size * kv_size;
    const float eps = static_cast<float>(eps_);
    T *x = rows<T>(x_), *normed = rows<T>(normed_), *out = rows<T>(out_), *qkv = rows<T>(qkv_), *q = rows<T>(q_);
    T *attn = rows<T>(attn_), *act = rows<T>(act_), *mid = rows<T>(mid_);
    // rows a thread's share of the elementwise work holds at least (about 4096 values): an OpenMP region costs
    // more than a few rows' norms, so a step of a few rows runs them on the calling thread
    const int64_t grain = std::max<int64_t>(1, 4096 / h_);
    const int64_t head_grain = std::max<int64_t>(1, 4096 / ((hq_ + hkv_) * d_));
    for (int64_t i = 0; i < t; ++i) std::memcpy(x + i * h_, ptr<T>(embed_) + s.ids[i] * h_, h_ * sizeof(T));
    T* cache = mut<T>(kv_cache);
    for (size_t li = 0; li < layers_.size(); ++li) {
      const Layer& l = layers_[li];
      T* k_cache = cache + li * layer_stride;
      T* v_cache = k_cache + layer_stride / 2;
      each_row(t, grain, [&](int64_t i) { rms_norm(x + i * h_, ptr<T>(l.input_norm), normed + i * h_, h_, eps); });
      l.qkv(normed, qkv, t, dtype_);
      each_row(t, head_grain, [&](int64_t i) {
        alignas(64) T head[kMaxHeadDim];
        const T* row = qkv + i * qkv_size;
        const T* cos = ptr<T>(rope_cos_) + s.pos[i] * half;
        const T* sin = ptr<T>(rope_sin_) + s.pos[i] * half;
        for (int64_t j = 0; j < hq_ + hkv_; ++j) {  // q heads to q_, k heads to their cache slot
          const T* in = row + j * d_;
          if (l.qk_norm) rms_norm(in, ptr<T>(*l.qk_norm) + j * d_, head, d_, eps), in = head;
          T* dest = j < hq_ ? q + (i * hq_ + j) * d_ : k_cache + (s.slots[i] * hkv_ + j - hq_) * d_;
          rope(in, cos, sin, dest, half);
        }
        std::memcpy(v_cache + s.slots[i] * kv_size, row + q_size + kv_size, kv_size * sizeof(T));
      });
      attend(q, k_cache, v_cache, s.lens, s.tables, attn, t, hq_, hkv_, d_, s.block_size, s.max_blocks,
             static_cast<float>(scale_));
      l.o_proj(attn, out, t, dtype_);
      each_row(t, grain, [&](int64_t i) {
        add_into(x + i * h_, out + i * h_, h_);
        rms_norm(x + i * h_, ptr<T>(l.post_norm), normed + i * h_, h_, eps);
      });
      l.gate_up(normed, act, t, dtype_);  // [t, 2 I]: gate, then up
      each_row(t, std::max<int64_t>(1, grain * h_ / inter_), [&](int64_t i) {
        silu_mul(act + i * 2 * inter_, act + i * 2 * inter_ + inter_, mid + i * inter_, inter_);
      });
      l.down(mid, out, t, dtype_);
      each_row(t, grain, [&](int64_t i) { add_into(x + i * h_, out + i * h_, h_); });
    }
    T* hidden = head ? normed : result;
    each_row(t, grain, [&](int64_t i) { rms_norm(x + i * h_, ptr<T>(final_norm_), hidden + i * h_, h_, eps); });
    if (head) (*head_)(hidden, result, t, dtype_);
  }

  std::vector<Layer> layers_;
  torch::Tensor embed_, final_norm_, rope_cos_, rope_sin_;
  at::ScalarType dtype_;
  int64_t hq_, hkv_, d_, h_ = 0, inter_ = 0;
  double eps_, scale_;
  int64_t max_rows_;
  std::optional<Projection> head_;  // the LM head, for `logits`
  std::mutex mutex_;  // the scratch rows below are one step's
  tandem_aligned::LineVector<char> x_, normed_, out_, qkv_, q_, attn_, act_, mid_;
};

}  // namespace

void register_decode_runner(pybind11::module_& m) {
  pybind11::class_<DecodeRunner>(m, "DecodeRunner",
                                 "A decode-only step of up to max_rows rows through an fp32/bf16 decoder, in C++")
      .def(pybind11::init<const std::vector<std::vector<torch::Tensor>>&,
                          const std::vector<std::vector<ProjectionSpec>>&,
                          const std::vector<std::optional<torch::Tensor>>&, torch::Tensor, torch::Tensor,
                          torch::Tensor, torch::Tensor, int64_t, int64_t, int64_t, double, double, int64_t,
                          const std::optional<ProjectionSpec>&>(),
           pybind11::arg("norms"), pybind11::arg("projections"), pybind11::arg("qk_norms"), pybind11::arg("embed"),
           pybind11::arg("final_norm"),
           pybind11::arg("rope_cos"), pybind11::arg("rope_sin"), pybind11::arg("num_heads"),
           pybind11::arg("num_kv_heads"), pybind11::arg("head_dim"), pybind11::arg("eps"), pybind11::arg("scale"),
           pybind11::arg("max_rows"), pybind11::arg("lm_head"))
      .def_property_readonly("max_rows", &DecodeRunner::max_rows)
      .def_property_readonly("has_lm_head", &DecodeRunner::has_lm_head)
      .def("hidden_states", &DecodeRunner::hidden_states, pybind11::arg("input_ids"), pybind11::arg("positions"),
           pybind11::arg("kv_cache"), pybind11::arg("slot_mapping"), pybind11::arg("context_lens"),
           pybind11::arg("block_tables"))
      .def("logits", &DecodeRunner::logits, pybind11::arg("input_ids"), pybind11::arg("positions"),
           pybind11::arg("kv_cache"), pybind11::arg("slot_mapping"), pybind11::arg("context_lens"),
           pybind11::arg("block_tables"));
}
