"""One rank of the 2-process sharded-construction test (started by test_sharded_init.py, never by pytest).

`sharded_init_worker.py FOLDER OUT STAGE [PRECISION]`: starts `Trainer.fit` of LitCausalLM(init_from=FOLDER) under
ZeroStrategy(STAGE) in Trainer precision PRECISION (default 32-true; under bf16-mixed DeepSpeed builds the
parameters in bfloat16 inside zero.Init) with every parameter partitioned (param_persistence_threshold=0), stops it
once configure_model has run (training under ZeRO-3 is covered by test_train_cli.py) and writes `<OUT>/rank<r>.json`:
- `broadcasts`: the collective broadcasts made while configure_model built and loaded the decoder (none: the
  unfilled construction skips zero.Init's broadcast of each new parameter, and each rank reads its own slices);
- `construction`: for every parameter, right after `configure_model` built and loaded it: its local numel (0 once
  partitioned), `ds_numel` (the full size) and the size of this rank's partition `ds_tensor`;
- `max_abs_diff`: per tensor, max |gathered parameter - the folder's tensor cast to the parameter's dtype| (0.0 for
  an exact load); `dtypes`: the parameters' dtypes;
- `random_diff`: the same for a from-scratch build under the strategy's sharded context against
  `build_model(config, seed=3)` built whole (the per-leaf sharded init must draw the same values).

and, from the last `atexit` handler (after the strategy's own), `<OUT>/rank<r>.exit.json`: the names of the
process's native threads still running when the interpreter starts finalizing (`threads_at_exit`). A gloo thread
left there can abort the process ("terminate called without an active exception") after a run that succeeded.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from lt_plugins.config import DataSection, OptimSection
from lt_plugins.data import Blocks, CorpusDataModule
from lt_plugins.lit_module import LitCausalLM, _modules_with_params, init_random_weights
from lt_plugins.strategy import ZeroStrategy
from shared_model.bundle import FolderTensors, read_config
from shared_model.model import CausalLM, build_model


def _gathered_diffs(model: torch.nn.Module, reference: Any) -> dict[str, float]:
    """max |parameter - reference(name)| per parameter, gathering each module's parameters under ZeRO-3."""
    import deepspeed

    diffs: dict[str, float] = {}
    for prefix, _module, params in _modules_with_params(model):
        ps = [p for _, p in params]
        ctx = deepspeed.zero.GatheredParameters(ps) if hasattr(ps[0], "ds_id") else torch.no_grad()
        with ctx:
            for name, p in params:
                full = f"{prefix}.{name}" if prefix else name
                diffs[full] = (p.data.float() - reference(full).to(p.dtype).float()).abs().max().item()
    return diffs


class Probe(LitCausalLM):
    """LitCausalLM that records the partition state of its parameters right after construction and loading."""

    def configure_model(self) -> None:
        import deepspeed.comm as dist

        fresh = self.model is None
        upstream, self.broadcasts = dist.broadcast, 0

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.broadcasts += 1
            return upstream(*args, **kwargs)

        dist.broadcast = counted  # zero.Init's consistency broadcast of each new parameter would pass here
        try:
            super().configure_model()
        finally:
            dist.broadcast = upstream
        if fresh:
            assert self.model is not None
            self.construction = {
                name: {
                    "numel": p.numel(),
                    "ds_numel": getattr(p, "ds_numel", None),
                    "local": p.ds_tensor.numel() if hasattr(p, "ds_tensor") else None,
                }
                for name, p in self.model.named_parameters()
            }
            self.dtypes = sorted({str(p.dtype) for p in self.model.parameters()})
            with FolderTensors(self.init_from) as tensors:
                self.diffs = _gathered_diffs(self.model, tensors.get)
            scratch = CausalLM(self.model_config)  # still inside the strategy's zero.Init
            init_random_weights(scratch, seed=3)
            self.random_diff = _gathered_diffs(scratch, self.reference.__getitem__)
            raise Built


class Built(Exception):
    """Ends the fit once the probe has recorded construction and loading."""


def native_thread_names() -> list[str]:
    """The names of this process's native threads (Linux /proc), sorted."""
    tasks = Path("/proc/self/task")
    return sorted((task / "comm").read_text().strip() for task in tasks.iterdir())


def record_threads_at_exit(path: Path) -> None:
    """Write the native threads alive now to `path` (an atexit handler registered before the strategy's: it runs
    after it)."""
    path.write_text(json.dumps({"threads_at_exit": native_thread_names()}))


def main(folder: str, out: str, stage: int, precision: str = "32-true") -> None:
    atexit.register(record_threads_at_exit, Path(out, f"rank{os.environ['RANK']}.exit.json"))
    torch.set_num_threads(1)
    config = read_config(folder)
    data = DataSection(block_size=16, batch_size=2)
    rows = torch.randint(0, config.vocab_size, (16, data.block_size + 1), generator=torch.Generator().manual_seed(0))
    strategy = ZeroStrategy(stage=stage, param_persistence_threshold=0, bucket_size=10_000)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        precision=precision,
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,
    )
    module = Probe(config, OptimSection(lr=1e-3, warmup_steps=1), init_from=folder)
    module.reference = build_model(config, seed=3).state_dict()  # built whole, before any zero.Init
    with contextlib.suppress(Built):
        trainer.fit(module, datamodule=CorpusDataModule(data, Blocks(rows, rows[:4], None)))  # type: ignore[arg-type]
    result = {"construction": module.construction, "max_abs_diff": module.diffs, "random_diff": module.random_diff}
    result["broadcasts"] = module.broadcasts
    result["dtypes"] = module.dtypes
    Path(out, f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), *sys.argv[4:5])
