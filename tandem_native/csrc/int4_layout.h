// The layout of Tandem's int4 weights (shared_model/int4_gemv.py's `pack`), shared by the kernels that read it
// (int4_gemv.cpp: the VNNI GEMV and the dequantize; int4_tiles.cpp: the AMX tiles): codes uint8 [N, K / 2] in blocks
// of P = 16 / gcd(G, 16) rows (G groups a row), one 32-bit lane per (row, group), and scales_and_zeros
// [2, N, G] (the scales, then the zeros). `checked_layout` checks every shape rule and says what it broke.
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <numeric>

namespace tandem_int4 {

constexpr int64_t kLanes = 16;  // groups per lane tile: one 32-bit lane each

// Where a row's groups and a block's bytes lie.
struct Shape {
  int64_t k, group, groups;  // G = groups per row
  int64_t block_rows;        // P = 16 / gcd(G, 16)
  int64_t tiles;             // lane tiles per block: P * G / 16
  int64_t steps;             // per lane tile: group / 8 steps of 64 bytes
};

// The layout of codes uint8 [N, K / 2] and scales_and_zeros [2, N, K / group] for `op`, every shape rule checked.
inline Shape checked_layout(const char* op, const torch::Tensor& codes, const torch::Tensor& scales_and_zeros,
                            int64_t group) {
  TORCH_CHECK(codes.is_cpu() && scales_and_zeros.is_cpu(), op, ": CPU tensors only");
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kByte && codes.is_contiguous(), op,
              ": codes must be uint8 [N, K / 2], contiguous");
  const int64_t n = codes.size(0), k = codes.size(1) * 2;
  TORCH_CHECK(group > 0 && group % 32 == 0 && k % group == 0, op, ": group must be a multiple of 32 dividing K");
  const int64_t groups = k / group, block_rows = kLanes / std::gcd(groups, kLanes);
  TORCH_CHECK(scales_and_zeros.dim() == 3 && scales_and_zeros.size(0) == 2 && scales_and_zeros.size(1) == n &&
                  scales_and_zeros.size(2) == groups && scales_and_zeros.is_contiguous(),
              op, ": scales_and_zeros must be [2, N, K / group], contiguous");
  TORCH_CHECK(n % block_rows == 0, op, ": N (", n, ") must be a multiple of ", block_rows,
              " = 16 / gcd(groups per row, 16)");
  return Shape{k, group, groups, block_rows, block_rows * groups / kLanes, group / 8};
}

}  // namespace tandem_int4
