"""The checks a bundle's contents get, on load and before a save: tensors, finite values, tokenizer ids.

Contract:
- `check_tensors` refuses a missing, unexpected or misshapen tensor (both shapes named) and a weight that is not
  floating point (its dtype named); derived tensors some checkpoints carry (`DERIVED_SUFFIXES`) are ignored.
- `check_finite` refuses NaN/Inf values, naming the file and the tensor.
- `check_tokenizer_fits` refuses a tokenizer whose ids exceed config.json's vocab_size (`tokenizer_id_bound`).
- Each refusal is one `BundleError` line; nothing here reads or writes files.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from shared_model.bundle.layout import CONFIG_FILE, TOKENIZER_FILE, dtype_name
from shared_model.config import ModelConfig
from shared_model.errors import BundleError
from shared_model.tokenizer import Tokenizer

# Tensors some checkpoints carry that are derived, not learned: ignored on load.
DERIVED_SUFFIXES = ("rotary_emb.inv_freq",)


def check_finite(file: Path, name: str, t: torch.Tensor, cast_to: torch.dtype | None = None) -> None:
    """BundleError naming the tensor when it holds NaN or ±Inf. One reduction over it, no temporary of its size:
    NaN propagates to the smallest and largest values, and an infinity is one of them."""
    if not t.is_floating_point() or t.numel() == 0:
        return
    low, high = torch.aminmax(t)
    if bool(torch.isfinite(low)) and bool(torch.isfinite(high)):
        return
    if cast_to is None:
        raise BundleError(f"{file}: tensor {name} holds NaN or Inf values")
    raise BundleError(f"{file}: tensor {name} has values outside the range of {dtype_name(cast_to)}")


def check_tensors(config: ModelConfig, expected: Mapping[str, torch.Tensor], found: Mapping[str, torch.Tensor]) -> None:
    optional = {"lm_head.weight"} if config.tie_word_embeddings else set()
    missing = [k for k in expected if k not in found and k not in optional]
    if missing:
        shown = ", ".join(missing[:5]) + (f" (+{len(missing) - 5} more)" if len(missing) > 5 else "")
        raise BundleError(f"missing tensor(s): {shown}")
    unexpected = [k for k in found if k not in expected and not k.endswith(DERIVED_SUFFIXES)]
    if unexpected:
        shown = ", ".join(unexpected[:5]) + (f" (+{len(unexpected) - 5} more)" if len(unexpected) > 5 else "")
        raise BundleError(f"unexpected tensor(s) for this config: {shown}")
    for name, ref in expected.items():
        if name in found and tuple(found[name].shape) != tuple(ref.shape):
            raise BundleError(
                f"tensor {name} has shape {tuple(found[name].shape)}, expected {tuple(ref.shape)} from config.json"
            )
        if name in found and not found[name].is_floating_point():
            raise BundleError(
                f"tensor {name} has dtype {dtype_name(found[name].dtype)}; model weights are floating point "
                "(float32, float16 or bfloat16)"
            )


def tokenizer_id_bound(tokenizer: Tokenizer) -> int:
    """One more than the largest id the tokenizer can emit (added and special tokens included)."""
    # Tokenizer exposes no id table; its wrapped tokenizers.Tokenizer does (same package). Ids may be sparse.
    vocab = tokenizer._tk.get_vocab(with_added_tokens=True)
    return max(tokenizer.vocab_size, max(vocab.values(), default=-1) + 1)


def check_tokenizer_fits(folder: Path, tokenizer: Tokenizer, config: ModelConfig) -> None:
    bound = tokenizer_id_bound(tokenizer)
    if bound > config.vocab_size:
        raise BundleError(
            f"{folder / TOKENIZER_FILE}: the tokenizer emits ids up to {bound - 1} ({bound} ids) but "
            f"{CONFIG_FILE}: vocab_size is {config.vocab_size}; every text prompt would hold ids the model has no "
            "embedding for"
        )
