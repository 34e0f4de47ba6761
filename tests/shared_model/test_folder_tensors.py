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


_UNDER_ZERO_INIT = """
import sys, torch, deepspeed
from safetensors.torch import save_file
from shared_model.bundle import FolderTensors
folder = sys.argv[1]
a = torch.randn(301, generator=torch.Generator().manual_seed(0))  # fp32 on disk
save_file({"a": a}, folder + "/model.safetensors")
config = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}, "zero_optimization": {"stage": 3}}
with deepspeed.zero.Init(config_dict_or_path=config):
    assert torch.empty(2, dtype=torch.float32).dtype == torch.bfloat16  # the hazard: zero.Init rewrites dtypes
    with FolderTensors(folder) as tensors:
        for dest_dtype in (torch.bfloat16, torch.float32):
            dest = torch.empty(100, dtype=torch.bfloat16).to(dest_dtype)  # [100]
            tensors.copy_range("a", dest, 150, chunk_bytes=64)
            assert torch.equal(dest, a[150:250].to(dest_dtype)), (dest_dtype, dest[:4], a[150:154])
print("ok")
"""


def test_copy_range_reads_the_files_dtype_inside_deepspeed_zero_init(tmp_path):
    """Issue 34: inside DeepSpeed's zero.Init with a bf16 config, `torch.empty(dtype=float32)` returns bfloat16; the
    reader used it for the staging buffer and the element size, so an fp32 file was read 2 bytes per element."""
    pytest.importorskip("deepspeed")
    import os
    import subprocess
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from conftest import free_port

    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}
    env.update({"MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"})
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(repo), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-c", _UNDER_ZERO_INIT, str(tmp_path)], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]
