// Sampling on the CPU: truncation thresholds (top-k, top-p, min-p) without sorting the vocabulary, and one call that
// samples a batch of rows (`sample_rows`).
//
// For each row of probabilities p [S, V] (fp32, non-negative; a row need not sum to 1), the smallest probability
// tau that the row keeps: the kept tokens are those with p >= tau, ties at the boundary all kept.
//   - top-k (0 < k < V): the k-th largest value;
//   - top-p (< 1), over the tokens top-k keeps, with Z their mass: the value at the first place, in descending
//     order, where the running mass reaches top_p * Z (the smallest set whose mass reaches top_p);
//   - min-p (> 0): min_p times the largest value;
//   tau is the largest of these (0 when none applies). inference_svc/engine/sampler.py's `_thresholds_torch` is the
//   same rule with a sort; the tests hold this kernel to it.
// Selection instead of a sort: top-k and top-p are each a radix select over the values' bits (histograms of
// counts for top-k and of masses for top-p, in double; two passes over the row). torch's CPU sort of one row of
// 8,192 logits took most of a sampled decode step's sampling time (docs/benchmarks-archive.md §7).
// `truncation_thresholds` and `sample_rows` split rows over torch's intra-op threads (each row's arithmetic is the
// same on any thread, so the tokens do not depend on the count).
#include <torch/extension.h>
#include <pybind11/stl.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "float_rows.h"

#include <algorithm>
#include <array>
#include <cstdint>
#include <cmath>
#include <cstring>
#include <limits>
#include <tuple>
#include <vector>

namespace {

// The lanes of the 16 values from index i that lie in a row of n.
inline __mmask16 lanes_at(int64_t i, int64_t n) {
  return i + 16 <= n ? __mmask16(0xFFFF) : static_cast<__mmask16>((1u << (n - i)) - 1);
}

// Which of those lanes of v hold a positive value at least `floor` (NaN fails both comparisons).
inline __mmask16 kept(__mmask16 lanes, __m512 v, __m512 floor) {
  return _mm512_mask_cmp_ps_mask(_mm512_mask_cmp_ps_mask(lanes, v, _mm512_setzero_ps(), _CMP_GT_OQ), v, floor,
                                 _CMP_GE_OQ);
}

// Which of the 16 values from p[0] (`lanes` of them) are kept and share the chosen prefix of bits; their bit
// patterns in `keys`.
inline __mmask16 selected(const float* p, __mmask16 lanes, __m512 floor, __m512i known, __m512i prefix, __m512i* keys) {
  const __m512 v = _mm512_maskz_loadu_ps(lanes, p);
  *keys = _mm512_castps_si512(v);
  return _mm512_mask_cmpeq_epi32_mask(kept(lanes, v, floor), _mm512_and_si512(*keys, known), prefix);
}

constexpr int kBuckets = 2048;  // the widest level's digits
constexpr int kSplit = 4;       // partial histograms of a pass over the row (see radix_select)

// The largest value t among the row's positive values >= floor at which the running weight, summed in descending
// order (weight 1 per value, or the value itself when `by_mass`), first reaches `target`. A radix select over the
// values' bits (positive floats order as their bit patterns), three levels of 11, 11 and 10 bits with a histogram
// each: the first two read the row 16 values at a time (the lanes that pass the filter are added one by one), the
// last only the values the second kept (those sharing the chosen prefix). A row's values mostly share a few
// exponents, so a pass adds into the same bucket over and over: value i adds into partial histogram i % kSplit, so
// that consecutive additions do not wait for each other, and the partials are summed in a fixed order (the weights
// are doubles: any order is as good as the sorted rule's, which sums in another order again). When rounding keeps
// the target from being reached, the smallest such value.
float radix_select(const float* p, int64_t vocab, float floor, bool by_mass, double target) {
  constexpr int kShifts[3] = {21, 10, 0}, kWidths[3] = {11, 11, 10};
  static thread_local std::vector<double> parts(kSplit * kBuckets);  // all zero between calls (cleared after use)
  static thread_local std::vector<float> candidates;  // level 1's values that share the prefix chosen at level 0
  std::array<double, kBuckets> hist;
  candidates.clear();
  uint32_t prefix = 0, known = 0;  // the digits chosen so far, and which bits they fill
  double above = 0.0;              // weight of the values larger than every value that has the prefix
  const __m512 floor_v = _mm512_set1_ps(floor);
  for (int level = 0; level < 3; ++level) {
    const int shift = kShifts[level];
    const uint32_t digits = (1u << kWidths[level]) - 1;
    int64_t low = digits, high = -1;  // the digits that received weight
    if (level < 2) {
      const __m512i known_v = _mm512_set1_epi32(static_cast<int>(known));
      const __m512i prefix_v = _mm512_set1_epi32(static_cast<int>(prefix));
      alignas(64) uint32_t keys[16];
      for (int64_t i = 0; i < vocab; i += 16) {
        __m512i key_v;
        __mmask16 m = selected(p + i, lanes_at(i, vocab), floor_v, known_v, prefix_v, &key_v);
        if (!m) continue;
        _mm512_store_si512(keys, key_v);
        for (; m; m &= m - 1) {
          const int l = __builtin_ctz(m);
          const float v = p[i + l];
          const int64_t d = (keys[l] >> shift) & digits;
          if (level == 1) candidates.push_back(v);
          low = std::min(low, d), high = std::max(high, d);
          parts[(l % kSplit) * kBuckets + d] += by_mass ? static_cast<double>(v) : 1.0;
        }
      }
      for (int64_t d = low; d <= high; ++d) {
        hist[d] = (parts[d] + parts[kBuckets + d]) + (parts[2 * kBuckets + d] + parts[3 * kBuckets + d]);
        for (int j = 0; j < kSplit; ++j) parts[j * kBuckets + d] = 0.0;
      }
    } else {
      std::fill(hist.begin(), hist.begin() + digits + 1, 0.0);
      for (const float v : candidates) {
        uint32_t key;
        std::memcpy(&key, &v, 4);
        if ((key & known) != prefix) continue;
        const int64_t d = (key >> shift) & digits;
        low = std::min(low, d), high = std::max(high, d);
        hist[d] += by_mass ? static_cast<double>(v) : 1.0;
      }
    }
    int64_t chosen = -1, lowest = -1;
    for (int64_t d = high; d >= low; --d) {
      if (hist[d] == 0.0) continue;
      lowest = d;
      if (above + hist[d] >= target) {
        chosen = d;
        break;
      }
      above += hist[d];
    }
    if (lowest < 0) return 0.f;  // no value at all
    if (chosen < 0) {            // not reached: the smallest bucket, whose weight is not above it
      chosen = lowest;
      above -= hist[lowest];
    }
    prefix |= static_cast<uint32_t>(chosen) << shift;
    known |= digits << shift;
  }
  float t;
  std::memcpy(&t, &prefix, 4);
  return t;
}

// The weight of the row's positive values >= floor: how many, and their mass (in double), 16 values at a time.
struct Weight {
  int64_t count;
  double mass;
};
Weight weight_from(const float* p, int64_t vocab, float floor) {
  const __m512 floor_v = _mm512_set1_ps(floor);
  __m512d lo = _mm512_setzero_pd(), hi = _mm512_setzero_pd();
  int64_t count = 0;
  for (int64_t i = 0; i < vocab; i += 16) {
    const __mmask16 lanes = lanes_at(i, vocab);
    const __m512 v = _mm512_maskz_loadu_ps(lanes, p + i);
    const __mmask16 m = kept(lanes, v, floor_v);
    if (!m) continue;
    count += __builtin_popcount(m);
    const __m512 kept = _mm512_maskz_mov_ps(m, v);
    lo = _mm512_add_pd(lo, _mm512_cvtps_pd(_mm512_castps512_ps256(kept)));
    hi = _mm512_add_pd(hi, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(kept), 1))));
  }
  return {count, _mm512_reduce_add_pd(_mm512_add_pd(lo, hi))};
}

// A floor at or below the value `radix_select(p, vocab, floor, by_mass, target)` finds, above `floor` where the
// row allows: the largest of peak / 2^10 and peak / 2^20 whose values (those >= it and >= floor) already weigh
// `target` (a margin of 1e-9 for the mass, summed in another order), else `floor`. The selection then reads the
// values under it sixteen at a time without adding them: on a peaked row that is nearly all of them.
float narrowed_floor(const float* p, int64_t vocab, float floor, bool by_mass, double target, float peak) {
  for (const float scale : {0x1p-10f, 0x1p-20f}) {
    const float lower = peak * scale;
    if (!(lower > floor)) break;
    const Weight w = weight_from(p, vocab, lower);
    if (by_mass ? w.mass >= target * (1.0 + 1e-9) : static_cast<double>(w.count) >= target) return lower;
  }
  return floor;
}

float row_threshold(const float* p, int64_t vocab, int64_t top_k, double top_p, double min_p) {
  const float peak = tandem_rows::row_max(p, vocab);
  float tau = 0.f;
  if (top_k > 0 && top_k < vocab) {
    const double k = static_cast<double>(top_k);
    tau = radix_select(p, vocab, narrowed_floor(p, vocab, 0.f, false, k, peak), false, k);
  }
  if (top_p < 1.0) {  // of the mass top-k keeps
    const double target = top_p * weight_from(p, vocab, tau).mass;
    tau = std::max(tau, radix_select(p, vocab, narrowed_floor(p, vocab, tau, true, target, peak), true, target));
  }
  // min_p rounded to fp32, then an fp32 product: the sorted rule's arithmetic, so both keep the same boundary token
  if (min_p > 0.0) tau = std::max(tau, static_cast<float>(min_p) * peak);
  return tau;
}

// probs [S, V] fp32, top_k int64 [S] (0: none), top_p fp64 [S] (1: none), min_p fp64 [S] (0: none) -> tau [S] fp32
torch::Tensor truncation_thresholds(const torch::Tensor& probs, const torch::Tensor& top_k, const torch::Tensor& top_p,
                                    const torch::Tensor& min_p) {
  TORCH_CHECK(probs.is_cpu() && probs.dim() == 2 && probs.scalar_type() == at::kFloat,
              "truncation_thresholds: probs must be a CPU fp32 [S, V] tensor");
  const int64_t rows = probs.size(0), vocab = probs.size(1);
  TORCH_CHECK(top_k.numel() == rows && top_k.scalar_type() == at::kLong, "truncation_thresholds: top_k must be int64 [S]");
  TORCH_CHECK(top_p.numel() == rows && top_p.scalar_type() == at::kDouble, "truncation_thresholds: top_p must be fp64 [S]");
  TORCH_CHECK(min_p.numel() == rows && min_p.scalar_type() == at::kDouble, "truncation_thresholds: min_p must be fp64 [S]");
  const auto pc = probs.contiguous();
  const auto kc = top_k.contiguous(), tpc = top_p.contiguous(), mpc = min_p.contiguous();
  auto tau = torch::empty({rows}, probs.options());
  const float* pp = pc.data_ptr<float>();
  const int64_t* kp = kc.data_ptr<int64_t>();
  const double* tp = tpc.data_ptr<double>();
  const double* mp = mpc.data_ptr<double>();
  float* out = tau.data_ptr<float>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) out[r] = row_threshold(pp + r * vocab, vocab, kp[r], tp[r], mp[r]);
  });
  return tau;
}

// Whether every value of x[0, n) is finite: x * 0 is 0 for a finite x and NaN for an infinity or a NaN.
bool row_finite(const float* x, int64_t n) {
  const __m512 zero = _mm512_setzero_ps();
  __mmask16 bad = 0;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_mul_ps(_mm512_loadu_ps(x + i), zero);
    bad |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  }
  const __mmask16 tail = static_cast<__mmask16>((1u << (n - i)) - 1);
  const __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(tail, x + i), zero);
  bad |= _mm512_mask_cmp_ps_mask(tail, v, v, _CMP_UNORD_Q);
  return bad == 0;
}

// torch.argmax of a finite row: the first index of its largest value. The largest value first (16 lanes of
// maxima, then their maximum: exact), then the first place that equals it (+0 and -0 compare equal, as the
// sequential rule's `>` treats them).
int64_t row_argmax(const float* x, int64_t vocab) {
  const int64_t full = vocab / 16 * 16;
  const __mmask16 tail = static_cast<__mmask16>((1u << (vocab - full)) - 1);
  const __m512 peak = _mm512_set1_ps(tandem_rows::row_max(x, vocab));
  for (int64_t i = 0; i < full; i += 16) {
    const __mmask16 hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + i), peak, _CMP_EQ_OQ);
    if (hit) return i + __builtin_ctz(hit);
  }
  const __mmask16 hit = _mm512_mask_cmp_ps_mask(tail, _mm512_maskz_loadu_ps(tail, x + full), peak, _CMP_EQ_OQ);
  return hit ? full + __builtin_ctz(hit) : 0;
}

// The first token whose running weight (summed in order, in double) reaches (1 - u) * total: Sampler.draw's rule,
// torch's sequential fp64 cumsum then searchsorted (the first place not below the point), so the same token for
// the same weights and u. A zero weight adds nothing to the running sum (the weights are not negative), and after
// truncation most are zero: the first pass adds only the positive ones (16 weights scanned at a time), in order,
// keeping the running sum at the end of every 16 (`ends`, scratch); the search finds the block where the sum
// reaches the point and walks that block alone again. The same additions in the same order as a full cumulative sum.
int64_t row_draw(const float* w, int64_t vocab, double u, std::vector<double>& ends) {
  const int64_t blocks = (vocab + 15) / 16;
  ends.resize(blocks);
  double running = 0.0;
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t i = b * 16;
    const __mmask16 lanes = lanes_at(i, vocab);
    __mmask16 nonzero =
        _mm512_mask_cmp_ps_mask(lanes, _mm512_maskz_loadu_ps(lanes, w + i), _mm512_setzero_ps(), _CMP_NEQ_UQ);
    for (; nonzero; nonzero &= nonzero - 1) running += static_cast<double>(w[i + __builtin_ctz(nonzero)]);
    ends[b] = running;
  }
  const double point = (1.0 - u) * running;
  const int64_t b = std::lower_bound(ends.begin(), ends.end(), point) - ends.begin();
  if (b == blocks) return vocab - 1;
  double sum = b > 0 ? ends[b - 1] : 0.0;
  for (int64_t i = b * 16; i < std::min(vocab, b * 16 + 16); ++i)
    if ((sum += static_cast<double>(w[i])) >= point) return i;
  return vocab - 1;  // unreachable: the block's end reaches the point
}

// One token per row of logits [S, V] fp32 (penalties already applied), with per-row temperature (1 for a greedy
// row), greedy flag, top-k (0: none), top-p, min-p and uniform number u, as Python lists: (tokens, the rows whose
// logits are not all finite). sampler.py's `probabilities` then `Sampler.draw` (argmax for a greedy row) in one
// call: the same ATen operations for the probabilities and the same rules for the threshold and the draw, so the
// same tokens, without a Python call per operation. A row that is not finite gets token 0 (a placeholder).
std::tuple<std::vector<int64_t>, std::vector<int64_t>> sample_rows(
    const torch::Tensor& logits, const std::vector<double>& temperature, const std::vector<bool>& greedy,
    const std::vector<int64_t>& top_k, const std::vector<double>& top_p, const std::vector<double>& min_p,
    const std::vector<double>& u) {
  TORCH_CHECK(logits.is_cpu() && logits.dim() == 2 && logits.scalar_type() == at::kFloat,
              "sample_rows: logits must be a CPU fp32 [S, V] tensor");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  TORCH_CHECK(vocab > 0, "sample_rows: the vocabulary is empty");
  for (const size_t n : {temperature.size(), greedy.size(), top_k.size(), top_p.size(), min_p.size(), u.size()})
    TORCH_CHECK(static_cast<int64_t>(n) == rows, "sample_rows: every per-row list needs ", rows, " entries, got ", n);
  const auto x = logits.contiguous();
  const float* xp = x.data_ptr<float>();
  std::vector<int64_t> tokens(rows, 0), failed;
  for (int64_t r = 0; r < rows; ++r) {
    if (!row_finite(xp + r * vocab, vocab)) failed.push_back(r);
  }
  // sampler.probabilities' operations, in its order: the temperature rounded to fp32 and floored at its smallest
  // normal, the row shifted by its max and divided by it, softmax
  auto temps = torch::empty({rows, 1}, x.options());
  for (int64_t r = 0; r < rows; ++r)
    temps.data_ptr<float>()[r] = std::max(static_cast<float>(temperature[r]), std::numeric_limits<float>::min());
  auto probs = at::softmax((x - x.amax(-1, true)) / temps, -1);
  std::vector<float> tau(rows, 0.f);
  bool truncates = false;
  for (int64_t r = 0; r < rows; ++r)
    truncates |= (top_k[r] > 0 && top_k[r] < vocab) || top_p[r] < 1.0 || min_p[r] > 0.0;
  const float* pp = probs.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, 32768 / vocab);  // rows a thread takes at least: a row is O(V) work
  if (truncates) {
    at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const int64_t k = top_k[r] > 0 && top_k[r] < vocab ? top_k[r] : 0;
        if (k > 0 || top_p[r] < 1.0 || min_p[r] > 0.0)
          tau[r] = row_threshold(pp + r * vocab, vocab, k, top_p[r], min_p[r]);
      }
    });
    probs.masked_fill_(probs < torch::from_blob(tau.data(), {rows, 1}, probs.options()), 0.0);
    probs.div_(probs.sum(-1, true));
  }
  std::vector<char> bad(rows, 0);
  for (const int64_t r : failed) bad[r] = 1;
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    static thread_local std::vector<double> ends;
    for (int64_t r = begin; r < end; ++r) {
      if (bad[r]) continue;
      tokens[r] = greedy[r] ? row_argmax(xp + r * vocab, vocab) : row_draw(pp + r * vocab, vocab, u[r], ends);
    }
  });
  return {tokens, failed};
}

// The greedy token of each row of logits [S, V] fp32 (penalties already applied) and the rows whose logits are not
// all finite, in one pass a row: torch.argmax's first index of the largest value, token 0 for a row that is not
// finite (sampler.py's torch path zeroes such a row before its argmax). The rows of a greedy batch without a
// Python call per operation (six torch calls on the torch path).
std::tuple<std::vector<int64_t>, std::vector<int64_t>> greedy_rows(const torch::Tensor& logits) {
  TORCH_CHECK(logits.is_cpu() && logits.dim() == 2 && logits.scalar_type() == at::kFloat,
              "greedy_rows: logits must be a CPU fp32 [S, V] tensor");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  TORCH_CHECK(vocab > 0, "greedy_rows: the vocabulary is empty");
  const auto x = logits.contiguous();
  const float* xp = x.data_ptr<float>();
  std::vector<int64_t> tokens(rows, 0);
  std::vector<char> bad(rows, 0);
  at::parallel_for(0, rows, std::max<int64_t>(1, 32768 / vocab), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = xp + r * vocab;
      if (row_finite(row, vocab))
        tokens[r] = row_argmax(row, vocab);
      else
        bad[r] = 1;
    }
  });
  std::vector<int64_t> failed;
  for (int64_t r = 0; r < rows; ++r)
    if (bad[r]) failed.push_back(r);
  return {tokens, failed};
}

}  // namespace

// Its entries in the library's Python module (module.cpp); the GIL is released while they run.
void register_sampling(pybind11::module_& m) {
  m.def("truncation_thresholds", &truncation_thresholds, "each row's smallest kept probability (top-k, top-p, min-p)",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("sample_rows", &sample_rows, "one token per row: probabilities, truncation and the inverse-CDF draw",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("greedy_rows", &greedy_rows, "each row's argmax, and the rows that are not all finite",
        pybind11::call_guard<pybind11::gil_scoped_release>());
}
