"""Worker for the autocast tests: a real single-process fit with `trainer.autocast=bf16` through the Trainer that
`tandem train` builds (`lt_plugins.cli.build_trainer`), printing what ran as one JSON line.

Usage: python autocast_worker.py RUN_DIR STRATEGY (zero | ddp)

The module trains a small shared_model decoder (qk-norm, GQA) on random tokens for three steps. A spy around
torch's scaled_dot_product_attention (the real function runs) records the dtype the attention core computes in and
whether autocast was on there; a forward hook records the dtype of a Linear's output. Under ZeroStrategy it also
reports whether DeepSpeed loaded its shared-memory allreduce op, and its table of compatible ops before and after.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import deepspeed.comm.comm as deepspeed_comm
import deepspeed.ops
import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

import shared_model.attention as attention
from lt_plugins.cli import build_trainer
from lt_plugins.config import load_config
from shared_model.config import ModelConfig
from shared_model.model import build_model

REPO = Path(__file__).resolve().parents[2]
SHM_OP = "deepspeed_shm_comm"  # DeepSpeed's shared-memory allreduce op (ShareMemCommBuilder.NAME)
CONFIG = ModelConfig(
    vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=64,
    qk_norm=True,
)  # fmt: skip
seen_attention: list[tuple[str, bool]] = []
_sdpa = attention.F.scaled_dot_product_attention


def _spy_sdpa(q: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
    seen_attention.append((str(q.dtype), torch.is_autocast_enabled(q.device.type)))
    return _sdpa(q, *args, **kwargs)


class TinyDecoder(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = build_model(CONFIG, seed=0)
        self.linear_out: list[str] = []
        self.model.model.layers[0].self_attn.q_proj.register_forward_hook(
            lambda m, i, o: self.linear_out.append(str(o.dtype))
        )
        self.losses: list[float] = []

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        (tokens,) = batch  # [B, T + 1]
        logits = self.model(tokens[:, :-1])  # [B, T, V]
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def main(run_dir: Path, strategy: str) -> int:
    overrides = [f"run_dir={run_dir}", "trainer.max_steps=3", "trainer.precision=32-true", "trainer.autocast=bf16"]
    overrides += [f"strategy.name={strategy}", "export.enabled=false", "trainer.limit_val_batches=0"]
    overrides += ["trainer.enable_progress_bar=false", "logging.tensorboard=false", "checkpoints.every_n_steps=100"]
    cfg = load_config(REPO / "configs/tiny-cpu.yaml", overrides)
    attention.F.scaled_dot_product_attention = _spy_sdpa
    shm_compatible_before = bool(deepspeed.ops.__compatible_ops__.get(SHM_OP, False))
    tokens = torch.randint(0, CONFIG.vocab_size, (12, 17), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    module = TinyDecoder()
    trainer = build_trainer(cfg, run_dir)
    trainer.fit(module, train_dataloaders=DataLoader(TensorDataset(tokens), batch_size=4))
    ds_config = getattr(trainer.strategy, "config", None) or {}
    report = {
        "trainer_precision": str(trainer.precision),
        "torch_autocast": ds_config.get("torch_autocast"),
        "bf16_section": ds_config.get("bf16"),
        "linear_out": sorted(set(module.linear_out)),
        "attention": sorted({f"{dtype} autocast={on}" for dtype, on in seen_attention}),
        "param_dtypes": sorted({str(p.dtype) for p in module.parameters()}),
        "losses": module.losses,
        "finite": all(bool(torch.isfinite(p).all()) for p in module.parameters()),
        "shm_allreduce_op": getattr(deepspeed_comm.cdb, "shm_comm_op", None) is not None,
        "shm_compatible_before": shm_compatible_before,
        "shm_compatible_after": bool(deepspeed.ops.__compatible_ops__.get(SHM_OP, False)),
    }
    print("REPORT " + json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), sys.argv[2]))
