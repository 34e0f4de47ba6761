// A few activation rows times a weight, fp32 or bf16: y[m, n] = sum_k x[m, k] * w[n, k], summed in fp32 and rounded
// once to the dtype. The compiled step's decode rows and verify rows (shared_model/fuse.py).
//
// Each output's arithmetic is the same whatever the number of rows M: two fp32 accumulators (columns c..c+15 and
// c+16..c+31 of every 32), fused multiply-adds in column order, one final reduction. So a row's output is bitwise
// the same alone (a batch-1 decode step) as among others (a verify step's K + 1 rows, a batch of decodes): a
// speculative step scores its drafts exactly as plain decoding would.
//
// `tile_gemm` is the same product for bf16 on AMX-BF16 tiles (where the CPU has them and Linux lets this process use
// them: `tile_gemm_ready`): 16 weight rows x 32 columns are one tile, up to 64 activation rows four more, and the
// products accumulate in fp32 tiles, 32 columns per instruction in the hardware's fixed order. Each output again comes
// from its own weight row and activation row alone, in the same order at any M, so a row's bits do not depend on the
// row count here either (they differ from row_gemm's: another summation order). The weight is read once for all the
// rows, so up to 16 rows cost about what one costs; one or two rows stream the weight faster through row_gemm.
// `tile_gemm_int8` runs the same tiles over an int8 weight with one scale per row (shared_model/quantize.py's int8):
// each 16 x 32 block of codes is widened to bf16 (exactly) in L1 on its way into the tile, and each sum is scaled
// once, so the weight streams from memory at one byte a parameter. The tiles themselves are tiles.h's.
// Memory: four weight rows per pass (eight for a single fp32 activation row: `run`). The first pair of activation
// rows streams them from memory while the next pass's rows are prefetched into L2 (without it the loop waited on
// memory: benchmarks/gemv_probe.py, docs/benchmarks-archive.md §7); later pairs find them in L1/L2. bf16 widens to
// fp32 exactly by a 16-bit shift (no AVX512_BF16 needed). Passes are split over torch's intra-op threads, a thread done
// with its share taking passes from the back of a slower one's (balanced.h).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "balanced.h"
#include "kernels.h"
#include "tiles.h"

namespace {

using namespace tandem_tiles;

constexpr int64_t kRows = 4;        // weight rows per pass
// weight rows per pass for one activation row: fp32 eight (16 lines in flight each column step against 8), bf16 four
// (eight showed no gain: docs/benchmarks.md §45)
template <typename T>
constexpr int64_t kSingleRows = sizeof(T) == 4 ? 8 : 4;
constexpr int kPair = 2;      // activation rows sharing each load of the weight

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {  // bf16 bits -> fp32, exact
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
inline void store(float* y, float v) { *y = v; }
inline void store(uint16_t* y, float v) { *reinterpret_cast<at::BFloat16*>(y) = at::BFloat16(v); }

// MR activation rows (x, x + k, ...) times R weight rows over all k columns; out[m * ldy + i] for i < rows.
template <typename T, int MR, int64_t R>
inline void dot_rows(const T* x, const T* const row[R], int64_t k, int64_t rows, const T* next, T* y, int64_t ldy) {
  __m512 a[MR][R], b[MR][R];
  for (int m = 0; m < MR; ++m)
    for (int64_t i = 0; i < R; ++i) a[m][i] = b[m][i] = _mm512_setzero_ps();
  constexpr int64_t kLines = 32 * sizeof(T) / 64;  // cache lines of one row's 32 columns
  // The next rows go to L2, in both dtypes: fp32's eight lines a step into L1 evicted lines the pass has still to
  // read (docs/benchmarks.md §38), and an AMD Zen 4 streamed bf16 at two thirds of its bandwidth with an L1 hint (§43)
  constexpr auto kHint = _MM_HINT_T1;
  for (int64_t c = 0; c < k; c += 32) {
    __m512 x0[MR], x1[MR];
    for (int m = 0; m < MR; ++m) x0[m] = load16(x + m * k + c), x1[m] = load16(x + m * k + c + 16);
    if (next != nullptr)  // a prefetch past the end never faults
      for (int64_t i = 0; i < R; ++i)
        for (int64_t l = 0; l < kLines; ++l)
          _mm_prefetch(reinterpret_cast<const char*>(next + i * k + c) + 64 * l, kHint);
    for (int64_t i = 0; i < R; ++i) {
      const __m512 w0 = load16(row[i] + c), w1 = load16(row[i] + c + 16);
      for (int m = 0; m < MR; ++m) {
        a[m][i] = _mm512_fmadd_ps(w0, x0[m], a[m][i]);
        b[m][i] = _mm512_fmadd_ps(w1, x1[m], b[m][i]);
      }
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int64_t i = 0; i < rows; ++i) store(y + m * ldy + i, _mm512_reduce_add_ps(_mm512_add_ps(a[m][i], b[m][i])));
}

// Weight rows [first, n) of y = x w^T by fused multiply-adds, R weight rows a pass.
template <typename T, int64_t R>
void run_passes(const T* xp, const T* wp, T* yp, int64_t m, int64_t n, int64_t k, int64_t first) {
  tandem_balanced::balanced_passes((n - first + R - 1) / R, 16 * kRows / R, [&](int64_t pass, bool forward) {
    const int64_t r0 = first + pass * R, rows = std::min(R, n - r0);
    const T* row[R];
    for (int64_t i = 0; i < R; ++i) row[i] = wp + (r0 + std::min(i, rows - 1)) * k;  // past the end: unused
    // the pass this thread reads next: the following one, or, taking passes from the back of another's share,
    // the one before
    const T* next = wp + (forward ? std::min(r0 + R, n - 1) : std::max(r0 - R, first)) * k;
    int64_t i = 0;
    for (; i + kPair <= m; i += kPair)
      dot_rows<T, kPair, R>(xp + i * k, row, k, rows, i == 0 ? next : nullptr, yp + i * n + r0, n);
    if (i < m) dot_rows<T, 1, R>(xp + i * k, row, k, rows, i == 0 ? next : nullptr, yp + i * n + r0, n);
  });
}

// Weight rows [first, n) of y = x w^T. One fp32 activation row takes eight weight rows a pass (kSingleRows): twice
// the cache lines in flight each column step, and its 16 sums still fit the registers (a pair of activation rows
// over eight weight rows would need all 32 for sums alone). Each output's arithmetic is the same either way.
template <typename T>
void run(const T* xp, const T* wp, T* yp, int64_t m, int64_t n, int64_t k, int64_t first = 0) {
  if (m == 1)
    run_passes<T, kSingleRows<T>>(xp, wp, yp, m, n, k, first);
  else
    run_passes<T, kRows>(xp, wp, yp, m, n, k, first);
}


void check_operands(const char* op, const torch::Tensor& x, const torch::Tensor& w) {
  TORCH_CHECK(x.is_cpu() && w.is_cpu(), op, ": CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && w.is_contiguous(), op, ": x must be [M, K], w contiguous [N, K]");
  TORCH_CHECK(x.size(1) == w.size(1) && w.size(1) % 32 == 0, op,
              ": shapes do not match (K must be a multiple of 32)");
}

uint16_t* bits(const torch::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>()); }

// x [M, K], w [N, K] contiguous, both fp32 or both bf16 (K a multiple of 32) -> [M, N] of the same dtype
torch::Tensor row_gemm(const torch::Tensor& x, const torch::Tensor& w) {
  check_operands("row_gemm", x, w);
  TORCH_CHECK(x.scalar_type() == w.scalar_type() &&
                  (w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16),
              "row_gemm: x and w must both be fp32 or both bf16");
  const int64_t m = x.size(0), n = w.size(0), k = w.size(1);
  const auto xc = x.contiguous();
  auto y = torch::empty({m, n}, x.options());
  if (m == 0 || n == 0) return y;
  if (w.scalar_type() == at::kFloat) {
    run<float>(xc.data_ptr<float>(), w.data_ptr<float>(), y.data_ptr<float>(), m, n, k);
  } else {
    run<uint16_t>(bits(xc), bits(w), bits(y), m, n, k);
  }
  return y;
}

// The same product on AMX tiles: x [M, K], w [N, K] contiguous bf16 (K a multiple of 32) -> [M, N] bf16. Weight rows
// past the last whole tile of 16 take the FMA path (per weight row, so still the same bits at any M).
torch::Tensor tile_gemm(const torch::Tensor& x, const torch::Tensor& w) {
  check_operands("tile_gemm", x, w);
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16,
              "tile_gemm: x and w must both be bf16");
  TORCH_CHECK(amx_bf16_ready(), "tile_gemm: this process cannot use AMX-BF16 tiles (see row_gemm_tiles())");
  const int64_t m = x.size(0), n = w.size(0), k = w.size(1);
  const auto xc = x.contiguous();
  auto y = torch::empty({m, n}, x.options());
  if (m == 0 || n == 0) return y;
  tandem_kernels::tile_gemm_rows(bits(xc), bits(w), bits(y), m, n, k);
  return y;
}

// oneDNN's matmul through torch's own registration of it (mkldnn::_linear_pointwise, the op inductor's CPU fusions
// call): y [M, N] = x [M, K] w [N, K]^T, the weight read in its plain layout. Its fp32 blocking beats MKL's sgemm
// (F.linear's fp32 product) where MKL takes its generic path, as on AMD's CPUs (serving_model.py's rule).
torch::Tensor onednn_linear(const torch::Tensor& x, const torch::Tensor& w) {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack{x, w, c10::IValue(), c10::IValue(std::string("none")),
                          c10::IValue(c10::List<std::optional<at::Scalar>>()), c10::IValue(std::string(""))};
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

// The compiled step's projection (shared_model/serving_model.py's row table): the kernel chosen here, by the row
// count of the call, at run time: M <= row_max rows row_gemm, M <= tile_max the many-row bf16 kernel (none when
// tile_max <= row_max): tile_gemm where this process may use AMX tiles, else dot_gemm (dot_gemm.cpp, AVX512_BF16;
// the table names the same one, by the same facts), more at::mm(x, w^T) (F.linear's product without a bias), or
// oneDNN's matmul where `onednn` (the table's `more`). A graph that branched on M in Python traced one graph per
// branch; this call is one node for every M, each row's bits those of the kernel its row count picks, as before.
torch::Tensor table_gemm(const torch::Tensor& x, const torch::Tensor& w, int64_t row_max, int64_t tile_max,
                         bool onednn) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2, "table_gemm: x must be [M, K] and w [N, K]");
  const int64_t m = x.size(0);
  if (m <= row_max) return row_gemm(x, w);
  if (m <= tile_max) {
    if (amx_bf16_ready()) return tile_gemm(x, w);
    check_operands("table_gemm", x, w);
    TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16,
                "table_gemm: rows past row_max need bf16 x and w");
    const auto xc = x.contiguous();
    auto y = torch::empty({m, w.size(0)}, x.options());
    tandem_kernels::dot_gemm_rows(bits(xc), bits(w), bits(y), m, w.size(0), w.size(1));
    return y;
  }
  return onednn ? onednn_linear(x.contiguous(), w) : at::mm(x, w.t());
}

// x [M, K] bf16 times an int8 weight q [N, K] (one scale per row, `scales` [N] of any float dtype) on AMX tiles:
// y [M, N] bf16 = (x q^T) * scales, the int8 codes widened to bf16 exactly and the products summed in fp32, the row
// scale applied once to each sum (the same maths as torch's _weight_int8pack_mm). N a multiple of 16, K of 32.
torch::Tensor tile_gemm_int8(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scales) {
  check_operands("tile_gemm_int8", x, q);
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && q.scalar_type() == at::kChar,
              "tile_gemm_int8: x must be bf16 and q int8");
  TORCH_CHECK(scales.dim() == 1 && scales.size(0) == q.size(0), "tile_gemm_int8: scales must be [N]");
  TORCH_CHECK(q.size(0) % kTile == 0, "tile_gemm_int8: N must be a multiple of 16");
  TORCH_CHECK(amx_bf16_ready(), "tile_gemm_int8: this process cannot use AMX-BF16 tiles (see tile_gemm_ready())");
  const int64_t m = x.size(0), n = q.size(0), k = q.size(1);
  const auto xc = x.contiguous();
  const auto s32 = scales.to(at::kFloat).contiguous();
  auto y = torch::empty({m, n}, x.options());
  if (m == 0 || n == 0) return y;
  run_amx(bits(xc), StoredRows<int8_t>{q.data_ptr<int8_t>(), k}, s32.data_ptr<float>(), bits(y), m, n, k, n / kTile);
  return y;
}

}  // namespace

namespace tandem_kernels {

void row_gemm_rows(const float* x, const float* w, float* y, int64_t m, int64_t n, int64_t k) { run(x, w, y, m, n, k); }
void row_gemm_rows(const uint16_t* x, const uint16_t* w, uint16_t* y, int64_t m, int64_t n, int64_t k) {
  run(x, w, y, m, n, k);
}
void tile_gemm_rows(const uint16_t* x, const uint16_t* w, uint16_t* y, int64_t m, int64_t n, int64_t k) {
  TORCH_CHECK(amx_bf16_ready(), "tile_gemm: this process cannot use AMX-BF16 tiles (see row_gemm_tiles())");
  const int64_t n_tiles = n / kTile;
  if (n_tiles > 0) run_amx(x, StoredRows<uint16_t>{w, k}, nullptr, y, m, n, k, n_tiles);
  if (n_tiles * kTile < n) run<uint16_t>(x, w, y, m, n, k, n_tiles * kTile);
}

}  // namespace tandem_kernels

// A fragment of the `tandem` op library (every file adds its own); its fake kernel is registered from Python
// (tandem_native/loader.py).
TORCH_LIBRARY_FRAGMENT(tandem, m) {
  m.def("row_gemm(Tensor x, Tensor w) -> Tensor");
  m.def("tile_gemm(Tensor x, Tensor w) -> Tensor");
  m.def("tile_gemm_int8(Tensor x, Tensor q, Tensor scales) -> Tensor");
  m.def("table_gemm(Tensor x, Tensor w, int row_max, int tile_max, bool onednn=False) -> Tensor");
}
TORCH_LIBRARY_IMPL(tandem, CPU, m) {
  m.impl("row_gemm", &row_gemm);
  m.impl("tile_gemm", &tile_gemm);
  m.impl("tile_gemm_int8", &tile_gemm_int8);
  m.impl("table_gemm", &table_gemm);
}

void register_row_gemm(pybind11::module_& m) {
  m.def("tile_gemm_ready", &amx_bf16_ready,
        "Whether tile_gemm runs in this process (the CPU has AMX-BF16 and Linux granted the use of its tiles)");
}
