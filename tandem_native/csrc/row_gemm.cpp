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
// once, so the weight streams from memory at one byte a parameter.
// Memory: four weight rows per pass. The first pair of activation rows streams them from memory while the next
// pass's rows are prefetched (without it the loop waited on memory: 12 against 21 GB/s for bf16, one row of 3072 x 768
// weights on 2 threads, benchmarks/gemv_probe.py); later pairs find them in L1/L2. bf16 widens to fp32 exactly by a
// 16-bit shift (no AVX512_BF16 needed). Passes are split over torch's intra-op threads.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cpuid.h>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kRows = 4;  // weight rows per pass
constexpr int kPair = 2;      // activation rows sharing each load of the weight

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {  // bf16 bits -> fp32, exact
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
inline void store(float* y, float v) { *y = v; }
inline void store(uint16_t* y, float v) { *reinterpret_cast<at::BFloat16*>(y) = at::BFloat16(v); }

// MR activation rows (x, x + k, ...) times kRows weight rows over all k columns; out[m * ldy + i] for i < rows.
template <typename T, int MR>
inline void dot_rows(const T* x, const T* const row[kRows], int64_t k, int64_t rows, const T* next, T* y,
                     int64_t ldy) {
  __m512 a[MR][kRows], b[MR][kRows];
  for (int m = 0; m < MR; ++m)
    for (int64_t i = 0; i < kRows; ++i) a[m][i] = b[m][i] = _mm512_setzero_ps();
  constexpr int64_t kLines = 32 * sizeof(T) / 64;  // cache lines of one row's 32 columns
  for (int64_t c = 0; c < k; c += 32) {
    __m512 x0[MR], x1[MR];
    for (int m = 0; m < MR; ++m) x0[m] = load16(x + m * k + c), x1[m] = load16(x + m * k + c + 16);
    if (next != nullptr)  // a prefetch past the end never faults
      for (int64_t i = 0; i < kRows; ++i)
        for (int64_t l = 0; l < kLines; ++l)
          _mm_prefetch(reinterpret_cast<const char*>(next + i * k + c) + 64 * l, _MM_HINT_T0);
    for (int64_t i = 0; i < kRows; ++i) {
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

// Weight rows [first, n) of y = x w^T by fused multiply-adds.
template <typename T>
void run(const T* xp, const T* wp, T* yp, int64_t m, int64_t n, int64_t k, int64_t first = 0) {
  at::parallel_for(0, (n - first + kRows - 1) / kRows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t pass = begin; pass < end; ++pass) {
      const int64_t r0 = first + pass * kRows, rows = std::min(kRows, n - r0);
      const T* row[kRows];
      for (int64_t i = 0; i < kRows; ++i) row[i] = wp + (r0 + std::min(i, rows - 1)) * k;  // past the end: unused
      const T* next = wp + std::min(r0 + kRows, n - 1) * k;
      int64_t i = 0;
      for (; i + kPair <= m; i += kPair)
        dot_rows<T, kPair>(xp + i * k, row, k, rows, i == 0 ? next : nullptr, yp + i * n + r0, n);
      if (i < m) dot_rows<T, 1>(xp + i * k, row, k, rows, i == 0 ? next : nullptr, yp + i * n + r0, n);
    }
  });
}


// ------------------------------------------------------------------------------------------------- AMX-BF16 tiles
constexpr int64_t kTile = 16;      // weight rows of a tile, activation rows of a tile
constexpr int64_t kChunk = 32;     // bf16 columns of one tile row (64 bytes)
constexpr int64_t kMaxBlocks = 4;  // activation tiles per pass over the weight (accumulators 0..3)

// Whether this process may use AMX-BF16: the CPU has it (CPUID 7.0 EDX bits 22 and 24; and AVX512_BF16), the OS saves its state
// (XCR0 bits 17 and 18) and Linux granted the tile data permission (arch_prctl ARCH_REQ_XCOMP_PERM).
bool amx_bf16_ready() {
  static const bool ready = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 22)) || !(d & (1u << 24))) return false;
    if (!__get_cpuid_count(7, 1, &a, &b, &c, &d) || !(a & (1u << 5))) return false;  // AVX512_BF16 (the stores)
    if (!__get_cpuid_count(1, 0, &a, &b, &c, &d) || !(c & (1u << 27))) return false;  // OSXSAVE
    unsigned lo = 0, hi = 0;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    if ((lo & (3u << 17)) != (3u << 17)) return false;
    constexpr long kReqPerm = 0x1023, kTileData = 18;
    return syscall(SYS_arch_prctl, kReqPerm, kTileData) == 0;
  }();
  return ready;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-3: fp32 accumulators [16 weight rows, 16 activation rows]; 4: weight rows [16, 32 bf16];
// 5: activation columns in pairs [16 column pairs, 16 rows x 2 bf16].
__attribute__((target("amx-tile,amx-bf16"))) void configure_tiles() {
  TileConfig cfg;
  for (int t = 0; t < 6; ++t) cfg.rows[t] = kTile, cfg.colsb[t] = 64;
  _tile_loadconfig(&cfg);
}

// 16 int8 weight rows x 32 columns (row stride k bytes) -> bf16 [16, 32] in `out` (exact: every int8 is a bf16).
__attribute__((target("avx512f,avx512bw"))) inline void widen_int8(const int8_t* w, int64_t k, uint16_t* out) {
  for (int64_t i = 0; i < kTile; ++i) {
    const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + i * k));
    for (int h = 0; h < 2; ++h) {
      const __m128i half = h == 0 ? _mm256_castsi256_si128(bytes) : _mm256_extracti128_si256(bytes, 1);
      const __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(half));  // exact
      const __m256i b = _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(f), 16));  // bf16 = high half
      _mm256_store_si256(reinterpret_cast<__m256i*>(out + i * kChunk + h * 16), b);
    }
  }
}

// One pass: weight rows w[0..16) (bf16, or int8 widened on the fly) times BLOCKS tiles of packed activations;
// acc[b] gets [16, 16] fp32 (row-major).
template <int BLOCKS, typename W>
__attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw"))) inline void tile_pass(const W* w, const W* next,
                                                                                      const uint16_t* xv, int64_t k,
                                                                                      int64_t block_stride,
                                                                                      float* acc) {
  alignas(64) uint16_t widened[kTile * kChunk];
  _tile_zero(0);
  if (BLOCKS > 1) {
    _tile_zero(1);
  }
  if (BLOCKS > 2) {
    _tile_zero(2);
  }
  if (BLOCKS > 3) {
    _tile_zero(3);
  }
  for (int64_t c = 0; c < k; c += kChunk) {
    if (next != nullptr)  // the next tile's rows, one cache line each per chunk (a prefetch never faults)
      for (int64_t i = 0; i < kTile; ++i) _mm_prefetch(reinterpret_cast<const char*>(next + i * k + c), _MM_HINT_T0);
    if constexpr (sizeof(W) == 1) {
      widen_int8(reinterpret_cast<const int8_t*>(w) + c, k, widened);
      _tile_loadd(4, widened, 64);
    } else {
      _tile_loadd(4, w + c, k * 2);
    }
    const uint16_t* xb = xv + c * kTile;  // the chunk's 16 column pairs x 16 rows x 2
    _tile_loadd(5, xb, 64);
    _tile_dpbf16ps(0, 4, 5);
    if (BLOCKS > 1) {
      _tile_loadd(5, xb + block_stride, 64);
      _tile_dpbf16ps(1, 4, 5);
    }
    if (BLOCKS > 2) {
      _tile_loadd(5, xb + 2 * block_stride, 64);
      _tile_dpbf16ps(2, 4, 5);
    }
    if (BLOCKS > 3) {
      _tile_loadd(5, xb + 3 * block_stride, 64);
      _tile_dpbf16ps(3, 4, 5);
    }
  }
  _tile_stored(0, acc, 64);
  if (BLOCKS > 1) {
    _tile_stored(1, acc + 256, 64);
  }
  if (BLOCKS > 2) {
    _tile_stored(2, acc + 512, 64);
  }
  if (BLOCKS > 3) {
    _tile_stored(3, acc + 768, 64);
  }
}

// y[0..16) = column j of a [16, 16] fp32 accumulator (acc points at its element [0, j]), times the weight rows'
// scales where given, rounded to bf16 (nearest even).
__attribute__((target("avx512f,avx512bf16"))) inline void store_column(const float* acc, const float* scale,
                                                                        uint16_t* y) {
  const __m512i rows = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                          _mm512_set1_epi32(kTile));
  __m512 v = _mm512_i32gather_ps(rows, acc, 4);
  if (scale != nullptr) v = _mm512_mul_ps(v, _mm512_loadu_ps(scale));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(y), (__m256i)_mm512_cvtneps_pbh(v));
}

// Weight tiles [begin, end) of run_amx, on this thread's tiles.
template <typename W>
__attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512bf16"))) void amx_tiles(
    const uint16_t* xv, const W* wp, const float* scales, uint16_t* yp, int64_t m, int64_t n, int64_t k,
    int64_t blocks, int64_t block_stride, int64_t begin, int64_t end) {
  configure_tiles();
  alignas(64) float acc[kMaxBlocks * 256];
  for (int64_t t = begin; t < end; ++t) {
    const W* w = wp + t * kTile * k;
    for (int64_t b0 = 0; b0 < blocks; b0 += kMaxBlocks) {
      const int64_t nb = std::min(kMaxBlocks, blocks - b0);
      const uint16_t* x = xv + b0 * block_stride;
      const W* next = b0 == 0 && t + 1 < end ? w + kTile * k : nullptr;  // first use streams from memory
      switch (nb) {
        case 1: tile_pass<1>(w, next, x, k, block_stride, acc); break;
        case 2: tile_pass<2>(w, next, x, k, block_stride, acc); break;
        case 3: tile_pass<3>(w, next, x, k, block_stride, acc); break;
        default: tile_pass<4>(w, next, x, k, block_stride, acc); break;
      }
      const float* scale = scales == nullptr ? nullptr : scales + t * kTile;
      for (int64_t b = 0; b < nb; ++b)
        for (int64_t j = 0; j < kTile && (b0 + b) * kTile + j < m; ++j)
          store_column(acc + b * 256 + j, scale, yp + ((b0 + b) * kTile + j) * n + t * kTile);
    }
  }
  _tile_release();
}

// y[:, :n_tiles * 16] = x [M, K] w[:n_tiles * 16]^T (times `scales`, where given), bf16 bits; K a multiple of 32.
// Rows of w past n_tiles * 16 are not touched.
template <typename W>
void run_amx(const uint16_t* xp, const W* wp, const float* scales, uint16_t* yp, int64_t m, int64_t n, int64_t k,
             int64_t n_tiles) {
  // Activations in column pairs per tile of 16 rows: xv[block][k / 2][16][2], zero rows past m.
  const int64_t blocks = (m + kTile - 1) / kTile, block_stride = k * kTile;
  std::vector<uint16_t> xv(blocks * block_stride, 0);
  for (int64_t r = 0; r < m; ++r) {
    uint16_t* dst = xv.data() + (r / kTile) * block_stride + (r % kTile) * 2;
    const uint16_t* src = xp + r * k;
    for (int64_t p = 0; p < k / 2; ++p) dst[p * 2 * kTile] = src[2 * p], dst[p * 2 * kTile + 1] = src[2 * p + 1];
  }
  at::parallel_for(0, n_tiles, 4, [&](int64_t begin, int64_t end) {
    amx_tiles<W>(xv.data(), wp, scales, yp, m, n, k, blocks, block_stride, begin, end);
  });
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
  const int64_t n_tiles = n / kTile;
  if (n_tiles > 0) run_amx<uint16_t>(bits(xc), bits(w), nullptr, bits(y), m, n, k, n_tiles);
  if (n_tiles * kTile < n) run<uint16_t>(bits(xc), bits(w), bits(y), m, n, k, n_tiles * kTile);
  return y;
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
  run_amx<int8_t>(bits(xc), q.data_ptr<int8_t>(), s32.data_ptr<float>(), bits(y), m, n, k, n / kTile);
  return y;
}

}  // namespace

// A fragment of the `tandem` op library (every file adds its own); its fake kernel is registered from Python
// (tandem_native/loader.py).
TORCH_LIBRARY_FRAGMENT(tandem, m) {
  m.def("row_gemm(Tensor x, Tensor w) -> Tensor");
  m.def("tile_gemm(Tensor x, Tensor w) -> Tensor");
  m.def("tile_gemm_int8(Tensor x, Tensor q, Tensor scales) -> Tensor");
}
TORCH_LIBRARY_IMPL(tandem, CPU, m) {
  m.impl("row_gemm", &row_gemm);
  m.impl("tile_gemm", &tile_gemm);
  m.impl("tile_gemm_int8", &tile_gemm_int8);
}

void register_row_gemm(pybind11::module_& m) {
  m.def("tile_gemm_ready", &amx_bf16_ready,
        "Whether tile_gemm runs in this process (the CPU has AMX-BF16 and Linux granted the use of its tiles)");
}
