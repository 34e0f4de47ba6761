"""Time from `tandem serve` start to gRPC health SERVING: cold, warm from the compile cache, and warm with torch's
own caches too.

For each `--model`, starts with the same flags (`--compile on` unless given otherwise), each a new process:
1. cold: an empty `--compile-cache` folder (the compile runs in a private torch cache folder: nothing of torch's
   own caches under /tmp is used either);
2. and 3. warm: the same `--compile-cache`, holding the entry start 1 saved.
Each start's seconds from process start to SERVING and the load plan's `compile_cache` choice are printed. Figures go
to docs/benchmarks.md; nothing here is a test.

    .venv/bin/python benchmarks/warm_start.py --model DIR [--model DIR2] [-- serve flags...]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from inference_svc.serve_process import ServeProcess, free_port


def start(model: str, flags: list[str], cache: Path, log: Path) -> tuple[float, dict]:
    http = free_port()
    all_flags = ["--http-port", str(http), "--metrics-port", "0", "--compile-cache", str(cache), *flags]
    t0 = time.perf_counter()
    with ServeProcess(model, all_flags, log=log) as server:
        server.wait_serving(1800)
        seconds = time.perf_counter() - t0
        with urllib.request.urlopen(f"http://127.0.0.1:{http}/v1/models", timeout=60) as r:
            plan = {c["lever"]: c for c in json.load(r)["data"][0]["tandem_load_plan"]}
    return seconds, plan


def main() -> None:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", action="append", required=True)
    args = p.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    flags = extra if any(f.startswith("--compile") and f != "--compile-cache" for f in extra) else ["--compile", "on",
                                                                                                    *extra]  # fmt: skip
    for model in args.model:
        with tempfile.TemporaryDirectory(prefix="warm-start-") as tmp:
            root = Path(tmp)
            for name in ("cold", "warm", "warm"):
                seconds, plan = start(model, flags, root / "cache", root / "serve.log")
                c = plan["compile_cache"]
                print(f"{Path(model).name} | {name} | {seconds:.1f} s to SERVING | compile_cache={c['value']}: "
                      f"{c['reason']} | threads={plan['threads']['value']}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
