"""Sharded construction at ZeRO-3: each rank's peak memory while LitCausalLM builds its decoder and loads an
`init_from` folder, against the full fp32 model's size and against the whole-model build of stages 0-2.

Usage: python benchmarks/sharded_init.py [--hidden 1024] [--layers 10] [--vocab 32000] [--world 2]
                                         [--folder /tmp/tandem-sharded-init] [--out benchmarks/sharded_init.json]
Creates (once) a random Qwen3-style fp32 folder of that size in --folder (safetensors in ~200 MB shards, the
index beside them), then for each mode starts --world CPU processes over gloo (torchrun-style env, free loopback
port) that run `Trainer.fit` with `LitCausalLM(init_from=folder)`:
- `zero3`: ZeroStrategy(stage=3): `configure_model` runs under deepspeed.zero.Init (parameters partitioned as they
  are created, unfilled), then each rank reads its own slice of each tensor from the folder into its partition;
- `whole`: ZeroStrategy(stage=2): the whole model is built on every rank and loaded with a plain copy (what every
  stage did before construction moved into configure_model).
Each rank resets its peak RSS (/proc/self/clear_refs 5) as configure_model starts and reads it (VmHWM) when it ends;
a 1 ms sampler also records the peak of anonymous memory (RssAnon: heap, not file pages mapped by safetensors). The
run stops there (the optimizer is not built). Prints one row per mode and rank: peak growth, its ratio to the fp32
model size and to the whole-model mode measured in the same run, and the anonymous memory still held when
configure_model returned; writes JSON to --out. glibc keeps freed heap, which hides transient frees in RSS: run also
with MALLOC_MMAP_THRESHOLD_=65536 (large blocks mmapped, returned on free) to see the allocations themselves.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import subprocess
import sys
import threading
import time
from datetime import date
from pathlib import Path
from typing import Any

from inference_svc.serve_process import free_port

MODES = {"zero3": 3, "whole": 2}
MIB = 1024**2


def _status_kib(*keys: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in keys:
            out[name] = int(value.split()[0])
    return out


class PeakSampler:
    """Peak RssAnon (KiB) while running, sampled every millisecond on a daemon thread."""

    def __init__(self) -> None:
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _status_kib("RssAnon")["RssAnon"])
            time.sleep(0.001)

    def __enter__(self) -> PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _status_kib("RssAnon")["RssAnon"])


class Measured(Exception):
    """Raised after configure_model to end the fit: the measurement is done."""


def make_folder(folder: Path, hidden: int, layers: int, vocab: int) -> int:
    """The random fp32 model folder (created once); returns its parameter count."""
    import torch

    from shared_model.bundle import read_config, save_bundle
    from shared_model.config import ModelConfig
    from shared_model.model import build_model

    if (folder / "config.json").is_file():
        config = read_config(folder)
    else:
        config = ModelConfig(
            model_type="qwen3",
            vocab_size=vocab,
            hidden_size=hidden,
            num_layers=layers,
            num_heads=hidden // 64,
            num_kv_heads=max(1, hidden // 128),
            head_dim=64,
            intermediate_size=int(hidden * 2.75) // 64 * 64,
            qk_norm=True,
            tie_word_embeddings=False,
            max_position_embeddings=2048,
        )
        model = build_model(config, dtype=torch.float32, seed=0)
        save_bundle(folder, config, model, dtype="float32", max_shard_bytes=200 * MIB)
        del model
    with torch.device("meta"):
        from shared_model.model import CausalLM

        return sum(p.numel() for p in CausalLM(config).parameters())


def rank_main(mode: str, folder: str, out: str) -> None:
    import lightning.pytorch as pl
    import torch

    from lt_plugins.config import DataSection
    from lt_plugins.data import Blocks, CorpusDataModule
    from lt_plugins.lit_module import LitCausalLM
    from lt_plugins.strategy import ZeroStrategy
    from shared_model.bundle import read_config

    torch.set_num_threads(1)
    config = read_config(folder)

    class Probe(LitCausalLM):
        def configure_model(self) -> None:
            Path("/proc/self/clear_refs").write_text("5")  # VmHWM := current RSS
            before = _status_kib("VmRSS", "RssAnon")
            start = time.perf_counter()
            with PeakSampler() as sampler:
                super().configure_model()
            seconds = time.perf_counter() - start
            after = _status_kib("VmHWM", "VmRSS", "RssAnon")
            rank = torch.distributed.get_rank()
            assert self.model is not None
            local = sum(getattr(p, "ds_tensor", p).numel() for p in self.model.parameters())
            row = {"mode": mode, "rank": rank, "seconds": seconds, "local_param_numel": local}
            row.update({f"before_{k}_kib": v for k, v in before.items()})
            row.update({f"after_{k}_kib": v for k, v in after.items()})
            row["peak_RssAnon_kib"] = sampler.peak
            Path(out, f"{mode}-rank{rank}.json").write_text(json.dumps(row))
            raise Measured

    rows = torch.zeros(8, 17, dtype=torch.int64)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=int(os.environ["WORLD_SIZE"]),
        strategy=ZeroStrategy(stage=MODES[mode]),
        precision="32-true",
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,
    )
    data = CorpusDataModule(DataSection(block_size=16, batch_size=1), Blocks(rows, rows[:1], None))  # type: ignore[arg-type]
    with contextlib.suppress(Measured):  # raised once the measurement is written
        trainer.fit(Probe(config, init_from=folder), datamodule=data)


def launch(mode: str, folder: Path, out: Path, world: int, timeout_s: float) -> list[dict[str, Any]]:
    port = free_port()
    procs = []
    for rank in range(world):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(world)}
        env.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "NODE_RANK": "0", "OMP_NUM_THREADS": "1"})
        log = open(out / f"{mode}-log{rank}.txt", "w")  # noqa: SIM115 - closed below
        cmd = [sys.executable, __file__, "--rank-mode", mode, "--folder", str(folder), "--work", str(out)]
        procs.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    for rank, (proc, log) in enumerate(procs):
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            for p, _ in procs:
                p.kill()
            code = -9
        log.close()
        if code != 0 or not (out / f"{mode}-rank{rank}.json").is_file():
            tail = (out / f"{mode}-log{rank}.txt").read_text()[-3000:]
            raise SystemExit(f"{mode} rank {rank} failed ({code}):\n{tail}")
    return [json.loads((out / f"{mode}-rank{r}.json").read_text()) for r in range(world)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=10)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--folder", type=Path, default=Path("/tmp/tandem-sharded-init"))
    p.add_argument("--out", type=Path, default=Path("benchmarks/sharded_init.json"))
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--rank-mode", default=None, help=argparse.SUPPRESS)
    p.add_argument("--work", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rank_mode:
        rank_main(args.rank_mode, str(args.folder), args.work)
        return
    params = make_folder(args.folder, args.hidden, args.layers, args.vocab)
    fp32_mib = params * 4 / MIB
    work = args.folder.with_name(args.folder.name + "-work")
    work.mkdir(exist_ok=True)
    rows = [row for mode in MODES for row in launch(mode, args.folder, work, args.world, args.timeout)]
    whole = {r["rank"]: r for r in rows if r["mode"] == "whole"}
    print(f"model: {params / 1e6:.1f}M parameters, fp32 {fp32_mib:.0f} MiB; {args.world} CPU processes (gloo)")
    print("mode   rank  peak RSS growth MiB  peak anon growth MiB  x fp32 model  vs whole  held anon MiB  seconds")
    for r in rows:
        grow = (r["after_VmHWM_kib"] - r["before_VmRSS_kib"]) / 1024
        anon = (r["peak_RssAnon_kib"] - r["before_RssAnon_kib"]) / 1024
        w = whole[r["rank"]]
        w_anon = (w["peak_RssAnon_kib"] - w["before_RssAnon_kib"]) / 1024
        held = (r["after_RssAnon_kib"] - r["before_RssAnon_kib"]) / 1024  # after configure_model returned
        r.update(peak_rss_growth_mib=grow, peak_anon_growth_mib=anon, anon_vs_fp32=anon / fp32_mib, held_mib=held)
        r["anon_vs_whole"] = anon / w_anon
        print(
            f"{r['mode']:<6} {r['rank']:>4}  {grow:>19.0f}  {anon:>20.0f}  {anon / fp32_mib:>12.2f}  "
            f"{r['anon_vs_whole']:>8.2f}  {held:>13.0f}  {r['seconds']:>7.1f}"
        )
    result = {
        "date": date.today().isoformat(),
        "machine": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "params": params,
        "fp32_mib": fp32_mib,
        "world": args.world,
        "malloc_mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_"),
        "rows": rows,
    }
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
