// Entry points one kernel file offers the others (the decode runner calls the row GEMM and the decode attention
// directly, without a tensor or the dispatcher between them). The tensor-level operators stay in their own files.
// bf16 is passed as its bits (uint16_t) or as at::BFloat16, as each kernel stores it.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>

#include <cstdint>

namespace tandem_kernels {

// y[m, n] = x[m, k] w[n, k]^T by row_gemm.cpp's kernel (k a multiple of 32; each row's bits independent of m), over
// torch's intra-op threads.
void row_gemm_rows(const float* x, const float* w, float* y, int64_t m, int64_t n, int64_t k);
void row_gemm_rows(const uint16_t* x, const uint16_t* w, uint16_t* y, int64_t m, int64_t n, int64_t k);
// The same product, bf16, by tile_gemm's kernel (AMX tiles for whole tiles of 16 weight rows, row_gemm's for the
// rest: each row's bits independent of m); AMX must be usable (row_gemm_tiles()).
void tile_gemm_rows(const uint16_t* x, const uint16_t* w, uint16_t* y, int64_t m, int64_t n, int64_t k);
// The same product, bf16, by dot_gemm.cpp's vdpbf16ps blocks (each row's bits independent of m), where the CPU has
// AVX512_BF16 (dot_bf16_ready()).
bool dot_bf16_ready();
void dot_gemm_rows(const uint16_t* x, const uint16_t* w, uint16_t* y, int64_t m, int64_t n, int64_t k);

// Checks a decode step's metadata against a cache of `num_blocks` blocks of `block_size` tokens: every context
// length in [1, max_blocks * block_size] and every block it reads in [0, num_blocks). `op` names the caller in
// the error.
void check_decode_metadata(const char* op, const int32_t* lens, const int32_t* tables, int64_t s, int64_t max_blocks,
                           int64_t block_size, int64_t num_blocks);

// paged_attention.cpp's decode attention (metadata checked by the caller): q [s, hq, d] over caches
// [num_blocks, bs, hkv, d] of q's dtype -> out [s, hq, d].
void decode_attention_rows(const float* q, const float* k_cache, const float* v_cache, const int32_t* lens,
                           const int32_t* tables, float* out, int64_t s, int64_t hq, int64_t hkv, int64_t d,
                           int64_t bs, int64_t max_blocks, float scale);
void decode_attention_rows(const c10::BFloat16* q, const c10::BFloat16* k_cache, const c10::BFloat16* v_cache,
                           const int32_t* lens, const int32_t* tables, c10::BFloat16* out, int64_t s, int64_t hq,
                           int64_t hkv, int64_t d, int64_t bs, int64_t max_blocks, float scale);

// The quantized row operators as the `tandem` library registers them (tensors in and out): int8_gemv.cpp's
// x [K] or [M, K] times an int8 weight [N, K] with per-row scales -> [N] or [M, N]; int4_gemv.cpp's x [M, K] (M <= 16) times int4 codes
// in its blocked layout -> [M, N].
at::Tensor int8_gemv_op(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales, int64_t group);
at::Tensor int4_gemv_op(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales_and_zeros,
                        int64_t group);

}  // namespace tandem_kernels
