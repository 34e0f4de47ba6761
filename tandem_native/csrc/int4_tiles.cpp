// Activation rows times an int4 weight on AMX-BF16 tiles: y[m, n] = sum_k x[m, k] * w[n, k], x bf16, w the int4
// weight in Tandem's layout (int4_layout.h; shared_model/int4_gemv.py) with its scales and zeros in bf16:
// w[n, k] = (q[n, k] - 8) * s[n, g] + z[n, g], computed in fp32 as a product then a sum (no fused multiply-add) and
// rounded to bf16 (nearest even). That is int4_dequantize's weight bit for bit (shared_model/quantize.py's
// `dequantize_int4(..., stored)` rounded to bf16): only the fp32 summation order differs from a dense product with it.
//
// Each tile of 16 weight rows is unpacked into bf16 [16, K] in a per-thread scratch (L1/L2) and multiplied there by
// tiles.h's AMX passes (up to 64 activation rows per pass, more in further passes over the same scratch), so the
// codes stream from memory once a call at half a byte a weight, and each row's outputs come from its own weight row
// and activation row alone in the hardware's fixed order: a row's bits never depend on how many rows share the call.
// Activations are not rounded (int4_gemv's int8 rounding is not applied here).
//
// Unpacking: a lane tile holds 16 (row, group) lanes; four 64-byte steps of it, transposed four dwords by four,
// give each lane 16 bytes = its group's inputs 4j..4j+15 (low nibbles) and half + 4j.. (high nibbles). Each
// (row, group) has 16 possible weights, so a table of 16 bf16 per lane, computed once per lane tile, maps codes to
// weights with one word permute per 32 of them (two lanes' tables side by side in one vector).
#include <torch/extension.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "int4_layout.h"
#include "tiles.h"

namespace {

using namespace tandem_tiles;
using tandem_int4::checked_layout;
using tandem_int4::kLanes;
using tandem_int4::Shape;

// Two lanes' tables side by side: words 0..15 = (c - 8) * s_a + z_a, words 16..31 = (c - 8) * s_b + z_b for codes
// c = 0..15, each a product then a sum in fp32, rounded to bf16 (nearest even, as Tensor.to for finite values; the
// weights are finite).
__attribute__((target("avx512f,avx512bw"))) inline __m512i pair_table(const float* s, const float* z, int a, int b) {
  const __m512 centred = _mm512_set_ps(7, 6, 5, 4, 3, 2, 1, 0, -1, -2, -3, -4, -5, -6, -7, -8);  // c - 8, exact
  __m512 pa = _mm512_mul_ps(centred, _mm512_set1_ps(s[a])), pb = _mm512_mul_ps(centred, _mm512_set1_ps(s[b]));
  asm("" : "+v"(pa), "+v"(pb));  // keeps the compiler from fusing the products and the sums into FMAs
  const __m512i one = _mm512_set1_epi32(1), half = _mm512_set1_epi32(0x7FFF);
  auto rounded = [&](__m512 v) {  // bf16 in the high word of each dword: bits + 0x7FFF + (bit 16)
    const __m512i bits = _mm512_castps_si512(v);
    return _mm512_add_epi32(bits, _mm512_add_epi32(half, _mm512_and_si512(_mm512_srli_epi32(bits, 16), one)));
  };
  const __m512i ra = rounded(_mm512_add_ps(pa, _mm512_set1_ps(z[a]))), rb = rounded(_mm512_add_ps(pb, _mm512_set1_ps(z[b])));
  const __m512i high_words = _mm512_set_epi16(63, 61, 59, 57, 55, 53, 51, 49, 47, 45, 43, 41, 39, 37, 35, 33, 31, 29,
                                              27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
  return _mm512_permutex2var_epi16(ra, high_words, rb);
}

// The int4 weight as a tile source (tiles.h's amx_tiles): tile t's 16 rows unpacked into scratch, bf16 [16, K].
struct Int4Rows {
  const uint8_t* codes;  // [N, K / 2], the blocked layout
  const uint16_t* sz;    // [2, N, G] bf16 bits
  int64_t n;
  Shape sh;

  __attribute__((target("avx512f,avx512bw,avx512vl"))) const uint16_t* rows(int64_t t, uint16_t* scratch) const {
    const int64_t p_rows = sh.block_rows, k = sh.k, half = sh.group / 2;
    const int64_t valid = std::min(kTile, n - t * kTile);  // a multiple of P (N is)
    const int64_t block_bytes = p_rows * k / 2, block_groups = p_rows * sh.groups;
    const uint16_t* zeros = sz + n * sh.groups;
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    // words 16..31 index the second table of a pair: +16
    const __m512i second = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(16), 1);
    alignas(64) float s[kLanes], z[kLanes];
    for (int64_t bi = 0; bi < valid / p_rows; ++bi) {
      const int64_t b = t * kTile / p_rows + bi;
      const uint8_t* block = codes + b * block_bytes;
      int64_t p = 0, g = 0;  // the (row of the block, group) of lane l of lane tile lt: flat index 16 lt + l
      for (int64_t lt = 0; lt < sh.tiles; ++lt) {
        const int64_t first = b * block_groups + lt * kLanes;  // this lane tile's 16 scales and zeros
        const __m256i sb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sz + first));
        const __m256i zb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(zeros + first));
        _mm512_store_ps(s, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(sb), 16)));  // exact
        _mm512_store_ps(z, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(zb), 16)));
        uint16_t* dst[kLanes];  // where each lane's group starts in the scratch
        for (int64_t l = 0; l < kLanes; ++l) {
          dst[l] = scratch + (bi * p_rows + p) * k + g * sh.group;
          if (++g == sh.groups) g = 0, ++p;
        }
        // pair[i][h]: the tables of the lanes in chunks 2h and 2h + 1 of a transposed vector: i + 8h, i + 4 + 8h
        __m512i pair[4][2];
        for (int i = 0; i < 4; ++i)
          for (int h = 0; h < 2; ++h) pair[i][h] = pair_table(s, z, i + 8 * h, i + 4 + 8 * h);
        const uint8_t* src = block + lt * sh.steps * 64;
        for (int64_t j = 0; j < sh.steps; j += 4) {
          const __m512i r0 = _mm512_loadu_si512(src + j * 64), r1 = _mm512_loadu_si512(src + (j + 1) * 64);
          const __m512i r2 = _mm512_loadu_si512(src + (j + 2) * 64), r3 = _mm512_loadu_si512(src + (j + 3) * 64);
          // per 128-bit chunk c: lane 4c + i's dwords of steps j..j+3 into vector i
          const __m512i t0 = _mm512_unpacklo_epi32(r0, r1), t1 = _mm512_unpackhi_epi32(r0, r1);
          const __m512i t2 = _mm512_unpacklo_epi32(r2, r3), t3 = _mm512_unpackhi_epi32(r2, r3);
          const __m512i lanes[4] = {_mm512_unpacklo_epi64(t0, t2), _mm512_unpackhi_epi64(t0, t2),
                                    _mm512_unpacklo_epi64(t1, t3), _mm512_unpackhi_epi64(t1, t3)};
          for (int i = 0; i < 4; ++i) {
            const __m512i lo = _mm512_and_si512(lanes[i], nibble);
            const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(lanes[i], 4), nibble);
            for (int h = 0; h < 2; ++h) {
              uint16_t* a = dst[i + 8 * h] + 4 * j;      // its 16 weights: words 0..15
              uint16_t* c = dst[i + 4 + 8 * h] + 4 * j;  // words 16..31
              const __m256i lo_h = h == 0 ? _mm512_castsi512_si256(lo) : _mm512_extracti64x4_epi64(lo, 1);
              const __m256i hi_h = h == 0 ? _mm512_castsi512_si256(hi) : _mm512_extracti64x4_epi64(hi, 1);
              const __m512i wl = _mm512_permutexvar_epi16(_mm512_or_si512(_mm512_cvtepu8_epi16(lo_h), second),
                                                          pair[i][h]);
              const __m512i wh = _mm512_permutexvar_epi16(_mm512_or_si512(_mm512_cvtepu8_epi16(hi_h), second),
                                                          pair[i][h]);
              _mm256_store_si256(reinterpret_cast<__m256i*>(a), _mm512_castsi512_si256(wl));  // 32-byte aligned
              _mm256_store_si256(reinterpret_cast<__m256i*>(c), _mm512_extracti64x4_epi64(wl, 1));
              _mm256_store_si256(reinterpret_cast<__m256i*>(a + half), _mm512_castsi512_si256(wh));
              _mm256_store_si256(reinterpret_cast<__m256i*>(c + half), _mm512_extracti64x4_epi64(wh, 1));
            }
          }
        }
      }
    }
    return scratch;
  }
  const uint16_t* next(int64_t, int64_t) const { return nullptr; }  // the codes stream in order: no prefetch
};

// x [M, K] bf16 times the int4 weight (codes uint8 [N, K / 2], scales_and_zeros bf16 [2, N, K / group]) -> y [M, N]
// bf16, on AMX tiles. Any M; N a multiple of the layout's block rows (int4_layout.h), K of the group (itself of 32).
torch::Tensor tile_gemm_int4(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scales_and_zeros,
                             int64_t group) {
  TORCH_CHECK(x.is_cpu() && x.dim() == 2 && x.scalar_type() == at::kBFloat16, "tile_gemm_int4: x must be a bf16 CPU "
              "tensor [M, K]");
  const Shape sh = checked_layout("tile_gemm_int4", codes, scales_and_zeros, group);
  TORCH_CHECK(scales_and_zeros.scalar_type() == at::kBFloat16, "tile_gemm_int4: scales_and_zeros must be bf16");
  TORCH_CHECK(x.size(1) == sh.k, "tile_gemm_int4: shapes do not match (x has ", x.size(1), " inputs, the codes ", sh.k,
              ")");
  TORCH_CHECK(amx_bf16_ready(), "tile_gemm_int4: this process cannot use AMX-BF16 tiles (see tile_gemm_ready())");
  const int64_t m = x.size(0), n = codes.size(0), k = sh.k;
  const auto xc = x.contiguous();
  auto y = torch::empty({m, n}, x.options());
  if (m == 0 || n == 0) return y;
  const auto* sz = reinterpret_cast<const uint16_t*>(scales_and_zeros.data_ptr<at::BFloat16>());
  const Int4Rows source{codes.data_ptr<uint8_t>(), sz, n, sh};
  run_amx(reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>()), source, nullptr,
          reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()), m, n, k, (n + kTile - 1) / kTile);
  return y;
}

}  // namespace

// A fragment of the `tandem` op library (every file adds its own); its fake kernel is registered from Python
// (tandem_native/loader.py).
TORCH_LIBRARY_FRAGMENT(tandem, m) { m.def("tile_gemm_int4(Tensor x, Tensor codes, Tensor scales_and_zeros, int group) -> Tensor"); }
TORCH_LIBRARY_IMPL(tandem, CPU, m) { m.impl("tile_gemm_int4", &tile_gemm_int4); }
