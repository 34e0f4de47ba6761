"""Warm starts (issue 33, goal 4): compiled decode steps saved after a compile and loaded at the next start
(`inference_svc.executor.compile_cache`). An entry of another key is a miss, never a load; a corrupt entry is
reported and skipped, never a crash; a warm start (from the cache folder or from the bundle's own folder that
`tandem warm` writes) serves the same bits as the cold start it was saved from."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tandem_native
from inference_svc.engine import EngineConfig
from inference_svc.executor import compile_cache
from inference_svc.executor.compile_cache import MANIFEST, TORCH_FOLDER, CompileCache, cache_key, digest
from shared_model.bundle import save_bundle
from shared_model.compiled import compiler_available

REPO = Path(__file__).resolve().parents[3]
CAN_COMPILE, WHY_NOT = compiler_available(torch.device("cpu"))


def _key(bundle: Path, **overrides: str) -> dict[str, str]:
    key = cache_key(bundle, EngineConfig(), native=False, dtype=torch.float32)
    return {**key, **overrides}


def _plant(folder: Path, key: dict[str, str], files: dict[str, bytes], *, name: str | None = None) -> Path:
    """An entry of `key` whose torch folder holds `files`, listed truly in its manifest."""
    entry = folder / (name or digest(key))
    for rel, data in files.items():
        (entry / TORCH_FOLDER / rel).parent.mkdir(parents=True, exist_ok=True)
        (entry / TORCH_FOLDER / rel).write_bytes(data)
    listed = {rel: {"bytes": len(d), "sha256": hashlib.sha256(d).hexdigest()} for rel, d in files.items()}
    (entry / MANIFEST).write_text(json.dumps({"key": key, "files": listed}))
    return entry


def _open(cache: CompileCache) -> CompileCache:
    with cache.compiling():
        pass
    return cache


def test_the_key_names_what_the_graphs_depend_on(qwen3_dir: Path) -> None:
    key = _key(qwen3_dir)
    assert key["torch"] == torch.__version__ and key["dtype"] == "float32" and key["cpu_kernels"] == "off"
    assert " | " in key["cpu"]  # the CPU model and a hash of its flags
    for field, value in [("torch", "0.0.0"), ("cpu", "Other CPU | 0"), ("model", "x"), ("dtype", "bfloat16")]:
        assert digest(_key(qwen3_dir, **{field: value})) != digest(key), field
    assert cache_key(qwen3_dir, EngineConfig(quantization="int8"), False, torch.float32) != key
    assert cache_key(qwen3_dir, EngineConfig(speculative="ngram"), False, torch.float32) != key  # the row table
    if tandem_native.available():  # the custom ops' library is part of what a graph calls
        assert (
            cache_key(qwen3_dir, EngineConfig(), True, torch.float32)["native_build"] == tandem_native.build_dir().name
        )


def test_an_entry_of_another_key_is_a_miss_not_a_load(qwen3_dir: Path, tmp_path: Path) -> None:
    key = _key(qwen3_dir)
    other = _key(qwen3_dir, torch="0.0.0+other", cpu="Other CPU | 0")
    _plant(tmp_path, other, {"fxgraph/a": b"never loaded"})  # under its own name: this key never looks there
    # and one placed under this key's name (copied by hand, or a digest collision): its manifest tells them apart
    _plant(tmp_path, other, {"fxgraph/a": b"never loaded either"}, name=digest(key))
    cache = _open(CompileCache([tmp_path], None, key))
    assert cache.loaded_from is None
    assert any("another key (cpu, torch differ)" in p for p in cache.problems), cache.problems
    assert cache.finish(compiled=True).value == "miss"


def test_a_matching_entry_is_copied_for_the_compile_and_the_copy_removed(qwen3_dir: Path, tmp_path: Path) -> None:
    key = _key(qwen3_dir)
    _plant(tmp_path, key, {"fxgraph/a/b": b"graph", "ab/c.so": b"library"})
    cache = CompileCache([tmp_path], None, key)
    with cache.compiling():
        assert cache.work is not None and os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(cache.work)
        assert (cache.work / "ab/c.so").read_bytes() == b"library"
    assert os.environ.get("TORCHINDUCTOR_CACHE_DIR") != str(cache.work)  # put back
    choice = cache.finish(compiled=True)
    assert choice.value == "hit" and cache.loaded_from == tmp_path / digest(key) and not cache.work.exists()


def test_a_compile_that_raises_leaves_no_working_folder(qwen3_dir: Path, tmp_path: Path) -> None:
    cache = CompileCache([tmp_path], tmp_path, _key(qwen3_dir))
    with pytest.raises(KeyboardInterrupt), cache.compiling():  # a start stopped mid-compile: no `finish` follows
        assert cache.work is not None and cache.work.is_dir()
        assert cache.work.name.startswith(f"{compile_cache.WORK_PREFIX}{cache.name}-{os.getpid()}-")
        raise KeyboardInterrupt
    assert not cache.work.exists()
    assert os.environ.get("TORCHINDUCTOR_CACHE_DIR") != str(cache.work)


def test_working_folders_of_processes_that_ended_are_swept_and_no_other(tmp_path: Path) -> None:
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                           check=True, timeout=60)  # fmt: skip
    dead, live = int(ended.stdout), os.getppid()  # a process that has exited; one that runs (this one's parent)
    prefix = compile_cache.WORK_PREFIX
    orphan = tmp_path / f"{prefix}{'a' * 20}-{dead}-x1"
    (orphan / "fxgraph").mkdir(parents=True)
    (orphan / "fxgraph" / "graph").write_bytes(b"left by a killed start")
    kept = [
        tmp_path / f"{prefix}{'b' * 20}-{live}-x2",  # its owner runs
        tmp_path / f"{prefix}{'c' * 20}-{os.getpid()}-x3",  # this process's own
        tmp_path / f"{prefix}unrelated",  # named otherwise
        tmp_path / "other-folder",
    ]
    for folder in kept:
        folder.mkdir()
    plain = tmp_path / f"{prefix}{'d' * 20}-{dead}-x4"
    plain.write_text("a file, not a working folder")
    later = orphan.stat().st_mtime + compile_cache.ORPHAN_AGE_S
    assert compile_cache.sweep_orphans(tmp_path, now=later - 1) == 0  # changed too recently: perhaps still in use
    assert compile_cache.sweep_orphans(tmp_path, now=later + 1) == 1
    assert not orphan.exists() and plain.exists() and all(folder.is_dir() for folder in kept)
    assert compile_cache.sweep_orphans(tmp_path, now=later + 1) == 0
    assert compile_cache.sweep_orphans(tmp_path / "missing") == 0  # never raises


@pytest.mark.parametrize("damage", ["checksum", "missing", "extra", "manifest", "no files"])
def test_a_corrupt_entry_is_reported_and_skipped(qwen3_dir: Path, tmp_path: Path, damage: str) -> None:
    key = _key(qwen3_dir)
    entry = _plant(tmp_path / "a", key, {"fxgraph/x": b"graph", "ab/c.so": b"library"})
    if damage == "checksum":  # torn or bit-flipped
        (entry / TORCH_FOLDER / "ab/c.so").write_bytes(b"librarz")
    elif damage == "missing":
        (entry / TORCH_FOLDER / "fxgraph/x").unlink()
    elif damage == "extra":
        (entry / TORCH_FOLDER / "ab/d.so").write_bytes(b"not listed")
    elif damage == "manifest":
        (entry / MANIFEST).write_text("{not json")
    else:
        (entry / MANIFEST).write_text(json.dumps({"key": key, "files": {}}))
    good = _plant(tmp_path / "b", key, {"fxgraph/x": b"graph"})  # the next folder's entry is sound
    cache = _open(CompileCache([tmp_path / "a", tmp_path / "b"], None, key))
    assert cache.loaded_from == good  # the corrupt one skipped, nothing of it copied
    assert len(cache.problems) == 1 and str(entry) in cache.problems[0]
    choice = cache.finish(compiled=True)
    assert choice.value == "hit" and cache.problems[0] in choice.reason


def test_the_bundle_folder_is_read_first_and_off_reads_nothing(qwen3_dir: Path, tmp_path: Path) -> None:
    key = _key(qwen3_dir)
    cache = compile_cache.open_cache(str(tmp_path / "c"), qwen3_dir, key)
    assert list(cache.dirs) == [qwen3_dir / "compile_cache", tmp_path / "c"] and cache.save_dir == tmp_path / "c"
    assert compile_cache.open_cache("off", qwen3_dir, key).dirs == ()
    into = compile_cache.open_cache(str(qwen3_dir / "compile_cache"), qwen3_dir, key)  # `tandem warm`
    assert list(into.dirs) == [qwen3_dir / "compile_cache"] and into.save_dir == qwen3_dir / "compile_cache"


def test_a_bundle_with_a_compile_cache_can_be_replaced(qwen3_dir: Path, tmp_path: Path) -> None:
    from shared_model.bundle import load_bundle

    loaded = load_bundle(qwen3_dir)
    bundle = save_bundle(tmp_path / "b", loaded.config, loaded.model, loaded.tokenizer)
    (bundle / "compile_cache" / "abc").mkdir(parents=True)
    save_bundle(bundle, loaded.config, loaded.model, loaded.tokenizer, overwrite=True)
    assert not (bundle / "compile_cache").exists()  # replaced with the weights it was compiled for


def _child(bundle: Path, cache: Path, torch_cache: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO), "TORCHINDUCTOR_CACHE_DIR": str(torch_cache)}  # torch's own, fresh
    cmd = [sys.executable, "-m", "tests.inference_svc.engine.compile_cache_child", str(bundle), str(cache)]
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _choice(run: dict, lever: str) -> dict:
    return next(c for c in run["plan"] if c["lever"] == lever)


@pytest.mark.slow
@pytest.mark.skipif(not CAN_COMPILE, reason=WHY_NOT)
def test_a_warm_start_serves_the_bits_of_the_cold_start(qwen3_dir: Path, tmp_path: Path) -> None:
    """Cold (a corrupt entry in the way: reported, compiled, saved), then `tandem warm` into the bundle, then a warm
    start in a process whose torch caches are empty and whose --compile-cache is empty: it loads the bundle's entry,
    traces nothing (every graph from its saved dynamo package), and its greedy tokens and logprobs are bitwise the
    cold start's."""
    bundle = shutil.copytree(qwen3_dir, tmp_path / "bundle")
    native, threads = tandem_native.status()[0], torch.get_num_threads()
    torch.set_num_threads(1)  # the children's --threads 1
    try:
        key = cache_key(bundle, EngineConfig(), native=native, dtype=torch.float32)
    finally:
        torch.set_num_threads(threads)
    torn = _plant(tmp_path / "cache", key, {"fxgraph/x": b"graph"})
    (torn / TORCH_FOLDER / "fxgraph/x").write_bytes(b"grap")

    cold = _child(bundle, tmp_path / "cache", tmp_path / "torch-cold")
    choice = _choice(cold, "compile_cache")
    assert _choice(cold, "compile")["value"] == "on"
    assert choice["value"] == "miss" and "differ from the manifest" in choice["reason"]
    assert f"saved to {tmp_path / 'cache' / digest(key)}" in choice["reason"]
    assert json.loads((tmp_path / "cache" / digest(key) / MANIFEST).read_text())["key"] == key

    env = {**os.environ, "PYTHONPATH": str(REPO), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "torch-cold")}
    warm_cmd = [sys.executable, "-m", "shared_model.cli", "warm", str(bundle), "--dtype", "float32",
                "--kv-cache-memory", "8MiB", "--threads", "1"]  # fmt: skip
    out = subprocess.run(warm_cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    assert f"saved to {bundle / 'compile_cache' / digest(key)}" in out.stdout

    warm = _child(bundle, tmp_path / "empty-cache", tmp_path / "torch-warm")
    choice = _choice(warm, "compile_cache")
    assert choice["value"] == "hit" and str(bundle / "compile_cache") in choice["reason"]
    assert "0 graphs traced (every graph loaded from its saved package)" in choice["reason"], choice["reason"]
    assert warm["tokens"] == cold["tokens"] and warm["logprobs"] == cold["logprobs"]
    assert warm["eager_calls"] == cold["eager_calls"] == 0
    assert not (tmp_path / "empty-cache").exists()  # a hit saves nothing


@pytest.mark.slow
@pytest.mark.skipif(not CAN_COMPILE, reason=WHY_NOT)
def test_saved_packages_load_without_tracing_and_anything_else_is_traced(tmp_path: Path) -> None:
    """A decoder's warm-up saves its graphs as packages; a fresh decoder of the same model installs them and dynamo
    traces nothing, with the same bits. Packages that do not cover a warm-up step, or that cannot be read, are
    dropped and the graphs traced (never an error, never an eager step)."""
    from torch._dynamo.utils import counters
    from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

    from shared_model.attention import CAUSAL
    from shared_model.compiled import PACKAGE_FILE, CompiledDecoder
    from shared_model.model import build_model
    from shared_model.serving_model import fuse_projections
    from tests.conftest import tiny_config

    model = fuse_projections(build_model(tiny_config(), seed=0).eval())
    packages = tmp_path / "packages"
    with torch.inference_mode(), temporary_cache_dir(str(tmp_path / "torch")):
        ids = torch.randint(3, model.config.vocab_size, (1, 9))
        pos = torch.arange(9)[None]

        def steps(decoder: CompiledDecoder, lone: bool = False) -> list[torch.Tensor]:
            rows = [9, 4, 1] if lone else [9, 4]  # fresh inputs each call, as the engine's (a trace marks its own)
            return [decoder.hidden_states(ids[:, :n].clone(), pos[:, :n].clone(), CAUSAL) for n in rows]

        def warm(lone: bool = False) -> tuple[CompiledDecoder, list[torch.Tensor], int]:
            decoder, before = CompiledDecoder(model), counters["stats"]["unique_graphs"]
            decoder.warm_up(lambda: steps(decoder, lone), packages)
            return decoder, steps(decoder, lone), counters["stats"]["unique_graphs"] - before

        cold, cold_out, cold_traced = warm()
        assert cold_traced >= 1 and cold.precompiled == f"traced {cold_traced} graphs and saved them"
        warm_decoder, warm_out, warm_traced = warm()
        assert warm_decoder.precompiled == f"loaded {cold_traced} graphs" and warm_traced == 0
        assert all(torch.equal(a, b) for a, b in zip(cold_out, warm_out, strict=True))  # the same graphs' bits

        wider, wider_out, wider_traced = warm(lone=True)  # a lone decode (T == 1): no saved graph covers it
        assert wider.precompiled.startswith("not used: a warm-up step no saved graph covers"), wider.precompiled
        assert wider_traced >= 2 and all(torch.equal(a, b) for a, b in zip(cold_out, wider_out[:2], strict=False))
        assert warm(lone=True)[2] == 0  # the traced graphs were saved in its place: the lone decode's included

        (packages / "opaque" / PACKAGE_FILE).write_bytes(b"not a package")
        damaged, damaged_out, damaged_traced = warm()
        assert damaged.precompiled.startswith("not loaded (") and damaged_traced >= 1, damaged.precompiled
        assert all(torch.equal(a, b) for a, b in zip(cold_out, damaged_out, strict=True))
        assert all(d.eager_calls == 0 for d in (cold, warm_decoder, wider, damaged))


def _aged(entry: Path, mtime: float) -> Path:
    os.utime(entry, (mtime, mtime))
    return entry


def test_the_cache_folder_keeps_its_bound_by_evicting_the_least_recently_used(qwen3_dir: Path, tmp_path: Path) -> None:
    key = _key(qwen3_dir)
    mb = b"x" * (2**20 - 4096)  # an entry of a megabyte, manifest included
    old = [_aged(_plant(tmp_path, _key(qwen3_dir, model=f"m{i}"), {"fxgraph/g": mb}), 1_000 + i) for i in range(4)]
    _aged(_plant(tmp_path, key, {"fxgraph/g": mb}), 900)  # this start's entry: the oldest, and never evicted
    stray = tmp_path / ("e" * 21)  # not an entry's name: neither counted nor touched
    stray.mkdir()
    (stray / "big").write_bytes(mb * 3)
    torn = tmp_path / f".{'f' * 20}-abc"  # a save killed before its rename
    (torn / TORCH_FOLDER).mkdir(parents=True)
    (torn / TORCH_FOLDER / "g").write_bytes(mb)
    _aged(torn, 0)
    cache = compile_cache.open_cache(str(tmp_path), qwen3_dir, key, max_mb=3)
    assert cache.max_bytes == 3 * 2**20
    _open(cache)
    choice = cache.finish(compiled=True)
    assert choice.value == "hit" and "evicted 2 least recently used entries" in choice.reason, choice.reason
    assert [e.exists() for e in old] == [False, False, True, True]  # the two least recently used went
    assert (tmp_path / digest(key)).exists() and stray.exists() and not torn.exists()
    assert (tmp_path / digest(key)).stat().st_mtime > old[3].stat().st_mtime  # the hit marked it used
    # under the bound nothing goes, and nothing is said
    again = compile_cache.open_cache(str(tmp_path), qwen3_dir, key, max_mb=3)
    _open(again)
    assert "evicted" not in again.finish(compiled=True).reason and all(e.exists() for e in old[2:])


def test_a_bundle_folder_is_never_evicted(qwen3_dir: Path, tmp_path: Path) -> None:
    bundle = tmp_path / "bundle"
    shutil.copytree(qwen3_dir, bundle)
    key = _key(bundle)
    shipped = _plant(bundle / "compile_cache", _key(bundle, model="other"), {"fxgraph/g": b"x" * 2**20})
    into = compile_cache.open_cache(str(bundle / "compile_cache"), bundle, key, max_mb=1)  # `tandem warm`
    assert into.max_bytes is None
    assert compile_cache.evict(bundle / "compile_cache", 2**30, keep=digest(key)) == (0, 0)
    _open(into)
    into.finish(compiled=False)
    assert shipped.exists()
    with pytest.raises(ValueError, match="compile_cache_max_mb"):
        EngineConfig(compile_cache_max_mb=0)
