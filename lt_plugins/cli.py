"""`tandem train` and `tandem export`: the training entry points called by shared_model's dispatcher.

Contract:
- `train_main(["--config", "configs/tiny-cpu.yaml", "trainer.devices=2", ...])` loads and validates the config,
  prepares the data (cached in the run dir), writes the resolved `config.yaml` and `model_meta/` into the run dir,
  trains (Lightning launches the other processes by re-running this command), saves sharded checkpoints, exports
  the bundle and prints `bundle: /abs/path` as its last line. Returns 0, or 2 with a one-line error on stderr
  (`tandem train: error: data.extra: path not found: /x/y`) and no traceback for every deliberate error: a bad
  config value, bad data settings, a non-finite loss or model state (`NonFiniteLossGuard`, installed for every
  run, stops training; no checkpoint of that state is written), and a write that fails for lack of space, a
  read-only file system, a file in the path or no permission (`lt_plugins.write_errors`: "no space left on <path>").
- Each attempt of a run (a resume after a crash, a rerun) writes its own `logs/metrics.csv`,
  `logs/metrics.attempt-N.csv` (`lt_plugins.metrics_csv`); `checkpoints.keep_last` counts every attempt's
  checkpoints.
- The run directory is `run_dir` from the config, else `./runs/<run_name>-<timestamp>`; the first process exports
  it as `TANDEM_RUN_DIR` so the processes Lightning launches agree on it. Only those launched processes (rank > 0)
  read it: a value left in the user's environment changes nothing. Multi-node runs should set `run_dir`.
- `export_main([CKPT, OUT_DIR, "--format", "auto"])` consolidates a checkpoint (a ZeRO directory, a run dir: its
  newest, or a Lightning .ckpt) into a bundle, a state dict or a Hugging Face folder (`lt_plugins.export.formats`) and
  prints `<format>: /abs/path` (`bundle: /abs/path`) last, after the line saying what `auto` chose. Errors are one
  line and exit 2, as for train: a full disk, a read-only folder or a path through a file is named, and nothing
  is left half-written.
- A rerun of a finished run (resume=auto finds the final checkpoint, so `fit` trains nothing) still ends with a
  current bundle: `ExportBundle.ensure()` re-exports it when missing or stale.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lt_plugins.config import TrainConfig, load_config, to_yaml
from lt_plugins.errors import TrainingError, one_line
from lt_plugins.precision import check_precision
from lt_plugins.write_errors import write_problem
from shared_model.errors import SharedModelError

RUN_DIR_ENV = "TANDEM_RUN_DIR"


def _storage_line(exc: BaseException, default: Path) -> str | None:
    """A storage failure that escaped the places that report their own (a log write on a full disk, ...), in one
    line naming the file it hit, or `default` when the error names none; None for any other exception."""
    cause: BaseException | None = exc
    while cause is not None and not (isinstance(cause, OSError) and cause.filename):
        cause = cause.__cause__ or cause.__context__
    target = Path(cause.filename) if isinstance(cause, OSError) else default  # type: ignore[arg-type]
    return write_problem(exc, target)


def _is_rank_zero() -> bool:
    """True in the process a user started (before Lightning launches others) and on global rank 0."""
    return all(int(os.environ.get(var, "0") or 0) == 0 for var in ("RANK", "SLURM_PROCID", "LOCAL_RANK", "NODE_RANK"))


def resolve_run_dir(cfg: TrainConfig) -> Path:
    if cfg.run_dir:
        return Path(cfg.run_dir).resolve()
    if os.environ.get(RUN_DIR_ENV) and not _is_rank_zero():  # set by the first process for the ones it launched
        return Path(os.environ[RUN_DIR_ENV]).resolve()
    return (Path.cwd() / "runs" / f"{cfg.run_name}-{time.strftime('%Y%m%d-%H%M%S')}").resolve()


def _quiet() -> None:
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=".*LeafSpec.*")
    warnings.filterwarnings("ignore", message=".*weights_only.*")
    warnings.filterwarnings("ignore", message=".*Stage 3 checkpoint.*")
    import logging

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    # Lightning's "💡 Tip: … try installing litlogger/litmodels" advertisements have no switch of their own; they go
    # through lightning_utilities' rank-zero logger (the module attribute Lightning points at its own logger).
    import lightning.pytorch  # noqa: F401  (sets rank_zero.log)
    from lightning_utilities.core import rank_zero

    rank_zero.log.addFilter(_no_lightning_tips)


def _no_lightning_tips(record: Any) -> bool:
    return not str(record.msg).startswith("💡 Tip:")


def _progress_bar() -> Any:
    """Lightning's default bar with a train description that fits a max_steps run: such a run has max_epochs=-1,
    which RichProgressBar prints as "Epoch 0/-2"; here it reads "Epoch 0" (the bar itself counts the steps)."""
    from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar
    from lightning.pytorch.utilities.imports import _RICH_AVAILABLE

    if not _RICH_AVAILABLE:
        return TQDMProgressBar()  # its description has no max_epochs

    class StepRunProgressBar(RichProgressBar):
        def _get_train_description(self, current_epoch: int) -> str:
            if self.trainer.max_epochs is not None and self.trainer.max_epochs >= 0:
                return super()._get_train_description(current_epoch)
            return f"{f'Epoch {current_epoch}':{len(self.validation_description)}}"

    return StepRunProgressBar()


def build_trainer(cfg: TrainConfig, run_dir: Path, callbacks: list[Any] | None = None) -> Any:
    """The lightning.Trainer a config describes (strategy, precision, loggers, checkpoint and export callbacks)."""
    import lightning.pytorch as pl

    from lt_plugins import autocast
    from lt_plugins.auto_strategy import resolve_auto, training_callbacks  # the planner's checkpointing and ledger
    from lt_plugins.checkpoint_io import PeriodicCheckpoint
    from lt_plugins.export.bundle import ExportBundle
    from lt_plugins.export.checkpoint import META_DIR
    from lt_plugins.finite import NonFiniteLossGuard
    from lt_plugins.metrics_csv import AttemptCSVLogger
    from lt_plugins.precision import PrecisionPolicy, PrecisionPolicyCallback
    from lt_plugins.strategy import ZeroStrategy

    cfg = autocast.resolved_config(resolve_auto(cfg))  # no-op unless strategy.name=auto / trainer.autocast=auto
    t = cfg.trainer
    strategy: Any = cfg.strategy.name
    policy = PrecisionPolicy(classes=PrecisionPolicy().classes + autocast.fp32_classes(t.autocast, t.accelerator))
    all_callbacks: list[Any] = [
        NonFiniteLossGuard(),  # first: a NaN loss stops the run before any other callback sees its step
        PrecisionPolicyCallback(policy),
        *(callbacks or []),
        *training_callbacks(cfg, run_dir),
    ]
    if t.enable_progress_bar:
        all_callbacks.append(_progress_bar())
    if cfg.strategy.name == "zero":
        extra = {**cfg.strategy.extra, **autocast.deepspeed_section(t.autocast)}  # config refuses both set
        strategy = ZeroStrategy(cfg.strategy.zero_config(), extra=extra)
        all_callbacks.append(
            PeriodicCheckpoint(run_dir / "checkpoints", cfg.checkpoints.every_n_steps, cfg.checkpoints.keep_last)
        )
        if cfg.export.enabled:
            all_callbacks.append(
                ExportBundle(
                    run_dir / "checkpoints",
                    run_dir / "bundle",
                    cfg.export.dtype,
                    run_dir / META_DIR,
                    tandem_model=cfg.model.class_path is None,
                    adapter_dir=run_dir / "adapter" if cfg.lora.enabled else None,
                    merged=cfg.lora.export_merged,
                )
            )
    loggers: list[Any] = []
    if cfg.logging.csv:
        loggers.append(AttemptCSVLogger(run_dir))  # logs/metrics.csv, then metrics.attempt-N.csv per resume
    if cfg.logging.tensorboard:
        try:
            from lightning.pytorch.loggers import TensorBoardLogger

            loggers.append(TensorBoardLogger(run_dir, name="tensorboard", version=""))
        except ModuleNotFoundError:  # pragma: no cover - tensorboard is optional
            pass
    return pl.Trainer(
        accelerator=t.accelerator,
        devices=t.devices,
        num_nodes=t.num_nodes,
        precision=t.precision if cfg.strategy.name == "zero" else autocast.lightning_precision(t.autocast, t.precision),
        strategy=strategy,
        max_steps=t.max_steps,
        accumulate_grad_batches=t.accumulate_grad_batches,
        gradient_clip_val=t.gradient_clip_val,
        val_check_interval=t.val_check_interval,
        check_val_every_n_epoch=None,
        limit_val_batches=t.limit_val_batches,
        log_every_n_steps=t.log_every_n_steps,
        enable_progress_bar=t.enable_progress_bar,
        enable_checkpointing=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        default_root_dir=run_dir,
        logger=loggers or False,
        callbacks=all_callbacks,
    )


def _write_run_files(cfg: TrainConfig, run_dir: Path, model_config: Any, tokenizer: Any) -> None:
    """model_meta/ (config.json + the tokenizer files, chat template and special tokens included) and config.yaml,
    each file written to a temporary name and renamed into place."""
    import shutil
    import tempfile

    from lt_plugins.export.checkpoint import META_DIR

    meta = run_dir / META_DIR
    meta.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".meta-", dir=run_dir))
    try:
        (tmp / "config.json").write_text(json.dumps(model_config.to_hf_dict(), indent=2, sort_keys=True) + "\n")
        tokenizer.save(tmp)
        for file in sorted(tmp.iterdir()):
            os.replace(file, meta / file.name)
        if cfg.lora.enabled:  # what export needs to write the PEFT adapter and the merged bundle
            from lt_plugins.lora import LORA_META

            full = [
                n
                for n, on in (("model.embed_tokens", cfg.lora.train_embeddings), ("lm_head", cfg.lora.train_lm_head))
                if on
            ]
            lora = {
                "config": cfg.lora.to_config().to_dict(),
                "base": cfg.model.init_from or cfg.model.preset,
                "full_modules": full,
            }
            (tmp / LORA_META).write_text(json.dumps(lora, indent=2) + "\n")
            os.replace(tmp / LORA_META, meta / LORA_META)
        (tmp / "config.yaml").write_text(to_yaml(cfg))
        os.replace(tmp / "config.yaml", run_dir / "config.yaml")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _resume_path(cfg: TrainConfig, run_dir: Path) -> str | None:
    from lt_plugins.checkpoint_io import latest_checkpoint, verify_checkpoint

    resume = cfg.checkpoints.resume
    if resume is None or resume == "none":
        return None
    path = latest_checkpoint(run_dir / "checkpoints") if resume == "auto" else Path(resume)
    if path is None:
        return None
    verify_checkpoint(path, check_hashes=False)
    return str(path)


def run_training(cfg: TrainConfig) -> Path | None:
    """Train as configured; return the bundle path on rank 0 (None elsewhere or when export is disabled)."""
    _quiet()
    check_precision(cfg.trainer.precision, "cpu" if cfg.trainer.accelerator == "cpu" else "cuda")
    from lt_plugins.auto_strategy import resolve_auto  # strategy auto → the planner's choice
    from lt_plugins.autocast import resolved_config  # trainer.autocast auto → this machine's choice

    cfg = resolved_config(resolve_auto(cfg))  # before config.yaml is written, so the saved config says what ran
    run_dir = resolve_run_dir(cfg)
    os.environ[RUN_DIR_ENV] = str(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)

    import lightning.pytorch as pl

    from lt_plugins.data import CorpusDataModule, prepare_blocks
    from lt_plugins.export.bundle import ExportBundle
    from lt_plugins.lit_module import build_module, model_source

    # a preset, or model.init_from's config.json + tokenizer (then no tokenizer is trained)
    model_config, tokenizer = model_source(cfg.model, cfg.data.block_size)
    if cfg.lora.enabled and cfg.model.class_path is None:  # a target matching nothing: refused before any data
        from lt_plugins.lora import check_targets

        check_targets(model_config, cfg.lora.to_config())
    blocks = prepare_blocks(cfg.data, run_dir / "cache", model_config.vocab_size, tokenizer)
    if _is_rank_zero():
        _write_run_files(cfg, run_dir, model_config, blocks.tokenizer)
    resume = _resume_path(cfg, run_dir)
    pl.seed_everything(cfg.trainer.seed, verbose=False)
    # LitCausalLM builds (and loads init_from) in configure_model; or the model.class_path module
    module = build_module(cfg.model, cfg.optim, model_config, blocks.tokenizer, cfg.lora.to_config())
    trainer = build_trainer(cfg, run_dir)
    trainer.fit(module, datamodule=CorpusDataModule(cfg.data, blocks), ckpt_path=resume)
    if not trainer.is_global_zero:
        return None
    export = next((c for c in trainer.callbacks if isinstance(c, ExportBundle)), None)
    if export is None:
        return None
    done = export.ensure()  # a finished run's rerun re-exports a missing/stale bundle
    if export.adapter_path is not None:
        print(f"adapter: {export.adapter_path}", flush=True)
        return done if export.merged else None
    return done


def train_main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="tandem train", description="Train a model from an OmegaConf YAML config.")
    parser.add_argument("--config", help="YAML file (see configs/); the schema is lt_plugins/config.py")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. trainer.devices=2 strategy.stage=3")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    args = parser.parse_args(list(argv))
    try:
        cfg = load_config(args.config, args.overrides)
        if args.print_config:
            print(to_yaml(cfg), end="")
            return 0
        bundle = run_training(cfg)
    except (TrainingError, SharedModelError) as exc:  # deliberate errors: one line, no traceback
        print(f"tandem train: error: {one_line(exc)}", file=sys.stderr, flush=True)
        return 2
    except Exception as exc:  # a full disk, a read-only folder ... where no caller named it: still one line
        line = _storage_line(exc, Path(os.environ.get(RUN_DIR_ENV) or Path.cwd()))
        if line is None:
            raise
        print(f"tandem train: error: {line}", file=sys.stderr, flush=True)
        return 2
    if bundle is not None:
        print(f"bundle: {bundle}", flush=True)
    return 0


def export_main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="tandem export",
        description="Consolidate a checkpoint of any LightningModule (a ZeRO directory of any stage, a run dir, a "
        "Lightning .ckpt) into a Tandem bundle, a safetensors state dict or a Hugging Face folder (docs/training.md).",
    )
    parser.add_argument("ckpt_dir", help="checkpoint directory, run directory (its newest checkpoint) or .ckpt file")
    parser.add_argument("out_dir", help="folder to write (atomically)")
    parser.add_argument(
        "--format",
        default="auto",
        choices=["auto", "bundle", "state-dict", "hf", "adapter"],
        help="auto: adapter (a PEFT folder) for a LoRA run, bundle when the run has model_meta/, hf when the "
        "checkpoint's hyperparameters hold a Hugging "
        "Face config, else state-dict (the module's tensors under their own names)",
    )
    parser.add_argument(
        "--dtype",
        default=None,
        choices=["float32", "bfloat16", "float16"],
        help="default: bfloat16 for a bundle, the checkpoint's own dtypes otherwise",
    )
    parser.add_argument("--model-meta", default=None, help="folder with config.json + tokenizer (default: found)")
    parser.add_argument("--hf-config", default=None, help="--format hf: the model's config.json (or its folder)")
    parser.add_argument("--hf-attribute", default=None, help="--format hf: module attribute holding the model")
    parser.add_argument("--max-shard-size", default="2GiB", help="split the weights into files of this size")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing folder that Tandem wrote")
    parser.add_argument(
        "--merge", action="store_true", help="a LoRA run: write a full bundle with the adapter merged (W + alpha/r·B·A)"
    )
    args = parser.parse_args(list(argv))
    _quiet()
    from lt_plugins.export.formats import export_checkpoint
    from lt_plugins.planner_cli import parse_bytes

    try:
        shard_bytes = int(parse_bytes(args.max_shard_size, "--max-shard-size"))
        done = export_checkpoint(
            args.ckpt_dir,
            args.out_dir,
            args.format,
            args.dtype,
            args.model_meta,
            args.hf_config,
            args.hf_attribute,
            shard_bytes,
            args.overwrite,
            args.merge,
        )
    except (TrainingError, SharedModelError, ValueError) as exc:  # ValueError: --max-shard-size
        print(f"tandem export: error: {one_line(exc)}", file=sys.stderr)
        return 2
    except Exception as exc:  # a storage failure outside the export's own reporting: still one line
        line = _storage_line(exc, Path(args.out_dir))
        if line is None:
            raise
        print(f"tandem export: error: {line}", file=sys.stderr)
        return 2
    if args.format == "auto":
        print(f"tandem export: {done.reason}", flush=True)
    print(f"{done.format}: {done.path}", flush=True)
    return 0
