"""Compiled decode steps kept between starts: torch's compile artifacts, saved after a compile and loaded before the
next one, keyed by everything the compiled graphs depend on.

Contract:
- `cache_key(bundle_path, config, native, dtype)` is the dict of what a compiled step depends on: the model and any
  draft model (config.json and the weights' checksums, or names and sizes without a Tandem manifest), the served
  dtype, the flags that change the graph (quantization, group size, int4 kernel, Tandem's CPU kernels on or
  off), torch's intra-op thread count (inductor generates its CPU kernels for it), Tandem's graph code (a hash of
  the decoder's and the compiled wrapper's source), torch's and Python's versions, and the CPU (model name and
  instruction-set flags from /proc/cpuinfo). `digest(key)` names its entry.
- An entry is a folder `<cache dir>/<digest>/` holding `manifest.json` (the key, the artifacts' SHA-256 and size)
  and `artifacts.bin` (`torch.compiler.save_cache_artifacts()`). It is written into a temporary sibling and renamed
  into place: a reader sees a whole entry or none.
- `CompileCache(dirs, key)`: `load()` before the compile looks in each folder in order (a bundle's own
  `compile_cache/`, then `--compile-cache`) and loads the first entry whose manifest holds exactly this key and
  whose artifacts match their checksum (`torch.compiler.load_cache_artifacts` fills torch's own caches, so the
  compile that follows finds its graphs there). Another key is a miss, never a load; a torn, corrupt or unreadable
  entry is logged, reported in the choice and skipped, never an error. `finish()` after the compile saves this
  process's artifacts into the writable folder (`save_dir`) when nothing was loaded, and returns the
  `compile_cache` choice: hit (where from, and how many graphs torch then found in its caches), or miss (saved
  where, or why not).
- Nothing here reads an environment variable: the folder is `EngineConfig.compile_cache` ('off': no cache).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from inference_svc.executor.plan import Choice
from shared_model.bundle import COMPILE_CACHE_FOLDER

ARTIFACTS = "artifacts.bin"
MANIFEST = "manifest.json"
BUNDLE_FOLDER = COMPILE_CACHE_FOLDER
"""The folder inside a bundle where `tandem warm` writes entries (read before `--compile-cache`)."""
FORMAT = 1
_GRAPH_SOURCES = (
    "shared_model/serving_model.py",
    "shared_model/compiled.py",
    "shared_model/quantize.py",
    "shared_model/attention.py",
    "shared_model/model.py",
    "inference_svc/attention/native_cpu.py",
)
"""Tandem's files whose code the compiled graphs trace or call (a change to them makes every old entry a miss)."""
log = logging.getLogger(__name__)


def cache_key(bundle_path: str | Path, config: object, native: bool, dtype: torch.dtype) -> dict[str, str]:
    """What a compiled step depends on (see the module docstring); every value a string."""
    draft = getattr(config, "draft_model_path", None)
    return {
        "format": str(FORMAT),
        "model": model_fingerprint(Path(bundle_path)),
        "draft": "none" if draft is None else model_fingerprint(Path(draft)),  # its graphs are compiled too
        "dtype": str(dtype).removeprefix("torch."),
        "quantization": f"{config.quantization}/{config.quantization_group_size}/{config.int4_kernel}",  # type: ignore[attr-defined]
        "cpu_kernels": "tandem" if native else "off",
        "threads": str(torch.get_num_threads()),  # inductor's CPU kernels are generated for this many threads
        "graph_code": _code_hash(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu": cpu_identity(),
    }


def digest(key: dict[str, str]) -> str:
    """The entry's folder name: 20 hex digits of the key's SHA-256."""
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]


def model_fingerprint(folder: Path) -> str:
    """SHA-256 of config.json and the weights' checksums from tandem_bundle.json (names and sizes without one)."""
    h = hashlib.sha256((folder / "config.json").read_bytes())
    try:
        files = json.loads((folder / "tandem_bundle.json").read_text())["files"]
        weights = sorted((n, e["sha256"]) for n, e in files.items() if n.endswith(".safetensors"))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        weights = sorted((p.name, str(p.stat().st_size)) for p in folder.glob("*.safetensors"))
    h.update(json.dumps(weights).encode())
    return h.hexdigest()[:32]


def cpu_identity(cpuinfo: str | Path = "/proc/cpuinfo") -> str:
    """'model name | sorted flags' of the first CPU (platform.machine() where /proc/cpuinfo is unreadable)."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return platform.machine() or "unknown"
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            break  # the first processor's block
        name, _, value = line.partition(":")
        fields[name.strip()] = value.strip()
    flags = " ".join(sorted(fields.get("flags", "").split()))
    return f"{fields.get('model name', platform.machine())} | {hashlib.sha256(flags.encode()).hexdigest()[:16]}"


def _code_hash() -> str:
    root = Path(__file__).resolve().parents[2]
    h = hashlib.sha256()
    for rel in _GRAPH_SOURCES:
        path = root / rel
        h.update(rel.encode() + (path.read_bytes() if path.exists() else b"-"))
    return h.hexdigest()[:16]


def bundle_cache_dir(bundle_path: str | Path) -> Path:
    return Path(bundle_path) / BUNDLE_FOLDER


def _counts() -> tuple[int, int]:
    """(inductor graphs found in torch's caches, graphs compiled anew) so far in this process."""
    from torch._dynamo.utils import counters

    c = counters["inductor"]
    return c["fxgraph_cache_hit"], c["fxgraph_cache_miss"] + c["fxgraph_cache_bypass"]


@dataclass
class CompileCache:
    """One engine's use of the compile cache (see the module docstring)."""

    dirs: Sequence[Path]
    """Folders read, in order."""
    save_dir: Path | None
    """Where a miss is saved (None: not saved)."""
    key: dict[str, str]
    loaded_from: Path | None = None
    problems: list[str] = field(default_factory=list)
    _before: tuple[int, int] = (0, 0)

    @property
    def name(self) -> str:
        return digest(self.key)

    def load(self) -> bool:
        """Load the first matching entry's artifacts into torch's caches; whether one was loaded."""
        self._before = _counts()
        for folder in self.dirs:
            entry = folder / self.name
            if not (entry / MANIFEST).exists() and not (entry / ARTIFACTS).exists():
                continue
            try:
                data = self._read(entry)
                if data is None:
                    continue
                if torch.compiler.load_cache_artifacts(data) is None:  # torch logs why, and loads nothing
                    raise ValueError("torch could not read the artifacts")
            except Exception as exc:  # a corrupt entry: reported and skipped, never fatal
                self.problems.append(f"{entry}: {type(exc).__name__}: {exc}")
                log.warning("compile cache: ignoring the entry %s (%s: %s)", entry, type(exc).__name__, exc)
                continue
            self.loaded_from = entry
            self._before = _counts()
            return True
        return False

    def _read(self, entry: Path) -> bytes | None:
        manifest = json.loads((entry / MANIFEST).read_text())
        if not isinstance(manifest, dict) or manifest.get("key") != self.key:
            differ = sorted(k for k in self.key if not isinstance(manifest, dict)
                            or manifest.get("key", {}).get(k) != self.key[k])  # fmt: skip
            self.problems.append(f"{entry}: another key ({', '.join(differ) or 'format'} differ)")
            return None
        data = (entry / ARTIFACTS).read_bytes()
        if len(data) != manifest.get("bytes") or hashlib.sha256(data).hexdigest() != manifest.get("sha256"):
            raise ValueError(f"{ARTIFACTS} does not match its manifest (size or SHA-256): torn or corrupt")
        return data

    def finish(self, compiled: bool) -> Choice:
        """After the warm-up compile: save on a miss, and the `compile_cache` choice."""
        hits, misses = (a - b for a, b in zip(_counts(), self._before, strict=True))
        notes = f" ({'; '.join(self.problems)})" if self.problems else ""
        if not compiled:
            return Choice("compile_cache", "unused", f"the step was not compiled{notes}")
        if self.loaded_from is not None:
            anew = f", {misses} compiled anew" if misses else ""
            return Choice("compile_cache", "hit", f"{self.name} from {self.loaded_from.parent}: {hits} graphs from "
                          f"torch's caches{anew}{notes}")  # fmt: skip
        if self.save_dir is None:
            return Choice("compile_cache", "miss", f"{self.name}: no entry; not saved{notes}")
        try:
            where = save_entry(self.save_dir, self.key)
        except OSError as exc:
            log.warning("compile cache: cannot save into %s (%s)", self.save_dir, exc)
            return Choice("compile_cache", "miss", f"{self.name}: no entry; cannot save into {self.save_dir}: {exc}")
        return Choice("compile_cache", "miss", f"{self.name}: no entry{notes}; compiled and saved to {where}")


def save_entry(folder: Path, key: dict[str, str]) -> Path:
    """Write this process's compile artifacts as the entry of `key` under `folder` (atomically); its path.
    OSError when there is nothing to save or it cannot be written."""
    saved = torch.compiler.save_cache_artifacts()
    if saved is None or not saved[0]:
        raise OSError("torch recorded no compile artifacts in this process")
    data = saved[0]
    folder.mkdir(parents=True, exist_ok=True)
    entry = folder / digest(key)
    tmp = Path(tempfile.mkdtemp(prefix=f".{entry.name}-", dir=folder))
    try:
        (tmp / ARTIFACTS).write_bytes(data)
        manifest = {"key": key, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
        if entry.exists():
            shutil.rmtree(entry)
        os.replace(tmp, entry)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return entry


def open_cache(setting: str, bundle_path: str | Path, key: dict[str, str]) -> CompileCache:
    """The cache an engine uses: `setting` is `EngineConfig.compile_cache` (a folder, '~' expanded, or 'off'). The
    bundle's own `compile_cache/` is read first; a miss is saved into `setting`'s folder (`tandem warm` names the
    bundle's own folder there)."""
    if setting == "off":
        return CompileCache((), None, key)
    own = Path(os.path.expanduser(setting))
    bundle_dir = bundle_cache_dir(bundle_path)
    dirs = (bundle_dir,) if own.resolve() == bundle_dir.resolve() else (bundle_dir, own)
    return CompileCache(dirs, own, key)


def unused() -> Choice:
    return Choice("compile_cache", "unused", "the step is not compiled")
