// Truncation thresholds for sampling (top-k, top-p, min-p) without sorting the vocabulary.
//
// For each row of probabilities p [S, V] (fp32, non-negative; a row need not sum to 1), the smallest probability
// tau that the row keeps: the kept tokens are those with p >= tau, ties at the boundary all kept.
//   - top-k (0 < k < V): the k-th largest value;
//   - top-p (< 1), over the tokens top-k keeps, with Z their mass: the value at the first place, in descending
//     order, where the running mass reaches top_p * Z (the smallest set whose mass reaches top_p);
//   - min-p (> 0): min_p times the largest value;
//   tau is the largest of these (0 when none applies). inference_svc/engine/sampler.py's `_thresholds_torch` is the
//   same rule with a sort; the tests hold this kernel to it.
// Selection instead of a sort: top-k and top-p are each a radix select over the values' bits (three histogram
// passes over the row, counts for top-k and masses for top-p, in double). torch's CPU sort of one row of 8,192 logits took about 0.5 ms (2026-12-02), most of a sampled decode
// step's sampling time. Rows are independent and split over torch's intra-op threads.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>

namespace {

// The largest value t among the row's positive values >= floor at which the running weight, summed in descending
// order (weight 1 per value, or the value itself), first reaches `target`: a radix select over the values' bits
// (positive floats order as their bit patterns), three passes of 11, 11 and 10 bits with a histogram each. When
// rounding keeps the target from being reached, the smallest such value.
float radix_select(const float* p, int64_t vocab, float floor, bool by_mass, double target) {
  constexpr int kShifts[3] = {21, 10, 0}, kWidths[3] = {11, 11, 10};
  std::array<double, 2048> hist;
  uint32_t prefix = 0, known = 0;  // the digits chosen so far, and which bits they fill
  double above = 0.0;              // weight of the values larger than every value that has the prefix
  for (int level = 0; level < 3; ++level) {
    const int shift = kShifts[level];
    const uint32_t digits = (1u << kWidths[level]) - 1;
    hist.fill(0.0);
    for (int64_t i = 0; i < vocab; ++i) {
      const float v = p[i];
      if (!(v > 0.f && v >= floor)) continue;
      uint32_t key;
      std::memcpy(&key, &v, 4);
      if ((key & known) != prefix) continue;
      hist[(key >> shift) & digits] += by_mass ? static_cast<double>(v) : 1.0;
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
  if (top_p < 1.0) {
    double mass = 0.0;  // of what top-k keeps
    for (int64_t i = 0; i < vocab; ++i)
      if (p[i] > 0.f && p[i] >= tau) mass += p[i];
    tau = std::max(tau, radix_select(p, vocab, tau, true, top_p * mass));
  }
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

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("truncation_thresholds", &truncation_thresholds, "each row's smallest kept probability (top-k, top-p, min-p)",
        pybind11::call_guard<pybind11::gil_scoped_release>());
}
