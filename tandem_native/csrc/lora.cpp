// The LoRA delta of a served step's adapter rows in one call (inference_svc/lora/slots.py's fused path): every row
// adds its own adapter's low-rank product to the base projection's output, in place.
//
// Operator `tandem::lora_delta_(y, x, a, bt, row_slots, widths)`:
//   y         [..., out] contiguous, written in place: the base projection's output, T rows of `out`
//   x         [..., in], T rows of `in`: the projection's input
//   a         [S, W, in] contiguous: each slot's A, its first widths[s] rows used
//   bt        [S, W, out] contiguous: each slot's B^T with the LoRA scale folded in (block-diagonal for a merged
//             projection: part p's rows write only part p's columns; the kernel does not need to know)
//   row_slots int32 [T]: each row's slot, -1 for a base row
//   widths    int32 [S]: the rows of a[s] / bt[s] slot s uses (0: the slot does not adapt this projection)
// y, x, a and bt share one dtype: fp32, bf16 or fp16. For a row t of slot s with w = widths[s] > 0:
//   h[j] = sum_k a[s, j, k] x[t, k]                          (j < w, fp32 accumulation, h kept in fp32)
//   y[t, c] = round(y[t, c] + sum_j h[j] bt[s, j, c])       (fp32 accumulation, rounded once to y's dtype)
// A base row (-1) or a row of a width-0 slot is not written at all: its bits stay the base projection's. A slot
// outside [-1, S), a width outside [0, W], or operands of the wrong shape, dtype, device or layout raise an error
// naming the operand.
//
// Batch invariance: a row's arithmetic is fixed by its own x, slot and width alone (one fp32 accumulator per h[j]
// over 16-lane chunks of `in` in order, then one fixed reduction; one fp32 sum per output column over j in order,
// then the add to y), never by the other rows of the call, how rows are grouped, or how they are split over
// threads. So a mixed batch gives each request the bits it gets alone.
//
// Layout of the work: rows are grouped by slot (a counting sort, rows in order within a slot) into blocks of up to
// four rows of one slot, so each block reads its adapter's A and B^T once for all its rows. Both are read row after
// row, four rows side by side while the next four are prefetched, so they stream from memory in order: in a served step the adapters' weights are not
// in cache (the base weights pass through it between two layers), and a first, column-blocked walk down B^T's rows
// cost a served step as much as torch's small matmuls did (docs/benchmarks.md §25). The sums of a block's rows live in an fp32 buffer (R x out)
// that stays in L1/L2. Blocks are split over torch's intra-op threads only when the call's multiply-adds pay for
// waking them (`kParallelWork`); a decode step's few rows run on the calling thread.
//
// ISA: like every file of the library this one is built with AVX-512 (F/BW/VL) flags, and the loader only loads the
// library on CPUs that have them; without those flags (`__AVX512F__`/`__AVX512BW__` undefined) the same kernel
// compiles over a portable 16-lane array type that the compiler vectorizes as it can (same algorithm, its own
// bits, still batch invariant).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define TANDEM_LORA_AVX512 1
#else
#define TANDEM_LORA_AVX512 0
#endif

namespace {

constexpr int64_t kLanes = 16;
constexpr int64_t kMaxBlockRows = 4;        // rows of one slot sharing each read of its A and B^T
constexpr int64_t kParallelWork = 1 << 20;  // multiply-adds per thread below which threads are not woken

using bits16 = uint16_t;  // bf16 and fp16 are read and written as their bits

// ------------------------------------------------------------------ 16 fp32 lanes
#if TANDEM_LORA_AVX512

struct Vec {
  __m512 v;
};
inline __mmask16 lanes(int64_t n) {  // the first n lanes (none for n <= 0)
  return n >= kLanes ? __mmask16(0xFFFF) : n <= 0 ? __mmask16(0) : __mmask16((1u << n) - 1);
}
inline Vec zero() { return {_mm512_setzero_ps()}; }
inline Vec broadcast(float s) { return {_mm512_set1_ps(s)}; }
inline Vec fma(Vec a, Vec b, Vec c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }  // a * b + c
inline Vec add(Vec a, Vec b) { return {_mm512_add_ps(a.v, b.v)}; }
inline float reduce(Vec a) { return _mm512_reduce_add_ps(a.v); }

// the first n elements of 16 from p (the rest zero; nothing read or written past p + n, nothing at all for n <= 0)
inline Vec load_f32(const float* p, int64_t n) { return {_mm512_maskz_loadu_ps(lanes(n), p)}; }
inline __m256i load_bits(const bits16* p, int64_t n) { return _mm256_maskz_loadu_epi16(lanes(n), p); }
inline Vec load_bf16(const bits16* p, int64_t n) {  // exact: bf16 is fp32's high half
  return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(load_bits(p, n)), 16))};
}
inline Vec load_fp16(const bits16* p, int64_t n) { return {_mm512_cvtph_ps(load_bits(p, n))}; }

inline void store_f32(float* p, Vec a, int64_t n) { _mm512_mask_storeu_ps(p, lanes(n), a.v); }
inline void store_bf16(bits16* p, Vec a, int64_t n) {  // to nearest even, NaN to 0x7FC0 (as c10::BFloat16)
  const __m512i b = _mm512_castps_si512(a.v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(b, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
  r = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(a.v, a.v, _CMP_UNORD_Q), r, _mm512_set1_epi32(0x7FC0));
  _mm256_mask_storeu_epi16(p, lanes(n), _mm512_cvtepi32_epi16(r));
}
inline void store_fp16(bits16* p, Vec a, int64_t n) {
  _mm256_mask_storeu_epi16(p, lanes(n), _mm512_cvtps_ph(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

#else  // portable lanes

struct Vec {
  float v[kLanes];
};
inline Vec zero() { return Vec{}; }
inline Vec broadcast(float s) {
  Vec r;
  for (int64_t i = 0; i < kLanes; ++i) r.v[i] = s;
  return r;
}
inline Vec fma(Vec a, Vec b, Vec c) {  // one rounding where the CPU fuses, two where it cannot: fixed per build
  Vec r;
  for (int64_t i = 0; i < kLanes; ++i)
#ifdef FP_FAST_FMAF
    r.v[i] = std::fmaf(a.v[i], b.v[i], c.v[i]);
#else
    r.v[i] = a.v[i] * b.v[i] + c.v[i];
#endif
  return r;
}
inline Vec add(Vec a, Vec b) {
  Vec r;
  for (int64_t i = 0; i < kLanes; ++i) r.v[i] = a.v[i] + b.v[i];
  return r;
}
inline float reduce(Vec a) {  // a fixed pairwise tree
  for (int64_t half = kLanes / 2; half > 0; half /= 2)
    for (int64_t i = 0; i < half; ++i) a.v[i] += a.v[i + half];
  return a.v[0];
}
inline Vec load_f32(const float* p, int64_t n) {
  Vec r{};
  for (int64_t i = 0; i < std::min(n, kLanes); ++i) r.v[i] = p[i];
  return r;
}
inline Vec load_bf16(const bits16* p, int64_t n) {
  Vec r{};
  for (int64_t i = 0; i < std::min(n, kLanes); ++i) r.v[i] = float(c10::BFloat16(p[i], c10::BFloat16::from_bits()));
  return r;
}
inline Vec load_fp16(const bits16* p, int64_t n) {
  Vec r{};
  for (int64_t i = 0; i < std::min(n, kLanes); ++i) r.v[i] = float(c10::Half(p[i], c10::Half::from_bits()));
  return r;
}
inline void store_f32(float* p, Vec a, int64_t n) {
  for (int64_t i = 0; i < std::min(n, kLanes); ++i) p[i] = a.v[i];
}
inline void store_bf16(bits16* p, Vec a, int64_t n) {
  for (int64_t i = 0; i < std::min(n, kLanes); ++i) p[i] = c10::BFloat16(a.v[i]).x;
}
inline void store_fp16(bits16* p, Vec a, int64_t n) {
  for (int64_t i = 0; i < std::min(n, kLanes); ++i) p[i] = c10::Half(a.v[i]).x;
}

#endif

// Element types: how a row of T is read into and written from fp32 lanes.
struct F32 {
  using T = float;
  static Vec load(const T* p, int64_t n) { return load_f32(p, n); }
  static void store(T* p, Vec a, int64_t n) { store_f32(p, a, n); }
};
struct BF16 {
  using T = bits16;
  static Vec load(const T* p, int64_t n) { return load_bf16(p, n); }
  static void store(T* p, Vec a, int64_t n) { store_bf16(p, a, n); }
};
struct F16 {
  using T = bits16;
  static Vec load(const T* p, int64_t n) { return load_fp16(p, n); }
  static void store(T* p, Vec a, int64_t n) { store_fp16(p, a, n); }
};

// h[r * w + j] = a[j] . x[r] for J rows of a starting at j0, R activation rows: one accumulator per (r, j), over
// `in` in 16-lane chunks in order, then one reduction (the same arithmetic for a row whatever R and J are).
template <typename E, int R, int J>
inline void project(const typename E::T* const x[R], const typename E::T* a, int64_t in, int64_t w, int64_t j0,
                    float* h) {
  Vec acc[R][J];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < J; ++j) acc[r][j] = zero();
  const int64_t ahead = std::min<int64_t>(J, w - j0 - J);  // the next pass's rows, fetched while this one runs
  for (int64_t k = 0; k < in; k += kLanes) {
    const int64_t n = in - k;
    for (int64_t j = 0; j < ahead; ++j) __builtin_prefetch(a + (j0 + J + j) * in + k, 0, 3);
    Vec xv[R];
    for (int r = 0; r < R; ++r) xv[r] = E::load(x[r] + k, n);
    for (int j = 0; j < J; ++j) {
      const Vec av = E::load(a + (j0 + j) * in + k, n);
      for (int r = 0; r < R; ++r) acc[r][j] = fma(av, xv[r], acc[r][j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < J; ++j) h[r * w + j0 + j] = reduce(acc[r][j]);
}

// acc[r] += h[r][j0 + i] bt[j0 + i] for i < J, over all `out` columns, for R rows: each row of bt is read in
// order, J rows side by side (the adapter's weights stream from memory as the base's do), and each column's fp32
// sum is loaded, gets its J products in j order, and is stored (the same arithmetic whatever R and J are).
template <typename E, int R, int J>
inline void expand(const float* h, const typename E::T* bt, int64_t out, int64_t w, int64_t j0, float* acc) {
  Vec hv[R][J];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < J; ++j) hv[r][j] = broadcast(h[r * w + j0 + j]);
  const int64_t ahead = std::min<int64_t>(J, w - j0 - J);  // the next pass's rows, fetched while this one runs
  for (int64_t c = 0; c < out; c += kLanes) {
    const int64_t n = out - c;
    for (int64_t j = 0; j < ahead; ++j) __builtin_prefetch(bt + (j0 + J + j) * out + c, 0, 3);
    Vec b[J];
    for (int j = 0; j < J; ++j) b[j] = E::load(bt + (j0 + j) * out + c, n);
    for (int r = 0; r < R; ++r) {
      Vec a = load_f32(acc + r * out + c, n);
      for (int j = 0; j < J; ++j) a = fma(hv[r][j], b[j], a);
      store_f32(acc + r * out + c, a, n);
    }
  }
}

// One block: R rows of one slot (its A [w, in] and B^T [w, out]); h: room for R * w floats, acc for R * out.
// y[r] = round(y[r] + sum_j h[r][j] bt[j]): the sum over j in order from +0, in fp32, then added to y once.
template <typename E, int R>
void block(const typename E::T* const x[R], typename E::T* const y[R], const typename E::T* a,
           const typename E::T* bt, int64_t in, int64_t out, int64_t w, float* h, float* acc) {
  int64_t j = 0;
  for (; j + 4 <= w; j += 4) project<E, R, 4>(x, a, in, w, j, h);
  for (; j < w; ++j) project<E, R, 1>(x, a, in, w, j, h);
  std::fill(acc, acc + R * out, 0.0f);
  for (j = 0; j + 4 <= w; j += 4) expand<E, R, 4>(h, bt, out, w, j, acc);
  for (; j < w; ++j) expand<E, R, 1>(h, bt, out, w, j, acc);
  for (int r = 0; r < R; ++r)
    for (int64_t c = 0; c < out; c += kLanes) {
      const int64_t n = out - c;
      E::store(y[r] + c, add(E::load(y[r] + c, n), load_f32(acc + r * out + c, n)), n);
    }
}

struct Block {
  int64_t first;  // into `order`
  int64_t rows;   // 1..kMaxBlockRows
  int64_t slot;
};

template <typename E>
void run(const torch::Tensor& y, const torch::Tensor& x, const torch::Tensor& a, const torch::Tensor& bt,
         const std::vector<int64_t>& order, const std::vector<Block>& blocks, const int32_t* widths, int64_t work) {
  using T = typename E::T;
  const int64_t in = a.size(2), out = bt.size(2), width = a.size(1);
  const T* xp = reinterpret_cast<const T*>(x.data_ptr());
  const T* ap = reinterpret_cast<const T*>(a.data_ptr());
  const T* btp = reinterpret_cast<const T*>(bt.data_ptr());
  T* yp = reinterpret_cast<T*>(y.data_ptr());
  const auto body = [&](int64_t begin, int64_t end) {
    std::vector<float> h(kMaxBlockRows * width), acc(kMaxBlockRows * out);
    for (int64_t b = begin; b < end; ++b) {
      const Block& blk = blocks[b];
      const int64_t w = widths[blk.slot];
      const T* xs[kMaxBlockRows];
      T* ys[kMaxBlockRows];
      for (int64_t r = 0; r < blk.rows; ++r) {
        const int64_t row = order[blk.first + r];
        xs[r] = xp + row * in;
        ys[r] = yp + row * out;
      }
      const T* as = ap + blk.slot * width * in;
      const T* bts = btp + blk.slot * width * out;
      switch (blk.rows) {
        case 1: block<E, 1>(xs, ys, as, bts, in, out, w, h.data(), acc.data()); break;
        case 2: block<E, 2>(xs, ys, as, bts, in, out, w, h.data(), acc.data()); break;
        case 3: block<E, 3>(xs, ys, as, bts, in, out, w, h.data(), acc.data()); break;
        default: block<E, 4>(xs, ys, as, bts, in, out, w, h.data(), acc.data()); break;
      }
    }
  };
  const int64_t n = static_cast<int64_t>(blocks.size());
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), work / kParallelWork);
  if (threads <= 1 || n < 2) {
    body(0, n);
  } else {
    at::parallel_for(0, n, (n + threads - 1) / threads, body);  // rows never change arithmetic with the split
  }
}

void lora_delta_(torch::Tensor y, const torch::Tensor& x, const torch::Tensor& a, const torch::Tensor& bt,
                 const torch::Tensor& row_slots, const torch::Tensor& widths) {
  constexpr const char* op = "lora_delta_";
  TORCH_CHECK(y.is_cpu() && x.is_cpu() && a.is_cpu() && bt.is_cpu() && row_slots.is_cpu() && widths.is_cpu(), op,
              ": CPU tensors only");
  TORCH_CHECK(a.dim() == 3 && bt.dim() == 3, op, ": a must be [S, W, in] and bt [S, W, out], got a ", a.sizes(),
              " and bt ", bt.sizes());
  TORCH_CHECK(a.size(0) == bt.size(0) && a.size(1) == bt.size(1), op, ": a ", a.sizes(), " and bt ", bt.sizes(),
              " must have the same slots S and width W");
  TORCH_CHECK(a.is_contiguous() && bt.is_contiguous(), op, ": a and bt must be contiguous");
  const int64_t slots = a.size(0), width = a.size(1), in = a.size(2), out = bt.size(2);
  TORCH_CHECK(in > 0 && out > 0, op, ": in and out must be positive, got a ", a.sizes(), " and bt ", bt.sizes());
  TORCH_CHECK(y.dim() >= 1 && y.size(-1) == out, op, ": y must be [..., out] with out = ", out, " (bt's last size), got ",
              y.sizes());
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == in, op, ": x must be [..., in] with in = ", in, " (a's last size), got ",
              x.sizes());
  TORCH_CHECK(y.is_contiguous(), op, ": y must be contiguous (it is written in place)");
  const auto dtype = y.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf, op,
              ": y must be fp32, bf16 or fp16, got ", dtype);
  TORCH_CHECK(x.scalar_type() == dtype && a.scalar_type() == dtype && bt.scalar_type() == dtype, op,
              ": x, a and bt must have y's dtype ", dtype, ", got ", x.scalar_type(), ", ", a.scalar_type(), " and ",
              bt.scalar_type());
  const int64_t rows = y.numel() / out;
  TORCH_CHECK(x.numel() / in == rows, op, ": x ", x.sizes(), " and y ", y.sizes(), " must have the same rows");
  TORCH_CHECK(row_slots.dim() == 1 && row_slots.size(0) == rows && row_slots.scalar_type() == at::kInt, op,
              ": row_slots must be int32 [T] with T = ", rows, " (y's rows), got ", row_slots.scalar_type(), " ",
              row_slots.sizes());
  TORCH_CHECK(widths.dim() == 1 && widths.size(0) == slots && widths.scalar_type() == at::kInt, op,
              ": widths must be int32 [S] with S = ", slots, " (a's slots), got ", widths.scalar_type(), " ",
              widths.sizes());
  const auto rs = row_slots.contiguous();
  const auto ws = widths.contiguous();
  const int32_t* slot_of = rs.data_ptr<int32_t>();
  const int32_t* width_of = ws.data_ptr<int32_t>();
  for (int64_t s = 0; s < slots; ++s)
    TORCH_CHECK(width_of[s] >= 0 && width_of[s] <= width, op, ": widths[", s, "] = ", width_of[s],
                " is outside [0, ", width, "] (W = a.size(1))");

  // Rows grouped by slot (counting sort; rows in order within a slot), base rows and width-0 slots left out.
  std::vector<int64_t> start(slots + 1, 0);
  for (int64_t t = 0; t < rows; ++t) {
    const int32_t s = slot_of[t];
    TORCH_CHECK(s >= -1 && s < slots, op, ": row_slots[", t, "] = ", s, " is outside [-1, ", slots, ") (S slots)");
    if (s >= 0 && width_of[s] > 0) ++start[s + 1];
  }
  for (int64_t s = 0; s < slots; ++s) start[s + 1] += start[s];
  const int64_t adapted = start[slots];
  if (adapted == 0) return;
  std::vector<int64_t> order(adapted);
  {
    std::vector<int64_t> next(start.begin(), start.end() - 1);
    for (int64_t t = 0; t < rows; ++t) {
      const int32_t s = slot_of[t];
      if (s >= 0 && width_of[s] > 0) order[next[s]++] = t;
    }
  }
  std::vector<Block> blocks;
  int64_t work = 0;
  for (int64_t s = 0; s < slots; ++s) {
    for (int64_t i = start[s]; i < start[s + 1]; i += kMaxBlockRows)
      blocks.push_back({i, std::min(kMaxBlockRows, start[s + 1] - i), s});
    work += (start[s + 1] - start[s]) * width_of[s] * (in + out);
  }
  const auto xc = x.contiguous();
  switch (dtype) {
    case at::kFloat: run<F32>(y, xc, a, bt, order, blocks, width_of, work); break;
    case at::kBFloat16: run<BF16>(y, xc, a, bt, order, blocks, width_of, work); break;
    default: run<F16>(y, xc, a, bt, order, blocks, width_of, work); break;
  }
}

}  // namespace

// A fragment of the `tandem` op library; its fake kernel is registered from Python (tandem_native/loader.py).
TORCH_LIBRARY_FRAGMENT(tandem, m) {
  m.def("lora_delta_(Tensor(a!) y, Tensor x, Tensor a, Tensor bt, Tensor row_slots, Tensor widths) -> ()");
}
TORCH_LIBRARY_IMPL(tandem, CPU, m) { m.impl("lora_delta_", &lora_delta_); }

// Its entry in the library's Python module (module.cpp): the same function without the dispatcher, for the eager
// step's many small calls; the GIL is released while it runs.
void register_lora(pybind11::module_& m) {
  m.def("lora_delta_", &lora_delta_, "y += each adapter row's LoRA delta, in place (see lora.cpp)",
        pybind11::call_guard<pybind11::gil_scoped_release>());
}
