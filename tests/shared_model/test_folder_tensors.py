"""`FolderTensors.copy_range`: a flat slice of a stored tensor by positional reads (a ZeRO-3 rank's partition)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from shared_model.bundle import FolderTensors
from shared_model.errors import BundleError


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_copy_range_reads_exactly_the_flat_slice(tmp_path, dtype):
    a = torch.randn(37, 11, generator=torch.Generator().manual_seed(0)).to(dtype)
    b = torch.arange(10, dtype=torch.float32)
    save_file({"a": a, "b": b}, str(tmp_path / "model.safetensors"))
    with FolderTensors(tmp_path) as tensors:
        for start, n in [(0, 407), (5, 100), (400, 7), (123, 1)]:
            dest = torch.empty(n, dtype=torch.float32)
            tensors.copy_range("a", dest, start, chunk_bytes=64)  # several pieces
            assert torch.equal(dest, a.flatten()[start : start + n].float())
        strided = torch.zeros(2 * 100, dtype=dtype)[::2]  # [100], same dtype, not contiguous: through the staging
        tensors.copy_range("a", strided, 5, chunk_bytes=64)
        assert torch.equal(strided, a.flatten()[5:105])
        elsewhere = torch.empty(100, dtype=dtype, device="meta")  # not CPU memory (a GPU partition): staged, copied
        tensors.copy_range("a", elsewhere, 5, chunk_bytes=64)
        dest = torch.empty(3, dtype=torch.bfloat16)
        tensors.copy_range("b", dest, 7)
        assert dest.tolist() == [7.0, 8.0, 9.0]
        with pytest.raises(BundleError, match=r"has no elements \[8, 11\)"):
            tensors.copy_range("b", torch.empty(3), 8)


def test_copy_range_refuses_non_finite_values(tmp_path):
    save_file({"w": torch.tensor([1.0, float("nan"), 2.0])}, str(tmp_path / "model.safetensors"))
    with FolderTensors(tmp_path) as tensors:
        tensors.copy_range("w", torch.empty(1), 0)
        with pytest.raises(BundleError, match="NaN or Inf"):
            tensors.copy_range("w", torch.empty(2), 1)
