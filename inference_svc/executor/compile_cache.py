"""Compiled decode steps kept between starts: torch's compile artifacts, saved after a compile and loaded before the
next one, keyed by everything the compiled graphs depend on.

Contract:
- `cache_key(bundle_path, config, native, dtype)` is the dict of what a compiled step depends on: the model and any
  draft model (config.json and the weights' checksums, or names and sizes without a Tandem manifest), the served
  dtype, the flags that change the graph or which graphs the warm-up compiles (quantization, group size, int4
  kernel, Tandem's CPU kernels on or off, the speculative default, the decode runner), torch's intra-op thread
  count (inductor generates its CPU kernels for it) and whether the kernels read the count at each call instead
  (`dynamic_threads`: the thread governor's steps), Tandem's graph code (a hash of the decoder's and the compiled
  wrapper's source), torch's and Python's versions, and the CPU (model name and instruction-set flags from
  /proc/cpuinfo). `digest(key)` names its entry.
- An entry is a folder `<cache dir>/<digest>/` holding `torch/`, a torch inductor cache folder (the FX graphs,
  AOTAutograd entries, generated sources and their compiled libraries for this key's graphs, and under
  `tandem-packages/<decoder>/<KV layout>/` each decoder's saved dynamo packages: `shared_model.compiled`,
  `engine.loader.warm_up`), and `manifest.json`
  (the key, and every file of `torch/` with its size and SHA-256). It is written into a temporary sibling and
  renamed into place: a reader sees a whole entry or none.
- `CompileCache(dirs, save_dir, key)`: `with cache.compiling():` around the warm-up compile. It looks in each
  folder in order (a bundle's own `compile_cache/`, then `--compile-cache`) for an entry whose manifest holds
  exactly this key and whose files all match it, copies its `torch/` into a private working folder, and points
  torch's inductor caches there for the compile (so every graph is found compiled, its libraries included: no C++
  compiler runs); without one the working folder starts empty and the compile fills it. `packages(decoder)` is
  the folder in it the engine hands each decoder ('target', 'draft') for its saved packages: with them a warm
  start installs the traced graphs instead of tracing them (no dynamo, no AOTAutograd). Another key is a miss,
  never a load; a torn, corrupt or unreadable entry is logged, reported in the choice and skipped, never an error.
  `finish(compiled)` saves the working folder as this key's entry into `save_dir` after a miss (or after a hit
  whose working folder changed, e.g. a package traced again in place of a damaged one: the entry then gains it),
  removes the working folder (every library is loaded by then), and returns the `compile_cache` choice: hit
  (where from, how many graphs dynamo traced: 0 when every one came from a package), or miss (saved where, or
  why not).
- The working folder lives in the temp folder, named with the process id (`WORK_PREFIX`). An exception out of the
  `compiling()` block removes it at once (`finish` may never come); a process stopped or killed mid-compile cannot,
  so each `compiling()` first removes the working folders of processes that no longer run (`sweep_orphans`):
  restarts during compiles do not fill the disk (once a folder has been unchanged for `ORPHAN_AGE_S`).
- The cache folder is bounded (`EngineConfig.compile_cache_max_mb`): after each start's `finish`, `evict` removes
  its least recently used entries (a hit marks its entry used) until the folder fits, never this start's entry, and
  the half-written entries of saves that were killed. A bundle's own folder (`tandem warm`) is never evicted.
- No environment switch: the folder is `EngineConfig.compile_cache` ('off': torch's own caches only, untouched).
  Torch's inductor cache folder is pointed at the working folder only for the compile, and put back after it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import platform
import shutil
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

import tandem_native
from inference_svc.executor.plan import Choice
from shared_model.bundle import COMPILE_CACHE_FOLDER

TORCH_FOLDER = "torch"
PACKAGES_FOLDER = "tandem-packages"
"""Inside the torch folder: each decoder's saved dynamo packages (`shared_model.compiled`)."""
MANIFEST = "manifest.json"
WORK_PREFIX = "tandem-compile-"
"""A compile's private working folder in the temp folder: WORK_PREFIX<digest>-<pid>-<random> (`sweep_orphans`)."""
ORPHAN_AGE_S = 600.0
"""A working folder of an ended process is removed once unchanged this long (longer than any compile here)."""
BUNDLE_FOLDER = COMPILE_CACHE_FOLDER
"""The folder inside a bundle where `tandem warm` writes entries (read before `--compile-cache`)."""
FORMAT = 2
_GRAPH_SOURCES = (
    "shared_model/serving_model.py",
    "shared_model/compiled.py",
    "shared_model/quantize.py",
    "shared_model/attention.py",
    "shared_model/model.py",
    "inference_svc/attention/native_cpu.py",
    "shared_model/native_decode.py",  # the steps the runner takes need no graph
    "inference_svc/engine/loader.py",  # which steps the warm-up traces
)
"""Tandem's files whose code the compiled graphs trace or call (a change to them makes every old entry a miss)."""
log = logging.getLogger(__name__)


def cache_key(
    bundle_path: str | Path, config: object, native: bool, dtype: torch.dtype, dynamic_threads: bool = False
) -> dict[str, str]:
    """What a compiled step depends on (see the module docstring); every value a string. `dynamic_threads`: the
    graphs follow the thread count of each call (`shared_model.compiled`; the thread governor's steps)."""
    draft = getattr(config, "draft_model_path", None)
    return {
        "format": str(FORMAT),
        "model": model_fingerprint(Path(bundle_path)),
        "draft": "none" if draft is None else model_fingerprint(Path(draft)),  # its graphs are compiled too
        "dtype": str(dtype).removeprefix("torch."),
        "quantization": f"{config.quantization}/{config.quantization_group_size}/{config.int4_kernel}",  # type: ignore[attr-defined]
        "cpu_kernels": "tandem" if native else "off",
        "native_build": tandem_native.build_dir().name if native else "none",  # the custom ops the graphs call
        "speculative": str(getattr(config, "speculative", "off")),  # picks the projections' row table
        "decode_runner": str(getattr(config, "decode_runner", "auto")),  # its steps' graphs are not compiled
        "threads": str(torch.get_num_threads()),  # inductor's CPU kernels are generated for this many threads
        "dynamic_threads": "on" if dynamic_threads else "off",  # ... or read the count at each call, unguarded
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


def _counts() -> tuple[int, int, int]:
    """(inductor graphs found in torch's caches, graphs compiled anew, graphs dynamo traced) so far in this
    process."""
    from torch._dynamo.utils import counters

    c = counters["inductor"]
    return (
        c["fxgraph_cache_hit"],
        c["fxgraph_cache_miss"] + c["fxgraph_cache_bypass"],
        counters["stats"]["unique_graphs"],
    )


def _files(folder: Path) -> dict[str, dict[str, object]]:
    """{relative path: {bytes, sha256}} of the regular files under `folder` (torch's lock files left out)."""
    out: dict[str, dict[str, object]] = {}
    for path in sorted(folder.rglob("*")):
        rel = path.relative_to(folder).as_posix()
        if path.is_file() and not path.is_symlink() and not rel.startswith("locks/") and not rel.endswith(".lock"):
            data = path.read_bytes()
            out[rel] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    return out


@dataclass
class CompileCache:
    """One engine's use of the compile cache (see the module docstring)."""

    dirs: Sequence[Path]
    """Folders read, in order."""
    save_dir: Path | None
    """Where a miss is saved (None: not saved)."""
    key: dict[str, str]
    max_bytes: int | None = None
    """`save_dir`'s bound: least recently used entries are evicted past it (None: never; a bundle's folder)."""
    loaded_from: Path | None = None
    problems: list[str] = field(default_factory=list)
    work: Path | None = None
    """The private torch cache folder of this compile."""
    _before: tuple[int, int, int] = (0, 0, 0)
    _loaded_files: dict | None = None

    @property
    def name(self) -> str:
        return digest(self.key)

    @contextlib.contextmanager
    def compiling(self) -> Iterator[None]:
        """Load a matching entry (or start empty) and point torch's inductor caches at the working folder."""
        from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

        if not self.dirs and self.save_dir is None:  # 'off': torch's own caches, as without Tandem's
            yield
            return
        swept = sweep_orphans(Path(tempfile.gettempdir()))
        if swept:
            log.info("compile cache: removed %d working folder(s) of processes that ended mid-compile", swept)
        self.work = Path(tempfile.mkdtemp(prefix=f"{WORK_PREFIX}{self.name}-{os.getpid()}-"))
        try:
            self.load()
            self._before = _counts()
            with temporary_cache_dir(str(self.work)):
                yield
        except BaseException:  # `finish` may never come (the start failed, was stopped): the folder goes now
            shutil.rmtree(self.work, ignore_errors=True)
            raise

    def packages(self, decoder: str) -> Path | None:
        """The folder of `decoder`'s saved dynamo packages ('target', 'draft') in the working folder (None: 'off')."""
        return None if self.work is None else self.work / PACKAGES_FOLDER / decoder

    def load(self) -> bool:
        """Copy the first matching entry's torch folder into the working folder; whether one was."""
        assert self.work is not None
        for folder in self.dirs:
            entry = folder / self.name
            if not entry.exists():
                continue
            try:
                listed = self._listed(entry)
                shutil.copytree(entry / TORCH_FOLDER, self.work, dirs_exist_ok=True)
                _verify(_files(self.work), listed)  # the copy itself: what the compile will read
            except Exception as exc:  # a corrupt entry: reported and skipped, never fatal
                self.problems.append(f"{entry}: {type(exc).__name__}: {exc}")
                log.warning("compile cache: ignoring the entry %s (%s: %s)", entry, type(exc).__name__, exc)
                shutil.rmtree(self.work, ignore_errors=True)
                self.work.mkdir()
                continue
            self.loaded_from = entry
            self._loaded_files = listed
            return True
        return False

    def _listed(self, entry: Path) -> dict:
        """The entry's file list, once its manifest is known to hold exactly this key."""
        manifest = json.loads((entry / MANIFEST).read_text())
        if not isinstance(manifest, dict) or manifest.get("key") != self.key:
            found = manifest.get("key", {}) if isinstance(manifest, dict) else {}
            differ = sorted(k for k in self.key if not isinstance(found, dict) or found.get(k) != self.key[k])
            raise ValueError(f"another key ({', '.join(differ) or 'format'} differ)")
        listed = manifest.get("files")
        if not isinstance(listed, dict) or not listed:
            raise ValueError(f"{MANIFEST} lists no files")
        return listed

    def finish(self, compiled: bool) -> Choice:
        """After the warm-up compile: save on a miss, drop the working folder, keep the folder under its bound, and
        the `compile_cache` choice."""
        return self._bounded(self._finish(compiled))

    def _finish(self, compiled: bool) -> Choice:
        hits, misses, traced = (a - b for a, b in zip(_counts(), self._before, strict=True))
        notes = f" ({'; '.join(self.problems)})" if self.problems else ""
        try:
            if not compiled:
                return Choice("compile_cache", "unused", f"the step was not compiled{notes}")
            if self.loaded_from is not None:
                what = f"{traced} graphs traced" + (f" ({hits} found compiled, {misses} compiled anew)" if traced else
                                                    " (every graph loaded from its saved package)")  # fmt: skip
                changed = self.work is not None and _files(self.work) != self._loaded_files
                if changed and self.save_dir is not None and self.work is not None:
                    try:  # the entry, with what it lacked (e.g. a package traced after a damaged one)
                        what += f"; the entry updated in {save_entry(self.save_dir, self.key, self.work)}"
                    except OSError as exc:
                        what += f" (the entry not updated: {exc})"
                return Choice("compile_cache", "hit", f"{self.name} from {self.loaded_from.parent}: {what}{notes}")
            if self.save_dir is None:
                return Choice("compile_cache", "miss", f"{self.name}: no entry; not saved{notes}")
            try:
                assert self.work is not None
                where = save_entry(self.save_dir, self.key, self.work)
            except OSError as exc:
                log.warning("compile cache: cannot save into %s (%s)", self.save_dir, exc)
                why = f"{self.name}: no entry{notes}; cannot save into {self.save_dir}: {exc}"
                return Choice("compile_cache", "miss", why)
            return Choice("compile_cache", "miss", f"{self.name}: no entry{notes}; compiled and saved to {where}")
        finally:
            if self.work is not None:
                shutil.rmtree(self.work, ignore_errors=True)

    def _bounded(self, choice: Choice) -> Choice:
        """Mark a hit's entry used and keep `save_dir` under `max_bytes` (`evict`); the choice, eviction noted."""
        if self.save_dir is None or self.max_bytes is None or choice.value == "unused":
            return choice
        if self.loaded_from is not None and self.loaded_from.parent == self.save_dir:
            with contextlib.suppress(OSError):
                os.utime(self.loaded_from)  # used now: the last to go
        removed, freed = evict(self.save_dir, self.max_bytes, keep=self.name)
        if not removed:
            return choice
        mb = self.max_bytes / 2**20
        note = f"; evicted {removed} least recently used entries ({freed / 2**20:.0f} MB) to stay under {mb:.0f} MB"
        return Choice(choice.lever, choice.value, choice.reason + note)


def entry_folders(folder: Path) -> list[Path]:
    """The entries under `folder`: sub-folders named as `digest` names them (20 hex digits), links left out."""
    try:
        children = list(folder.iterdir())
    except OSError:
        return []
    hexdigits = set("0123456789abcdef")
    return [
        p for p in children
        if len(p.name) == 20 and set(p.name) <= hexdigits and p.is_dir() and not p.is_symlink()
    ]  # fmt: skip


def folder_bytes(folder: Path) -> int:
    """Bytes of the regular files under `folder` (0 where unreadable)."""
    total = 0
    for root, _dirs, files in os.walk(folder):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, name)).st_size
    return total


def evict(folder: Path, max_bytes: int, keep: str, now: float | None = None) -> tuple[int, int]:
    """Keep the cache `folder` under `max_bytes`: remove the temporary folders of saves that never finished
    (`.<digest>-*`, unchanged for `ORPHAN_AGE_S`), then its entries least recently used first (an entry folder's
    mtime: set when saved and at each hit), never the entry named `keep`, until the rest fit. Nothing but entry
    folders and those temporaries is counted or removed. Returns (entries removed, bytes freed); never raises."""
    now = time.time() if now is None else now
    freed = removed = 0
    with contextlib.suppress(OSError):
        for tmp in folder.glob(".*-*"):
            name = tmp.name[1:].split("-")[0]
            st = tmp.lstat()
            if len(name) == 20 and tmp.is_dir() and not tmp.is_symlink() and now - st.st_mtime >= ORPHAN_AGE_S:
                freed += folder_bytes(tmp)
                shutil.rmtree(tmp, ignore_errors=True)
    entries = []
    for entry in entry_folders(folder):
        with contextlib.suppress(OSError):
            entries.append((entry.stat().st_mtime, entry, folder_bytes(entry)))
    total = sum(size for _, _, size in entries)
    for _, entry, size in sorted(entries, key=lambda e: (e[0], e[1].name)):
        if total <= max_bytes:
            break
        if entry.name == keep:
            continue
        shutil.rmtree(entry, ignore_errors=True)
        if not entry.exists():
            total -= size
            freed += size
            removed += 1
    return removed, freed


def sweep_orphans(folder: Path, now: float | None = None) -> int:
    """Remove the working folders (`WORK_PREFIX<digest>-<pid>-*`) under `folder` of processes that no longer run:
    a start stopped by a signal, or killed, while it compiled leaves its folder behind (a daemon thread's `finally`
    never runs at exit; SIGKILL runs nothing). Folders of live processes, of another user, named otherwise, or
    changed in the last `ORPHAN_AGE_S` seconds (a process in another PID namespace sharing this temp folder looks
    ended from here) are left alone. Returns how many were removed; never raises."""
    now = time.time() if now is None else now
    removed = 0
    try:
        candidates = list(folder.glob(f"{WORK_PREFIX}*"))
    except OSError:
        return 0
    for path in candidates:
        parts = path.name[len(WORK_PREFIX) :].split("-")
        if len(parts) != 3 or not parts[1].isdigit() or int(parts[1]) == os.getpid():
            continue
        try:
            st = path.lstat()
            if st.st_uid != os.getuid() or not path.is_dir() or path.is_symlink() or now - st.st_mtime < ORPHAN_AGE_S:
                continue
            os.kill(int(parts[1]), 0)  # the owner still runs (or the pid was reused): keep
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
            removed += not path.exists()
        except OSError:  # another user's process (EPERM), or the folder went meanwhile
            continue
    return removed


def _verify(found: dict, listed: dict) -> None:
    if found != listed:
        bad = sorted(set(listed) ^ set(found) | {n for n in listed if found.get(n) != listed[n]})
        raise ValueError(
            f"{len(bad)} file(s) differ from the manifest (size or SHA-256), e.g. {bad[0]}: torn or corrupt"
        )


def save_entry(folder: Path, key: dict[str, str], torch_dir: Path) -> Path:
    """Write `torch_dir` (a torch inductor cache folder) as the entry of `key` under `folder`, atomically; its path.
    OSError when it holds nothing or cannot be written."""
    files = _files(torch_dir)
    if not files:
        raise OSError(f"the compile left nothing in {torch_dir}")
    folder.mkdir(parents=True, exist_ok=True)
    entry = folder / digest(key)
    tmp = Path(tempfile.mkdtemp(prefix=f".{entry.name}-", dir=folder))
    try:
        for rel in files:
            (tmp / TORCH_FOLDER / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(torch_dir / rel, tmp / TORCH_FOLDER / rel)
        if _files(tmp / TORCH_FOLDER) != files:
            raise OSError(f"{torch_dir} changed while it was being saved")
        manifest = {"key": key, "files": files}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
        if entry.exists():
            shutil.rmtree(entry)
        os.replace(tmp, entry)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return entry


def open_cache(setting: str, bundle_path: str | Path, key: dict[str, str], max_mb: int | None = None) -> CompileCache:
    """The cache an engine uses: `setting` is `EngineConfig.compile_cache` (a folder, '~' expanded, or 'off'). The
    bundle's own `compile_cache/` is read first; a miss is saved into `setting`'s folder (`tandem warm` names the
    bundle's own folder there), which is kept under `max_mb` (`EngineConfig.compile_cache_max_mb`; None: unbounded;
    a bundle's own folder never is: what `tandem warm` stored there ships with it)."""
    if setting == "off":
        return CompileCache((), None, key)
    own = Path(os.path.expanduser(setting))
    bundle_dir = bundle_cache_dir(bundle_path)
    if own.resolve() == bundle_dir.resolve():
        return CompileCache((bundle_dir,), own, key)
    return CompileCache((bundle_dir, own), own, key, None if max_mb is None else max_mb * 2**20)


def unused() -> Choice:
    return Choice("compile_cache", "unused", "the step is not compiled")
