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
// `truncation_thresholds` splits rows over torch's intra-op threads; `sample_rows` (a decode step's few rows) runs
// on the calling thread, apart from the ATen operations it calls.
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

// The largest value t among the row's positive values >= floor at which the running weight, summed in descending
// order (weight 1 per value, or the value itself), first reaches the target: `target` itself when counting, `target`
// times the weight of all those values when `by_mass`. A radix select over the values' bits (positive floats order
// as their bit patterns), three levels of 11, 11 and 10 bits with a histogram each: the first two read the row, the
// last only the values the second kept (those sharing the chosen prefix). When rounding keeps the target from being
// reached, the smallest such value.
float radix_select(const float* p, int64_t vocab, float floor, bool by_mass, double target) {
  constexpr int kShifts[3] = {21, 10, 0}, kWidths[3] = {11, 11, 10};
  std::array<double, 2048> hist;
  std::vector<float> candidates;  // level 1's values that share the prefix chosen at level 0
  uint32_t prefix = 0, known = 0;  // the digits chosen so far, and which bits they fill
  double above = 0.0;              // weight of the values larger than every value that has the prefix
  for (int level = 0; level < 3; ++level) {
    const int shift = kShifts[level];
    const uint32_t digits = (1u << kWidths[level]) - 1;
    hist.fill(0.0);
    const auto add = [&](float v, uint32_t key) { hist[(key >> shift) & digits] += by_mass ? static_cast<double>(v) : 1.0; };
    if (level < 2) {
      for (int64_t i = 0; i < vocab; ++i) {
        const float v = p[i];
        if (!(v > 0.f && v >= floor)) continue;
        uint32_t key;
        std::memcpy(&key, &v, 4);
        if ((key & known) != prefix) continue;
        if (level == 1) candidates.push_back(v);
        add(v, key);
      }
    } else {
      for (const float v : candidates) {
        uint32_t key;
        std::memcpy(&key, &v, 4);
        if ((key & known) == prefix) add(v, key);
      }
    }
    if (level == 0 && by_mass) {
      double total = 0.0;
      for (const double h : hist) total += h;
      target *= total;
    }
    int64_t chosen = -1, lowest = -1;
    for (int64_t d = digits; d >= 0; --d) {
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

float row_threshold(const float* p, int64_t vocab, int64_t top_k, double top_p, double min_p) {
  float tau = 0.f;
  if (top_k > 0 && top_k < vocab) tau = radix_select(p, vocab, 0.f, false, static_cast<double>(top_k));
  if (top_p < 1.0) tau = std::max(tau, radix_select(p, vocab, tau, true, top_p));  // of the mass top-k keeps
  // min_p rounded to fp32, then an fp32 product: the sorted rule's arithmetic, so both keep the same boundary token
  if (min_p > 0.0) tau = std::max(tau, static_cast<float>(min_p) * *std::max_element(p, p + vocab));
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
// the same weights and u. `cdf` is scratch of `vocab` doubles.
int64_t row_draw(const float* w, int64_t vocab, double u, double* cdf) {
  double running = 0.0;
  for (int64_t i = 0; i < vocab; ++i) cdf[i] = running += static_cast<double>(w[i]);
  const double point = (1.0 - u) * running;
  return std::min<int64_t>(std::lower_bound(cdf, cdf + vocab, point) - cdf, vocab - 1);
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
  const float* pp = probs.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t k = top_k[r] > 0 && top_k[r] < vocab ? top_k[r] : 0;
    if (k == 0 && top_p[r] >= 1.0 && min_p[r] <= 0.0) continue;
    truncates = true;
    tau[r] = row_threshold(pp + r * vocab, vocab, k, top_p[r], min_p[r]);
  }
  if (truncates) {
    probs.masked_fill_(probs < torch::from_blob(tau.data(), {rows, 1}, probs.options()), 0.0);
    probs.div_(probs.sum(-1, true));
  }
  std::vector<double> cdf(vocab);
  for (int64_t r = 0, f = 0; r < rows; ++r) {
    if (f < static_cast<int64_t>(failed.size()) && failed[f] == r) {
      ++f;
      continue;
    }
    tokens[r] = greedy[r] ? row_argmax(xp + r * vocab, vocab) : row_draw(pp + r * vocab, vocab, u[r], cdf.data());
  }
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
