// AMX-BF16 tile products for the kernels that multiply activation rows by a weight on tiles (row_gemm.cpp's tile_gemm
// and tile_gemm_int8, int4_tiles.cpp's tile_gemm_int4): y[m, n] = sum_k x[m, k] * w[n, k], x bf16.
//
// 16 weight rows x 32 columns are one tile (bf16; int8 codes are widened exactly on their way in; a `source` may also
// make a tile's rows in a scratch buffer, as int4's unpacking does), up to 64 activation rows four more, and the products accumulate in
// fp32 tiles, 32 columns per instruction in the hardware's fixed order. Each output comes from its own weight row
// and activation row alone, in the same order at any row count, so a row's bits never depend on how many rows share
// the call. The weight is read once for all the rows. `amx_bf16_ready()` says whether this process may use the tiles
// (asked of the CPU, the OS and Linux once).
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cpuid.h>
#include <cstdlib>
#include <cstdint>
#include <memory>
#include <type_traits>
#include <vector>

namespace tandem_tiles {

constexpr int64_t kTile = 16;      // weight rows of a tile, activation rows of a tile
constexpr int64_t kChunk = 32;     // bf16 columns of one tile row (64 bytes)
constexpr int64_t kMaxBlocks = 4;  // activation tiles per pass over the weight (accumulators 0..3)

// Whether this process may use AMX-BF16: the CPU has it (CPUID 7.0 EDX bits 22 and 24; and AVX512_BF16), the OS saves its state
// (XCR0 bits 17 and 18) and Linux granted the tile data permission (arch_prctl ARCH_REQ_XCOMP_PERM).
inline bool amx_bf16_ready() {
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

// Tiles 0-3: fp32 accumulators [16 weight rows, 16 activation rows]; 4 and 5: weight rows [16, 32 bf16]; 6 and 7:
// activation columns in pairs [16 column pairs, 16 rows x 2 bf16].
__attribute__((target("amx-tile,amx-bf16"))) inline void configure_tiles() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) cfg.rows[t] = kTile, cfg.colsb[t] = 64;
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

// Tile instructions with the tile numbers as template arguments (the compiler's intrinsics take them only as
// literal tokens): tload<T> loads tile T from `base` (rows `stride` bytes apart), tdp<D, A, B> is D += A * B.
template <int T>
__attribute__((target("amx-tile"))) inline void tload(const void* base, int64_t stride) {
  __asm__ volatile("{tileloadd\t(%0,%1,1), %%tmm%c2|tileloadd\t%%tmm%c2, [%0+%1*1]}" ::"r"(base), "r"(stride),
                   "i"(T));
}
template <int D, int A, int B>
__attribute__((target("amx-tile,amx-bf16"))) inline void tdp() {
  __asm__ volatile("{tdpbf16ps\t%%tmm%c2, %%tmm%c1, %%tmm%c0|tdpbf16ps\t%%tmm%c0, %%tmm%c1, %%tmm%c2}" ::"i"(D),
                   "i"(A), "i"(B));
}

// One chunk of 32 columns: the weight's 16 rows into tile WT (4 or 5, alternating chunk by chunk), then each
// activation block into tile 6 or 7 (alternating load by load; FLIP is the parity this chunk starts on) and its
// product into accumulator b. Two tiles for each operand let a load run while the product before it still reads
// the other; the products and their order per accumulator are the same as with one.
template <int BLOCKS, int WT, int FLIP, typename W>
__attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw"))) inline void tile_chunk(const W* w, const W* next,
                                                                                       const uint16_t* xb, int64_t k,
                                                                                       int64_t c,
                                                                                       int64_t block_stride,
                                                                                       uint16_t* widened) {
  if (next != nullptr)  // the next tile's rows, one cache line each per chunk (a prefetch never faults)
    for (int64_t i = 0; i < kTile; ++i) _mm_prefetch(reinterpret_cast<const char*>(next + i * k + c), _MM_HINT_T1);
  if constexpr (sizeof(W) == 1) {
    widen_int8(reinterpret_cast<const int8_t*>(w) + c, k, widened);
    tload<WT>(widened, 64);
  } else {
    tload<WT>(w + c, k * 2);
  }
  tload<6 + FLIP>(xb, 64);
  tdp<0, WT, 6 + FLIP>();
  if constexpr (BLOCKS > 1) {
    tload<7 - FLIP>(xb + block_stride, 64);
    tdp<1, WT, 7 - FLIP>();
  }
  if constexpr (BLOCKS > 2) {
    tload<6 + FLIP>(xb + 2 * block_stride, 64);
    tdp<2, WT, 6 + FLIP>();
  }
  if constexpr (BLOCKS > 3) {
    tload<7 - FLIP>(xb + 3 * block_stride, 64);
    tdp<3, WT, 7 - FLIP>();
  }
}

// One pass: weight rows w[0..16) (bf16, or int8 widened on the fly) times BLOCKS tiles of packed activations;
// acc[b] gets [16, 16] fp32 (row-major). Each accumulator sums its chunks in order.
template <int BLOCKS, typename W>
__attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw"))) inline void tile_pass(const W* w, const W* next,
                                                                                      const uint16_t* xv, int64_t k,
                                                                                      int64_t block_stride,
                                                                                      float* acc) {
  alignas(64) uint16_t widened[2][kTile * kChunk];  // one per weight tile, so a widening never waits on a load
  constexpr int kOddFlip = BLOCKS % 2;  // the activation tile parity the second chunk of a pair starts on
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
  int64_t c = 0;
  for (; c + kChunk < k; c += 2 * kChunk) {
    tile_chunk<BLOCKS, 4, 0>(w, next, xv + c * kTile, k, c, block_stride, widened[0]);
    tile_chunk<BLOCKS, 5, kOddFlip>(w, next, xv + (c + kChunk) * kTile, k, c + kChunk, block_stride, widened[1]);
  }
  if (c < k) tile_chunk<BLOCKS, 4, 0>(w, next, xv + c * kTile, k, c, block_stride, widened[0]);
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

// y[0..valid) = column j of a [16, 16] fp32 accumulator (acc points at its element [0, j]), times the weight rows'
// scales where given, rounded to bf16 (nearest even); valid < 16 for the last tile of a weight whose rows are not a
// multiple of 16 (nothing past it is read or written).
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) inline void store_column(const float* acc,
                                                                                          const float* scale,
                                                                                          uint16_t* y,
                                                                                          int64_t valid) {
  const __m512i rows = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                          _mm512_set1_epi32(kTile));
  const __mmask16 mask = static_cast<__mmask16>((1u << valid) - 1);
  __m512 v = _mm512_i32gather_ps(rows, acc, 4);
  if (scale != nullptr) v = _mm512_mul_ps(v, _mm512_maskz_loadu_ps(mask, scale));
  _mm256_mask_storeu_epi16(y, mask, (__m256i)_mm512_cvtneps_pbh(v));
}

// A weight stored as [N, K] rows of W (bf16 bits or int8): tile t is rows 16t..16t+15, read in place.
template <typename W>
struct StoredRows {
  const W* w;
  int64_t k;
  const W* rows(int64_t t, W* /*scratch*/) const { return w + t * kTile * k; }
  const W* next(int64_t t, int64_t end) const { return t + 1 < end ? w + (t + 1) * kTile * k : nullptr; }
};

// Weight tiles [begin, end) of run_amx, on this thread's tiles. `source.rows(t, scratch)` gives tile t's 16 rows
// (scratch: room for 16 x K of W, 64-byte aligned, for sources that make them); `source.next(t, end)` the next tile's rows to prefetch, or nullptr. The last tile may hold fewer than 16
// rows (n not a multiple of 16): its other outputs are not stored.
template <typename W, typename Source>
__attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16"))) void amx_tiles(
    const uint16_t* xv, const Source& source, const float* scales, uint16_t* yp, int64_t m, int64_t n, int64_t k,
    int64_t blocks, int64_t block_stride, int64_t begin, int64_t end) {
  configure_tiles();
  alignas(64) float acc[kMaxBlocks * 256];
  std::vector<W> room(kTile * k + 64 / sizeof(W));
  W* scratch = reinterpret_cast<W*>((reinterpret_cast<uintptr_t>(room.data()) + 63) & ~uintptr_t(63));
  for (int64_t t = begin; t < end; ++t) {
    const W* w = source.rows(t, scratch);
    const int64_t valid = std::min(kTile, n - t * kTile);
    for (int64_t b0 = 0; b0 < blocks; b0 += kMaxBlocks) {
      const int64_t nb = std::min(kMaxBlocks, blocks - b0);
      const uint16_t* x = xv + b0 * block_stride;
      const W* next = b0 == 0 ? source.next(t, end) : nullptr;  // first use streams from memory
      switch (nb) {
        case 1: tile_pass<1>(w, next, x, k, block_stride, acc); break;
        case 2: tile_pass<2>(w, next, x, k, block_stride, acc); break;
        case 3: tile_pass<3>(w, next, x, k, block_stride, acc); break;
        default: tile_pass<4>(w, next, x, k, block_stride, acc); break;
      }
      const float* scale = scales == nullptr ? nullptr : scales + t * kTile;
      for (int64_t b = 0; b < nb; ++b)
        for (int64_t j = 0; j < kTile && (b0 + b) * kTile + j < m; ++j)
          store_column(acc + b * 256 + j, scale, yp + ((b0 + b) * kTile + j) * n + t * kTile, valid);
    }
  }
  _tile_release();
}

// x [M, K] bf16 bits -> xv [ceil(M / 16)][K / 2][16][2]: each tile of 16 rows as the tiles' second operand wants it,
// a column pair of 16 rows per 64 bytes (a pair is one 32-bit element: the layout is a 32-bit transpose of each
// block), rows past M zero. One 16-lane gather per pair of a block.
__attribute__((target("avx512f"))) inline void pack_pairs(const uint16_t* xp, int64_t m, int64_t k, uint16_t* xv) {
  const int64_t pairs = k / 2;
  const auto* src = reinterpret_cast<const int32_t*>(xp);  // [M, K / 2] pairs
  auto* dst = reinterpret_cast<int32_t*>(xv);
  const __m512i rows = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                          _mm512_set1_epi32(static_cast<int32_t>(pairs)));
  for (int64_t b = 0; b * kTile < m; ++b) {
    const int64_t valid = std::min(kTile, m - b * kTile);
    const __mmask16 mask = static_cast<__mmask16>((1u << valid) - 1);
    const int32_t* block = src + b * kTile * pairs;
    int32_t* out = dst + b * kTile * pairs;
    for (int64_t p = 0; p < pairs; ++p)
      _mm512_storeu_si512(out + p * kTile,
                          _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), mask, rows, block + p, 4));
  }
}

// y[:, :min(n_tiles * 16, n)] = x [M, K] W[:n_tiles * 16]^T (times `scales`, where given), bf16 bits; K a multiple
// of 32. W's tiles come from `source` (see amx_tiles); rows past n_tiles * 16 are not touched. Tiles are split over
// torch's intra-op threads.
template <typename Source>
void run_amx(const uint16_t* xp, const Source& source, const float* scales, uint16_t* yp, int64_t m, int64_t n,
             int64_t k, int64_t n_tiles) {
  using W = std::remove_cv_t<std::remove_pointer_t<decltype(source.rows(0, nullptr))>>;
  // Activations in column pairs per tile of 16 rows: xv[block][k / 2][16][2], zero rows past m.
  const int64_t blocks = (m + kTile - 1) / kTile, block_stride = k * kTile;
  // 64-byte aligned (a tile row that straddles two cache lines loads about three times slower; malloc gives 16),
  // every element written by pack_pairs; the size, 32 K bytes a block, is a multiple of 64
  const std::unique_ptr<uint16_t, decltype(&std::free)> xv(
      static_cast<uint16_t*>(std::aligned_alloc(64, blocks * block_stride * sizeof(uint16_t))), &std::free);
  TORCH_CHECK(xv != nullptr, "tile kernels: out of memory for the packed activations");
  pack_pairs(xp, m, k, xv.get());
  at::parallel_for(0, n_tiles, 4, [&](int64_t begin, int64_t end) {
    amx_tiles<W>(xv.get(), source, scales, yp, m, n, k, blocks, block_stride, begin, end);
  });
}

}  // namespace tandem_tiles
