"""LitCausalLM: the example LightningModule around shared_model's decoder.

Contract:
- Holds the decoder as `self.model` (so checkpoint keys are `model.<HF name>`, see `STATE_PREFIX`) and the loss as
  a module (`self.loss_fn`, a CrossEntropyLoss) so that a precision policy can keep it in fp32.
- Batches are token rows [B, T+1]: inputs are row[:, :-1], targets row[:, 1:].
- The training loss is the mean next-token cross-entropy; with `loss_chunk_tokens` > 0 the LM head and the loss
  run in chunks of that many tokens (lt_plugins.lm_loss: the [B·T, vocab] logits never exist whole; the same
  value and gradients up to summation order, and rounding under autocast) wherever `chunks_loss()` holds.
  Validation scores full logits.
- Logs `train_loss`, `lr` and `tokens_per_s` (global: all processes) on the progress bar; `val_loss` and
  `val_ppl` (averaged over processes) after each validation.
- AdamW (no decay on vectors), linear warm-up then cosine to `min_lr_ratio`·lr, stepped every optimizer step.
- The decoder is built in `configure_model` (Lightning's hook), not in `__init__`: under ZeRO-3 Lightning runs that
  hook inside `deepspeed.zero.Init`, so each parameter is partitioned as soon as its module is created and no rank
  ever holds the whole model; elsewhere it is an ordinary build. `self.model` is None until then. Idempotent.
- Weights: from scratch, `CausalLM.init_weights` with a generator seeded by `seed`, the same values at every stage
  (under ZeRO-3 each leaf module is gathered, initialised on rank 0 in the same order, and re-partitioned). With
  `init_from` (a Hugging Face folder) its tensors are checked against the config first, then copied in: under
  ZeRO-3 each rank reads only the flat slice of each tensor its partition holds (`param.ds_tensor`, DeepSpeed's
  contiguous rank-order split), with positional reads of the safetensors files (`FolderTensors.copy_range`: no
  memory map, no gather, no full tensor anywhere); at stages 0-2 row blocks into the whole model
  (`FolderTensors.copy_into`).
- `model_source(cfg.model, block_size)` and `build_module(cfg.model, ...)` are what `tandem train` builds from the
  `model:` section: a preset or an `init_from` folder (config + tokenizer, checked before any data is read), and
  LitCausalLM or your own `class_path` module.
"""

from __future__ import annotations

import ctypes
import inspect
import logging
import math
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn

from lt_plugins.config import ModelSection, OptimSection, resolve_class
from lt_plugins.errors import TrainingConfigError, one_line
from lt_plugins.lm_loss import chunked_lm_loss
from lt_plugins.lora import LoraConfig, apply_lora
from shared_model.bundle import TOKENIZER_FILE, FolderTensors, read_config, tokenizer_id_bound
from shared_model.config import ModelConfig
from shared_model.errors import SharedModelError
from shared_model.evaluate import token_nll
from shared_model.model import CausalLM, RMSNorm
from shared_model.tokenizer import Tokenizer

log = logging.getLogger(__name__)

STATE_PREFIX = "model."
"""Prefix of the decoder's parameters in this module's state dict (stripped on export)."""


class LitCausalLM(pl.LightningModule):
    """Next-token prediction with shared_model's CausalLM."""

    def __init__(
        self,
        model_config: ModelConfig,
        optim: OptimSection | None = None,
        seed: int = 0,
        init_from: str | Path | None = None,
        lora: LoraConfig | None = None,
        loss_chunk_tokens: int = 0,
    ) -> None:
        super().__init__()
        if loss_chunk_tokens < 0:
            raise TrainingConfigError(f"model.loss_chunk_tokens must be 0 (unchunked) or more, got {loss_chunk_tokens}")
        self.model_config = model_config
        self.optim = optim or OptimSection()
        self.seed = seed
        self.init_from = Path(init_from) if init_from is not None else None
        self.lora = lora if lora is not None and lora.enabled else None
        self.loss_chunk_tokens = loss_chunk_tokens
        self.model: CausalLM | None = None  # built in configure_model
        self.loss_fn = nn.CrossEntropyLoss()
        self._last_step_time: float | None = None

    def configure_model(self) -> None:
        if self.model is not None:
            return
        with unfilled_construction():  # every value is written below: the layers' own fill would be wasted
            model = CausalLM(self.model_config)  # partitioned module by module when run under zero.Init
        if self.init_from is not None:
            load_folder_weights(model, self.init_from)
        else:
            init_random_weights(model, self.seed)
        if self.lora is not None:  # after the base is loaded: the adapters are built (and partitioned) around it
            apply_lora(model, self.lora)
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids)

    def _loss(self, batch: torch.Tensor) -> torch.Tensor:
        inputs, targets = batch[:, :-1], batch[:, 1:]  # [B, T] each
        if self.chunks_loss():
            hidden = self.model.hidden_states(inputs)  # [B, T, hidden]
            head = self.model.lm_head.weight  # [vocab, hidden]
            flat = hidden.reshape(-1, hidden.shape[-1])  # [B·T, hidden]
            return chunked_lm_loss(flat, head, targets.reshape(-1), self.loss_chunk_tokens, self.loss_fn.ignore_index)
        logits = self.model(inputs)  # [B, T, vocab]
        return self.loss_fn(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    def chunks_loss(self) -> bool:
        """Whether the training loss runs in chunks (lt_plugins.lm_loss): see `unchunked_reason`."""
        return self.unchunked_reason() is None

    def unchunked_reason(self) -> str | None:
        """None when the training loss runs in chunks: `loss_chunk_tokens` set, and the head a plain Linear whose
        whole weight this process holds. Otherwise why not: a LoRA-wrapped head, or one ZeRO-3 partitions (its
        weight is gathered only inside its own forward), takes the unchunked path."""
        if not self.loss_chunk_tokens:
            return "model.loss_chunk_tokens is 0"
        if self.model is None:
            return "the decoder is not built yet"
        head = self.model.lm_head
        if type(head) is not nn.Linear:
            return f"the LM head is a {type(head).__name__}, not a plain Linear"
        if hasattr(head.weight, "ds_id"):
            return "ZeRO-3 partitions the LM head's weight"
        return None

    def on_fit_start(self) -> None:
        """Log once which loss the run takes when `loss_chunk_tokens` asks for chunks (the fallback is silent
        otherwise)."""
        if self.loss_chunk_tokens and self.global_rank == 0:
            reason = self.unchunked_reason()
            taken = "chunked" if reason is None else f"unchunked ({reason})"
            log.warning("model.loss_chunk_tokens=%d -> %s", self.loss_chunk_tokens, taken)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss.detach().float(), prog_bar=True, on_step=True)
        self.log("lr", self.trainer.optimizers[0].param_groups[0]["lr"], prog_bar=True, on_step=True)
        now = time.perf_counter()
        if self._last_step_time is not None:
            tokens = (batch.shape[0] * (batch.shape[1] - 1)) * self.trainer.world_size
            self.log("tokens_per_s", tokens / max(now - self._last_step_time, 1e-9), prog_bar=True, on_step=True)
        self._last_step_time = now
        return loss

    def on_validation_start(self) -> None:
        self._last_step_time = None  # do not count validation time as training throughput

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        inputs, targets = batch[:, :-1], batch[:, 1:]  # [B, T] each
        nll, count = token_nll(self.model(inputs), targets)  # the scoring function `tandem eval` uses
        loss = nll / count
        self.log("val_loss", loss, prog_bar=True, sync_dist=True, on_epoch=True)
        self.log("val_ppl", torch.exp(loss.clamp(max=30.0)), sync_dist=True, on_epoch=True)
        return loss

    def configure_optimizers(self) -> dict[str, Any]:
        o = self.optim
        # matrices decay, vectors do not; a ZeRO-3 partition is flat, so read the full shape (ds_shape)
        decay = [p for p in self.parameters() if p.requires_grad and len(_full_shape(p)) >= 2]
        no_decay = [p for p in self.parameters() if p.requires_grad and len(_full_shape(p)) < 2]
        groups = [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        optimizer = torch.optim.AdamW(
            [g for g in groups if g["params"]],  # LoRA has no trainable vector: DeepSpeed drops an empty group
            lr=o.lr,
            betas=(o.beta1, o.beta2),
            foreach=True,  # the same bits as the per-tensor loop torch picks on a CPU, in half its time
        )
        total = max(self.trainer.max_steps, 1) if self._trainer is not None else 1
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(o.warmup_steps, total, o.min_lr_ratio))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class warmup_cosine:
    """lr multiplier: linear warm-up over `warmup` steps, then cosine from 1 to `floor` at `total` steps."""

    def __init__(self, warmup: int, total: int, floor: float) -> None:
        self.warmup, self.total, self.floor = warmup, total, floor

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        progress = min((step - self.warmup) / max(self.total - self.warmup, 1), 1.0)
        return self.floor + (1 - self.floor) * 0.5 * (1 + math.cos(math.pi * progress))


# ------------------------------------------------------------------------------------------------ building the weights
def _is_partitioned(model: nn.Module) -> bool:
    """True when DeepSpeed's zero.Init partitioned the parameters (they carry `ds_id`)."""
    return any(hasattr(p, "ds_id") for p in model.parameters())


def _full_shape(p: torch.Tensor) -> torch.Size:
    """A parameter's shape; under ZeRO-3 its full one (the local tensor is an empty placeholder)."""
    return getattr(p, "ds_shape", p.shape)


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def release_freed_memory() -> None:
    """Hand freed heap back to the OS (glibc's malloc_trim; a no-op elsewhere). glibc keeps freed blocks below its
    adaptive mmap threshold, so without this the gather buffers of a ZeRO-3 load stay in each rank's RSS."""
    with suppress(OSError, AttributeError):  # not glibc
        ctypes.CDLL(None).malloc_trim(0)


_DEFAULT_INITS = (
    "uniform_",
    "normal_",
    "trunc_normal_",
    "kaiming_uniform_",
    "kaiming_normal_",
    "xavier_uniform_",
    "xavier_normal_",
    "orthogonal_",
)
"""The torch.nn.init functions that modules' reset_parameters call to fill their new weights at random."""


@contextmanager
def unfilled_construction() -> Iterator[None]:
    """Build a model whose every parameter is written afterwards (a seeded init or a folder's weights) without
    filling it first. Inside:
    - `torch.nn.init`'s random fills leave the tensor as it is;
    - under ZeRO-3's zero.Init, the per-parameter broadcast from rank 0 that makes the (now unfilled) initial
      values agree is skipped (`Init._zero_init_param` without its `dist.broadcast`: the version pinned in
      tests/lt_plugins/test_lightning_drift.py).
    So each module's full weight is allocated but never written before DeepSpeed copies this rank's partition out
    of it, and its untouched pages never become resident: a rank's construction peak is its partitions plus one
    module, and (with `init_from`, where each rank reads its own slices) no parameter is sent over the network. At
    stages 0-2 it saves a pass over the weights. The swap is process-wide, not per thread: nothing else may build
    modules in this process meanwhile (Lightning's `configure_model` runs on the main thread).
    """
    saved = {name: getattr(nn.init, name) for name in _DEFAULT_INITS}
    zero_init = _zero_init_class()
    own = zero_init.__dict__.get("_zero_init_param") if zero_init is not None else None  # None: inherited
    try:
        for name in _DEFAULT_INITS:
            setattr(nn.init, name, _unchanged)
        if zero_init is not None:
            zero_init._zero_init_param = _partition_without_broadcast  # type: ignore[attr-defined]
        yield
    finally:
        if zero_init is not None:
            if own is None:
                del zero_init._zero_init_param  # type: ignore[attr-defined]
            else:
                zero_init._zero_init_param = own  # type: ignore[attr-defined]
        for name, fn in saved.items():
            setattr(nn.init, name, fn)


def _unchanged(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    return tensor


def _zero_init_class() -> type | None:
    """DeepSpeed's zero.Init while one is active in this process (Lightning's ZeRO-3 `configure_model`), else None."""
    module = sys.modules.get("deepspeed.runtime.zero.partition_parameters")
    if module is None or getattr(module, "zero_init_context", 0) == 0:
        return None
    return module.Init


def _partition_without_broadcast(self: Any, param: nn.Parameter) -> None:
    self._convert_to_deepspeed_param(param)
    param.partition()


@contextmanager
def _whole(params: list[nn.Parameter], partitioned: bool) -> Iterator[bool]:
    """Inside: `params` whole on every rank (gathered under ZeRO-3); yields whether this rank writes them. On exit
    rank 0's values are scattered back into the partitions (`modifier_rank=0`)."""
    if not partitioned or not params:
        yield True
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(params, modifier_rank=0):
        yield _rank() == 0
    release_freed_memory()  # the full copies just freed: out of the resident set before the next module


def _modules_with_params(model: nn.Module) -> Iterator[tuple[str, nn.Module, list[tuple[str, nn.Parameter]]]]:
    """(qualified name, module, its own parameters not yet seen) in module order; a tied parameter comes once."""
    seen: set[int] = set()
    for name, module in model.named_modules():
        own = [(n, p) for n, p in module.named_parameters(recurse=False) if id(p) not in seen]
        seen.update(id(p) for _, p in own)
        if own:
            yield name, module, own


@torch.no_grad()
def init_random_weights(model: CausalLM, seed: int) -> None:
    """`model.init_weights` seeded by `seed`; under ZeRO-3 leaf by leaf, so the values equal an unsharded build."""
    generator = torch.Generator().manual_seed(seed)
    if not _is_partitioned(model):
        model.init_weights(generator=generator)
        return
    # init_weights visits model.modules() in order and draws only for these leaf classes: the same draws, per leaf
    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.Embedding, RMSNorm)):
            with _whole(list(module.parameters(recurse=False)), partitioned=True) as writer:
                if writer:
                    CausalLM.init_weights(module, generator=generator)  # type: ignore[arg-type]  # this leaf only


@torch.no_grad()
def load_folder_weights(model: CausalLM, folder: str | Path) -> int:
    """Copy a Hugging Face folder's tensors into `model` module by module (see the module contract); returns the
    number of tensors copied. A missing, unexpected or misshapen tensor or a NaN/Inf value is a BundleError."""
    partitioned = _is_partitioned(model)
    copied = 0
    # the full shapes (a partitioned parameter's own shape is empty): what the folder must provide
    expected = {
        name: torch.empty(_full_shape(p), device="meta") for name, p in model.named_parameters(remove_duplicate=False)
    }
    with FolderTensors(folder) as tensors:
        tensors.check(model.config, expected)
        for prefix, _module, params in _modules_with_params(model):
            for name, param in params:
                full = f"{prefix}.{name}" if prefix else name
                if partitioned:  # this rank's slice, read from the file straight into its partition: no gather
                    start, local = _partition_slice(param)
                    tensors.copy_range(full, local, start)
                else:  # row blocks straight from the file into the parameter
                    tensors.copy_into(full, param.data)
                copied += 1
    release_freed_memory()
    return copied


def _partition_slice(param: nn.Parameter) -> tuple[int, torch.Tensor]:
    """(first flat element, 1-D view of the elements this rank holds) of a ZeRO-3 parameter: DeepSpeed partitions
    the flattened parameter into equal contiguous pieces in rank order (`ds_tensor`, the last one padded)."""
    import torch.distributed as dist

    local = param.ds_tensor.view(-1)  # [partition size]
    group = getattr(param, "ds_process_group", None)
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    start = min(rank * local.numel(), param.ds_numel)
    return start, local[: min(local.numel(), param.ds_numel - start)]


# ---------------------------------------------------------------------------------- what `tandem train` builds
def model_source(section: ModelSection, block_size: int) -> tuple[ModelConfig, Tokenizer | None]:
    """The model config and (for a fine-tune) the tokenizer a `model:` section names: a preset's config and None,
    or `init_from`'s config.json and tokenizer. A folder that cannot be trained from is a one-line
    `TrainingConfigError` naming model.init_from and the file, before any data is read."""
    from shared_model.config import get_preset

    if section.init_from is None:
        return get_preset(section.preset), None
    folder = Path(section.init_from)
    key = f"model.init_from={section.init_from!r}"
    if not (folder / TOKENIZER_FILE).is_file():
        raise TrainingConfigError(f"{key}: {folder / TOKENIZER_FILE} is missing (the folder's tokenizer is used)")
    try:
        config = read_config(folder)
        tokenizer = Tokenizer.load(folder)
        with FolderTensors(folder) as tensors:
            tensors.check(config)  # headers only: every tensor present with its shape
    except SharedModelError as exc:
        raise TrainingConfigError(f"{key}: {one_line(exc)}") from None
    if tokenizer_id_bound(tokenizer) > config.vocab_size:
        raise TrainingConfigError(
            f"{key}: the tokenizer emits {tokenizer_id_bound(tokenizer)} ids but config.json's vocab_size is "
            f"{config.vocab_size}"
        )
    if block_size > config.max_position_embeddings:
        raise TrainingConfigError(
            f"data.block_size={block_size} exceeds {key}'s max_position_embeddings={config.max_position_embeddings}"
        )
    return config, tokenizer


def build_module(
    section: ModelSection,
    optim: OptimSection,
    model_config: ModelConfig,
    tokenizer: Tokenizer,
    lora: LoraConfig | None = None,
) -> pl.LightningModule:
    """LitCausalLM (from scratch or `init_from`), or `class_path(**init_args)` with the injected arguments it
    declares (lt_plugins.config.INJECTED_ARGS: `vocab_size` = ids the tokenizer emits, `optim`). With an enabled
    `lora`, LitCausalLM applies it in configure_model; a class_path module gets `apply_lora` on the whole module
    right after its own configure_model (`with_lora`)."""
    if section.class_path is None:
        return LitCausalLM(
            model_config,
            optim,
            seed=section.seed,
            init_from=section.init_from,
            lora=lora,
            loss_chunk_tokens=section.loss_chunk_tokens,
        )
    cls = resolve_class(section.class_path)
    declared = inspect.signature(cls.__init__).parameters
    injected = {"vocab_size": tokenizer_id_bound(tokenizer), "optim": optim}
    extra = {k: v for k, v in injected.items() if k in declared and k not in section.init_args}
    module = cls(**section.init_args, **extra)
    return with_lora(module, lora) if lora is not None and lora.enabled else module


def with_lora(module: pl.LightningModule, lora: LoraConfig) -> pl.LightningModule:
    """`module` whose configure_model (Lightning calls it before the optimizer and the strategy's engine exist)
    ends with `apply_lora(module, lora)`: any LightningModule, whether it builds its layers there or in __init__."""
    own = module.configure_model

    def configure_model() -> None:
        own()
        apply_lora(module, lora)

    module.configure_model = configure_model  # type: ignore[method-assign]
    return module
