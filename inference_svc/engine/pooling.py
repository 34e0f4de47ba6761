"""Embedding pooling: how a prompt's final-norm hidden states become one vector, as the model folder declares it.

Contract:
- `Pooling.from_folder(folder)` reads sentence-transformers' layout: `modules.json` lists the modules; the one of
  type `sentence_transformers.models.Pooling` names a folder (e.g. `1_Pooling`) whose `config.json` sets one of
  `pooling_mode_lasttoken` (Qwen3-Embedding), `pooling_mode_mean_tokens` or `pooling_mode_cls_token` (the first
  token); a `sentence_transformers.models.Normalize` module means L2 normalization. A folder without
  `modules.json` pools as a causal LM embeds best: the last token, L2-normalized (Qwen3-Embedding's rule). A
  malformed file, or a pooling mode Tandem does not implement (max, weighted mean), is a `ModelLoadError`
  naming the file.
- `pool(hidden [B, T, H], lengths [B])` → [B, H] float32: rows of `hidden` are right-padded, so only each row's
  first `lengths[b]` positions count (causal attention: padding after a token never changes it).
- `truncate(vectors [B, H], dimensions)` keeps the first `dimensions` components (Matryoshka, as OpenAI's
  `dimensions`), renormalized when the pooling normalizes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from inference_svc.errors import ModelLoadError

MODES = ("last", "mean", "cls")
_ST_POOLING = "sentence_transformers.models.Pooling"
_ST_NORMALIZE = "sentence_transformers.models.Normalize"
_MODE_KEYS = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls"}
_UNSERVED_KEYS = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")


@dataclass(frozen=True)
class Pooling:
    mode: str = "last"
    """last (the prompt's last token), mean (over the prompt's tokens) or cls (its first token)."""
    normalize: bool = True
    """L2-normalize the pooled vector (and again after `dimensions` truncation)."""
    source: str = "default for a causal LM"
    """Where the rule came from (reported by the API)."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"pooling mode must be one of {MODES}, got {self.mode!r}")

    @classmethod
    def from_folder(cls, folder: str | Path) -> Pooling:
        folder = Path(folder)
        modules_file = folder / "modules.json"
        if not modules_file.is_file():
            return cls()
        modules = _read(modules_file)
        if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
            raise ModelLoadError(f"{modules_file}: must be a list of module objects")
        types = [str(m.get("type", "")) for m in modules]
        normalize = _ST_NORMALIZE in types
        pooling = [m for m in modules if m.get("type") == _ST_POOLING]
        if not pooling:
            return cls("last", normalize, f"{modules_file} (no Pooling module: last token)")
        config_file = folder / str(pooling[0].get("path", "")) / "config.json"
        config = _read(config_file)
        if not isinstance(config, dict):
            raise ModelLoadError(f"{config_file}: must be a JSON object")
        chosen = [mode for key, mode in _MODE_KEYS.items() if config.get(key)]
        unserved = [key for key in _UNSERVED_KEYS if config.get(key)]
        if unserved or len(chosen) != 1:
            raise ModelLoadError(
                f"{config_file}: Tandem pools by exactly one of {', '.join(_MODE_KEYS)}; this folder sets "
                f"{', '.join(unserved + [k for k in _MODE_KEYS if config.get(k)]) or 'none'}"
            )
        return cls(chosen[0], normalize, str(config_file))

    def pool(self, hidden: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """[B, T, H] right-padded hidden states and [B] lengths → [B, H] float32 vectors."""
        hidden = hidden.float()
        if self.mode == "last":
            out = hidden[torch.arange(hidden.shape[0], device=hidden.device), lengths - 1]  # [B, H]
        elif self.mode == "cls":
            out = hidden[:, 0]
        else:
            keep = torch.arange(hidden.shape[1], device=hidden.device)[None, :] < lengths[:, None]  # [B, T]
            out = (hidden * keep[..., None]).sum(1) / lengths[:, None].to(hidden.dtype)
        return torch.nn.functional.normalize(out, dim=-1) if self.normalize else out

    def truncate(self, vectors: torch.Tensor, dimensions: int) -> torch.Tensor:
        """The first `dimensions` components of each [B, H] row, renormalized when this pooling normalizes."""
        cut = vectors[:, :dimensions]
        return torch.nn.functional.normalize(cut, dim=-1) if self.normalize else cut


def _read(path: Path) -> object:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{path}: cannot be read as JSON ({exc})") from None
