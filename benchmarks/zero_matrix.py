"""The ZeRO compatibility matrix: stage x activation checkpointing x offload x precision on a module Tandem did not
write, plus stage x precision for a fine-tune from a model folder (`init_from`), each cell trained on 2 CPU
processes (gloo) and compared with Lightning's plain "ddp" strategy.

What a cell is: `Cell(stage, ckpt, offload, precision, optimizer, threshold)`; the module is `EncoderLM` (an
embedding, two `torch.nn.TransformerEncoderLayer`s under a causal mask, a head), trained `STEPS` steps with
Lightning's validation sanity check on (`num_sanity_val_steps=1`, a validation dataloader, validation every
`VAL_EVERY` steps) and gradient clipping. Checkpointing goes through `SelectiveCheckpointing`: the blocks are the
largest repeated stack (`encoder.layers`, found without naming a class), `attention` recomputes the layers'
`MultiheadAttention` modules (`attention_classes=("MultiheadAttention",)`).

An `init_from` cell (`Cell(..., model="init_from")`, name suffix `-init_from`) trains Tandem's LitCausalLM loaded
from an fp32 Hugging Face-layout folder (sharded safetensors, written once per process group by `write_folder`)
instead: under ZeRO-3 each rank reads its own partition from the files inside DeepSpeed's zero.Init, in the
parameters' dtype (bf16 under bf16-mixed). Its reference is DDP loading the same folder in the same precision (fp32
weights, autocast under bf16-mixed), so the first loss already compares what was loaded.

A cell's outcome is one of:
  - `ok`: its per-step global loss follows the DDP reference of the same precision (same seed, same per-rank
    batches) within `TOLERANCE[precision]` (with DeepSpeed's CPU Adam: `TOLERANCE["cpu_adam"]`);
  - `refused`: a one-line `lt_plugins` error raised before the first step, naming the combination and what to use;
  - `mismatch` (trained, but the loss left the tolerance) or `crash` (any other exception, or a hang): defects.

Cells run in batches: one 2-process group (ranks started like torchrun, on a free loopback port, bounded by a
timeout, both killed on failure) trains the DDP references first, then each cell in turn (ZeRO-3 cells last:
DeepSpeed's stage 3 patches process-wide state). Results are written after every cell, so a hang keeps the rest.

    .venv/bin/python benchmarks/zero_matrix.py                      # the full matrix; table to stdout
    .venv/bin/python benchmarks/zero_matrix.py --out results/zero_matrix.json --markdown results/zero_matrix.md
    .venv/bin/python benchmarks/zero_matrix.py --stages 3 --precisions 32-true   # a slice
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from inference_svc.serve_process import free_port

REPO = Path(__file__).resolve().parents[1]

STAGES = (0, 1, 2, 3)
CKPT_MODES = ("none", "full", "attention", "ops")
OFFLOADS = ("none", "optimizer", "params", "opt+params")
PRECISIONS = ("32-true", "bf16-mixed")
MODELS = ("encoder", "init_from")
"""encoder: EncoderLM from random weights; init_from: LitCausalLM loaded from an fp32 model folder."""

STEPS = 6
VAL_EVERY = 3
WORLD = 2
VOCAB, WIDTH, HEADS, FF, LAYERS, SEQ, BATCH = 96, 32, 2, 64, 2, 16, 4

TOLERANCE = {"32-true": (2e-4, 2e-4), "bf16-mixed": (0.02, 0.05), "cpu_adam": (1e-3, 1e-3)}
"""(rtol, atol) of a cell's losses against the DDP reference: 32-true is the ZeRO-vs-DDP tests' tolerance
(tests/lt_plugins/test_zero_distributed.py); bf16-mixed compares DeepSpeed's bf16 weights with DDP's fp32 weights
under autocast (test_bf16_mixed_runs_on_cpu's tolerance); DeepSpeed's CPU Adam (its own SIMD kernel) against
torch's AdamW in fp32."""


@dataclass(frozen=True)
class Cell:
    stage: int
    ckpt: str = "none"
    offload: str = "none"
    precision: str = "32-true"
    optimizer: str = "adamw"
    """adamw (torch.optim.AdamW, from configure_optimizers) or cpu_adam (deepspeed.ops.adam.DeepSpeedCPUAdam)."""
    threshold: int | None = 0
    """ZeRO-3 stage3_param_persistence_threshold: 0 shards every parameter; None keeps ZeroStrategy's default
    (100k elements: every parameter of this small module stays whole, the case fixed in 3eb6afb)."""
    model: str = "encoder"
    """One of MODELS: what is trained (see the module docstring)."""

    @property
    def name(self) -> str:
        extra = ("" if self.optimizer == "adamw" else f"-{self.optimizer}") + (
            "-persistent" if self.stage == 3 and self.threshold is None else ""
        )
        extra += "" if self.model == "encoder" else f"-{self.model}"
        return f"z{self.stage}-{self.ckpt}-{self.offload}-{self.precision}{extra}"

    @property
    def reference(self) -> str:
        """The key of the DDP reference this cell is judged against: its precision (and model, if not encoder)."""
        return reference_key(self.precision, self.model)

    @classmethod
    def parse(cls, name: str) -> Cell:
        """The inverse of `name` (z3-ops-none-32-true[-cpu_adam][-persistent][-init_from])."""
        head, _, rest = name.partition("-")
        ckpt, offload_rest = rest.split("-", 1)
        for offload in sorted(OFFLOADS, key=len, reverse=True):
            if offload_rest.startswith(offload + "-"):
                break
        else:
            raise ValueError(f"cell {name!r}: unknown offload")
        tail = offload_rest[len(offload) + 1 :]
        precision = next(p for p in PRECISIONS if tail.startswith(p))
        flags = tail[len(precision) :].split("-")[1:]
        return cls(
            stage=int(head[1:]),
            ckpt=ckpt,
            offload=offload,
            precision=precision,
            optimizer="cpu_adam" if "cpu_adam" in flags else "adamw",
            threshold=None if "persistent" in flags else 0,
            model="init_from" if "init_from" in flags else "encoder",
        )


def reference_key(precision: str, model: str = "encoder") -> str:
    """`32-true` for the encoder's DDP reference in that precision, `32-true-init_from` for the folder's."""
    return precision if model == "encoder" else f"{precision}-{model}"


def full_matrix(
    stages: tuple[int, ...] = STAGES, precisions: tuple[str, ...] = PRECISIONS, cpu_adam: bool = True
) -> list[Cell]:
    """Every stage x checkpointing mode x offload x precision; ZeRO-3 with its default persistence threshold
    (small parameters whole) per mode in 32-true; DeepSpeed's CPU Adam on each offload cell without checkpointing;
    every stage x precision fine-tuned from a model folder (`init_from`)."""
    cells = [Cell(s, c, o, p) for s in stages for p in precisions for o in OFFLOADS for c in CKPT_MODES]
    cells += [Cell(s, "none", "none", p, model="init_from") for s in stages for p in precisions]
    if 3 in stages and "32-true" in precisions:
        cells += [Cell(3, c, "none", "32-true", threshold=None) for c in CKPT_MODES]
    if cpu_adam:
        cells += [Cell(s, "none", o, p, "cpu_adam") for s in stages if s >= 1 for p in precisions for o in OFFLOADS
                  if o == "optimizer" or s == 3]  # fmt: skip
    return cells


# ---------------------------------------------------------------------------------------------- the module
def build_module(
    optimizer: str = "adamw", vocab: int = VOCAB, width: int = WIDTH, layers: int = LAYERS, ff: int = FF
) -> Any:
    """A small causal LM made of torch.nn.TransformerEncoderLayer (nothing of shared_model); `optimizer` is what its
    configure_optimizers returns: adamw (torch.optim.AdamW) or cpu_adam (DeepSpeedCPUAdam, AdamW mode)."""
    import lightning.pytorch as pl
    import torch
    from torch import nn

    class EncoderLM(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(vocab, width)
            layer = nn.TransformerEncoderLayer(width, HEADS, ff, dropout=0.0, batch_first=True)
            self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
            self.head = nn.Linear(width, vocab)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            # ids: [batch, seq] → logits [batch, seq, vocab]
            mask = nn.Transformer.generate_square_subsequent_mask(ids.shape[1], device=ids.device)
            return self.head(self.encoder(self.embed(ids), mask=mask, is_causal=True))

        def _loss(self, batch: torch.Tensor) -> torch.Tensor:
            logits = self(batch[:, :-1])
            return nn.functional.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())

        def training_step(self, batch: list[torch.Tensor], idx: int) -> torch.Tensor:
            return self._loss(batch[0])

        def validation_step(self, batch: list[torch.Tensor], idx: int) -> None:
            self.log("val_loss", self._loss(batch[0]), sync_dist=True)

        def configure_optimizers(self) -> Any:
            if optimizer == "cpu_adam":
                from deepspeed.ops.adam import DeepSpeedCPUAdam

                return DeepSpeedCPUAdam(self.parameters(), lr=3e-3, weight_decay=0.01, adamw_mode=True)
            return torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.01)

    return EncoderLM()


FOLDER_NAME = "init_from-fp32"
"""The model folder `launch` writes into its output folder for the init_from cells."""


def write_folder(folder: Path) -> Path:
    """A small random Qwen3-style model saved as an fp32 Hugging Face-layout folder (config.json, sharded
    safetensors with their index), the kind `model.init_from` fine-tunes; seeded, so every run writes the same."""
    import torch

    from shared_model.bundle import save_bundle
    from shared_model.config import ModelConfig
    from shared_model.model import build_model

    config = ModelConfig(
        vocab_size=VOCAB,
        hidden_size=WIDTH,
        num_layers=LAYERS,
        num_heads=HEADS,
        num_kv_heads=1,
        head_dim=WIDTH // HEADS,
        intermediate_size=FF,
        qk_norm=True,
        max_position_embeddings=64,
    )
    model = build_model(config, seed=1)
    with torch.no_grad():  # norms start at one: make them tell a load from a fresh init
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(2)) * 0.1)
    return save_bundle(folder, config, model, dtype="float32", max_shard_bytes=20_000, overwrite=True)


def build_folder_module(folder: Path) -> Any:
    """Tandem's LitCausalLM fine-tuning `folder` (lt_plugins' own init_from path), fed this matrix's batches."""
    from lt_plugins.config import OptimSection
    from lt_plugins.lit_module import LitCausalLM
    from shared_model.bundle import read_config

    class FolderLM(LitCausalLM):
        def training_step(self, batch: list[Any], idx: int) -> Any:
            return super().training_step(batch[0], idx)

        def validation_step(self, batch: list[Any], idx: int) -> Any:
            return super().validation_step(batch[0], idx)

    optim = OptimSection(lr=3e-3, warmup_steps=1, weight_decay=0.01)
    return FolderLM(read_config(folder), optim, init_from=folder)


def rows() -> Any:
    """Token rows [64, SEQ+1] with a learnable rule (every odd position follows from the one before it)."""
    import torch

    gen = torch.Generator().manual_seed(0)
    out = torch.randint(0, VOCAB, (64, SEQ + 1), generator=gen)
    out[:, 1::2] = (out[:, 0::2][:, : out[:, 1::2].shape[1]] * 5 + 3) % VOCAB
    return out


def loaders(rank: int, world: int) -> tuple[Any, Any]:
    """This rank's batches, the same under every strategy: rows rank, rank+world, ... in order."""
    from torch.utils.data import DataLoader, TensorDataset

    data = rows()
    train = DataLoader(TensorDataset(data[rank::world]), batch_size=BATCH, shuffle=False)
    val = DataLoader(TensorDataset(data[:8][rank::world]), batch_size=BATCH, shuffle=False)
    return train, val


# ---------------------------------------------------------------------------------------------- one cell
def _strategy(cell: Cell | None) -> Any:
    if cell is None:
        from lightning.pytorch.strategies import DDPStrategy

        return DDPStrategy(process_group_backend="gloo")
    from lt_plugins.strategy import ZeroStrategy

    kw: dict[str, Any] = {"stage": cell.stage, "bucket_size": 10_000}
    if cell.threshold is not None:
        kw["param_persistence_threshold"] = cell.threshold
    if cell.offload in ("optimizer", "opt+params"):
        kw["offload_optimizer"] = True
    if cell.offload in ("params", "opt+params"):
        kw["offload_params"] = True
    return ZeroStrategy(**kw)


def fit(
    cell: Cell | None,
    precision: str,
    optimizer: str = "adamw",
    losses: list[float] | None = None,
    model: str = "encoder",
    folder: Path | None = None,
) -> dict[str, Any]:
    """Train one cell (None: the DDP reference of `model`) in this process group; its per-step global losses (also
    appended to `losses` as they come, so a caller can tell a failure at setup from one during training) and step
    time. `folder` is the model folder of the init_from model."""
    import lightning.pytorch as pl

    from lt_plugins.checkpointing import SelectiveCheckpointing

    losses = [] if losses is None else losses
    started: list[float] = []

    class Rec(pl.Callback):
        def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
            started.append(time.perf_counter())

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, *args: Any) -> None:
            losses.append(float(trainer.strategy.reduce(outputs["loss"].detach().float(), reduce_op="mean")))
            started[-1] = time.perf_counter() - started[-1]

    callbacks: list[Any] = [Rec()]
    if cell is not None and cell.ckpt != "none":
        callbacks.append(SelectiveCheckpointing(mode=cell.ckpt, attention_classes=("MultiheadAttention",)))
    pl.seed_everything(0, verbose=False)
    if model == "init_from":
        assert folder is not None, "an init_from cell needs the model folder"
        module = build_folder_module(folder)
    else:
        module = build_module(optimizer)
    world = int(os.environ.get("WORLD_SIZE", WORLD))
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))  # torchrun sets it: several "nodes" of 1 process
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=per_node,
        num_nodes=world // per_node,
        strategy=_strategy(cell),
        precision=precision,
        max_steps=STEPS,
        gradient_clip_val=1.0,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        num_sanity_val_steps=1,
        limit_val_batches=1,
        val_check_interval=VAL_EVERY,
    )
    train, val = loaders(int(os.environ["RANK"]), world)
    trainer.fit(module, train_dataloaders=train, val_dataloaders=val)
    step_ms = sorted(started[1:])[len(started[1:]) // 2] * 1e3 if len(started) > 1 else None
    return {"losses": losses, "step_ms": step_ms}


def _classify(exc: BaseException, trained: bool) -> dict[str, Any]:
    from lt_plugins.errors import TrainingError, one_line

    refused = isinstance(exc, TrainingError) and not trained
    return {"outcome": "refused" if refused else "crash", "error": f"{type(exc).__name__}: {one_line(exc)}"[:400]}


def worker(cells: list[Cell], out: Path, references: bool = True) -> None:
    """One rank: the DDP references for the precisions and models the cells use (unless `references` is false),
    then the cells; results after each."""
    import warnings

    import torch

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    result: dict[str, Any] = {"reference": {}, "cells": {}}
    path = out / f"matrix-rank{rank}.json"
    folder = out / FOLDER_NAME
    for precision, model in sorted({(c.precision, c.model) for c in cells}) if references else ():
        result["reference"][reference_key(precision, model)] = fit(None, precision, model=model, folder=folder)
        path.write_text(json.dumps(result))
    for cell in sorted(cells, key=lambda c: c.stage == 3):
        progress: list[float] = []
        started = time.perf_counter()
        try:
            trained = fit(cell, cell.precision, cell.optimizer, progress, cell.model, folder)
            result["cells"][cell.name] = {"outcome": "trained", **trained}
        except Exception as exc:  # every failure is a row of the matrix
            result["cells"][cell.name] = _classify(exc, trained=bool(progress))
            if rank == 0 and result["cells"][cell.name]["outcome"] == "crash":
                traceback.print_exc()
        result["cells"][cell.name]["wall_s"] = time.perf_counter() - started
        path.write_text(json.dumps(result))


# ---------------------------------------------------------------------------------------------- launching
def launch(cells: list[Cell], out: Path, timeout_s: float = 600, references: bool = True) -> dict[str, Any]:
    """Run `cells` in one 2-process group; rank 0's results (the DDP references unless `references` is false, and
    the cells). Ranks that outlive the timeout are killed; the cells they did not reach are `crash` rows."""
    out.mkdir(parents=True, exist_ok=True)
    if any(c.model == "init_from" for c in cells):
        write_folder(out / FOLDER_NAME)
    spec = out / "cells.json"
    spec.write_text(json.dumps({"cells": [c.name for c in cells], "references": references}))
    port = free_port()
    procs = []
    for rank in range(WORLD):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(WORLD),
               "RANK": str(rank), "LOCAL_RANK": str(rank), "NODE_RANK": "0", "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}  # fmt: skip
        log = open(out / f"matrix-log{rank}.txt", "w")  # noqa: SIM115 - closed below
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", str(spec), str(out)]
        procs.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO), log))
    deadline = time.monotonic() + timeout_s
    codes: list[Any] = []
    for proc, log in procs:
        try:
            codes.append(proc.wait(timeout=max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            for p, _ in procs:
                p.kill()
            proc.wait()
            codes.append("timeout")
        log.close()
    path = out / "matrix-rank0.json"
    result = json.loads(path.read_text()) if path.is_file() else {"reference": {}, "cells": {}}
    for cell in cells:
        if cell.name not in result["cells"]:
            why = "timeout" if "timeout" in codes else f"exit codes {codes}"
            tail = (out / "matrix-log0.txt").read_text()[-1500:]
            result["cells"][cell.name] = {"outcome": "crash", "error": f"process group ended ({why}): {tail}"}
    return result


def judge(cell: Cell, row: dict[str, Any], reference: dict[str, Any]) -> dict[str, Any]:
    """A trained row becomes `ok` or `mismatch` against its DDP reference (same precision, same model)."""
    if row["outcome"] != "trained":
        return row
    import torch

    ref = reference[cell.reference]["losses"]
    rtol, atol = TOLERANCE["cpu_adam" if cell.optimizer == "cpu_adam" else cell.precision]
    ours = row["losses"]
    diff = max(abs(a - b) for a, b in zip(ours, ref, strict=False)) if ours else float("inf")
    try:
        torch.testing.assert_close(torch.tensor(ours), torch.tensor(ref), rtol=rtol, atol=atol)
        outcome = "ok"
    except AssertionError:
        outcome = "mismatch"
    return {**row, "outcome": outcome, "max_abs_diff": diff, "ref_step_ms": reference[cell.reference]["step_ms"]}


def run(cells: list[Cell], out: Path, batch: int = 24, timeout_s: float = 600) -> list[dict[str, Any]]:
    """Every cell, in process groups of at most `batch` cells; one judged row per cell."""
    rows_out = []
    for i in range(0, len(cells), batch):
        chunk = cells[i : i + batch]
        result = launch(chunk, out / f"group{i // batch}", timeout_s)
        for cell in chunk:
            rows_out.append({**asdict(cell), "name": cell.name, **judge(cell, result["cells"][cell.name],
                                                                           result["reference"])})  # fmt: skip
    return rows_out


def markdown(rows_: list[dict[str, Any]]) -> str:
    """The table for docs/training.md: one line per stage x offload x precision (x model), one column per
    checkpointing mode."""
    by = {(r["stage"], r["offload"], r["precision"], r["optimizer"], r["threshold"], r.get("model", "encoder"),
           r["ckpt"]): r for r in rows_}  # fmt: skip
    keys = sorted(
        {k[:6] for k in by}, key=lambda k: (MODELS.index(k[5]), k[0], OFFLOADS.index(k[1]), k[2], k[3], k[4] is None)
    )

    def cell_text(r: dict[str, Any] | None) -> str:
        if r is None:
            return "–"
        if r["outcome"] == "ok":
            return f"ok ({r['max_abs_diff']:.1e}, {r['step_ms']:.0f} ms)"
        if r["outcome"] == "refused":
            return "refused"
        return f"**{r['outcome'].upper()}**"

    lines = ["| stage | offload | precision | optimizer | " + " | ".join(f"ckpt {m}" for m in CKPT_MODES) + " |",
             "|---|---|---|---|" + "---|" * len(CKPT_MODES)]  # fmt: skip
    for k in keys:
        label = f"{k[0]}" + (" (small params whole)" if k[0] == 3 and k[4] is None else "")
        label += " (init_from an fp32 folder)" if k[5] == "init_from" else ""
        cells_ = [cell_text(by.get((*k, m))) for m in CKPT_MODES]
        lines.append(f"| {label} | {k[1]} | {k[2]} | {k[3]} | " + " | ".join(cells_) + " |")
    refusals = sorted({r["error"] for r in rows_ if r["outcome"] == "refused"})
    lines += ["", "Refusals (the one-line errors, raised before the first step):", ""]
    lines += [f"- `{e}`" for e in refusals]
    defects = [r for r in rows_ if r["outcome"] in ("crash", "mismatch")]
    if defects:
        lines += ["", "Defects:", ""] + [f"- {r['name']}: {r.get('error') or r.get('max_abs_diff')}" for r in defects]
    return "\n".join(lines) + "\n"


BEGIN, END = "<!-- zero_matrix.py:begin -->", "<!-- zero_matrix.py:end -->"


def write_docs(path: Path, table: str, date: str, command: str) -> None:
    """Replace the block between BEGIN and END in `path` with the table, its date and command."""
    text = path.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"zero_matrix: {path} has no {BEGIN} ... {END} block to rewrite")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    note = f"Measured {date} with `.venv/bin/python {command}` (generated by that command; do not edit by hand)."
    block = f"{BEGIN}\n\n{note}\n\n{table}\n"
    path.write_text(head + block + END + tail)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", nargs=2, metavar=("CELLS_JSON", "OUT"), help=argparse.SUPPRESS)
    parser.add_argument("--stages", type=int, nargs="+", default=list(STAGES))
    parser.add_argument("--precisions", nargs="+", default=list(PRECISIONS), choices=PRECISIONS)
    parser.add_argument("--cells", nargs="+", help="explicit cell names (z3-ops-none-32-true...) instead")
    parser.add_argument("--no-cpu-adam", action="store_true", help="skip the DeepSpeedCPUAdam cells")
    parser.add_argument("--batch", type=int, default=24, help="cells per 2-process group")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per process group")
    parser.add_argument("--work-dir", type=Path, default=REPO / "results" / "zero_matrix")
    parser.add_argument("--out", type=Path, help="JSON results")
    parser.add_argument("--markdown", type=Path, help="the table as markdown")
    parser.add_argument("--from-json", type=Path, help="render the table (and --docs) from an earlier --out file")
    parser.add_argument("--docs", type=Path, help=f"rewrite the generated block of this file ({BEGIN} ... {END})")
    args = parser.parse_args(argv)
    if args.worker:
        spec = json.loads(Path(args.worker[0]).read_text())
        worker([Cell.parse(n) for n in spec["cells"]], Path(args.worker[1]), spec["references"])
        return 0
    if args.from_json:
        recorded = json.loads(args.from_json.read_text())
        table = markdown(recorded["results"])
        print(table)
        if args.docs:
            write_docs(args.docs, table, recorded["date"], recorded["command"])
        return 0
    if args.cells:
        cells = [Cell.parse(n) for n in args.cells]
    else:
        cells = full_matrix(tuple(args.stages), tuple(args.precisions), cpu_adam=not args.no_cpu_adam)
    started = time.time()
    results = run(cells, args.work_dir, args.batch, args.timeout)
    table = markdown(results)
    print(table)
    print(f"{len(results)} cells in {time.time() - started:.0f} s")
    command = "benchmarks/zero_matrix.py " + " ".join(sys.argv[1:] if argv is None else argv)
    meta = {"date": time.strftime("%Y-%m-%d", time.gmtime()), "command": command.strip(), "results": results}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(meta, indent=1))
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(table)
    if args.docs:
        write_docs(args.docs, table, meta["date"], meta["command"])
    return int(any(r["outcome"] in ("crash", "mismatch") for r in results))


if __name__ == "__main__":
    sys.exit(main())
