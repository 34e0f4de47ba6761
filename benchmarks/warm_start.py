"""Time from `tandem serve` start to gRPC health SERVING: a cold start, then warm starts from the compile cache it
saved.

For each `--model`, starts with the same flags (`--compile on` unless given otherwise), each a new process:
1. cold: an empty `--compile-cache` folder (the compile runs in a private torch cache folder: nothing of torch's
   own caches under /tmp is used either);
2. `--warm` more starts (default 2): the same `--compile-cache`, holding the entry start 1 saved (its inductor
   graphs and libraries, and each decoder's dynamo packages: a full warm start traces nothing).
Each start prints its seconds from process start to SERVING, the seconds of the engine's compile warm-up (the
server log's `compiled the decode step in N s`), and the load plan's `compile_cache` choice. Figures go to
docs/benchmarks.md; nothing here is a test.

    .venv/bin/python benchmarks/warm_start.py --model DIR [--model DIR2] [--warm N] [-- serve flags...]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from inference_svc.serve_process import ServeProcess, free_port

_COMPILED = re.compile(r"compiled the decode step in ([0-9.]+) s")


def start(model: str, flags: list[str], cache: Path, log: Path) -> tuple[float, float | None, dict]:
    """(seconds to SERVING, seconds of the compile warm-up from the server's log, the load plan by lever)."""
    http = free_port()
    all_flags = ["--http-port", str(http), "--metrics-port", "0", "--compile-cache", str(cache), *flags]
    t0 = time.perf_counter()
    with ServeProcess(model, all_flags, log=log) as server:
        server.wait_serving(1800)
        seconds = time.perf_counter() - t0
        with urllib.request.urlopen(f"http://127.0.0.1:{http}/v1/models", timeout=60) as r:
            plan = {c["lever"]: c for c in json.load(r)["data"][0]["tandem_load_plan"]}
    found = _COMPILED.findall(log.read_text(errors="replace")) if log.exists() else []
    return seconds, float(found[-1]) if found else None, plan


def main() -> None:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", action="append", required=True, help="a model folder (repeat for several)")
    p.add_argument("--warm", type=int, default=2, help="warm starts after the cold one (default 2)")
    args = p.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    if args.warm < 1:
        p.error("--warm: at least 1")
    flags = extra if any(f.startswith("--compile") and f != "--compile-cache" for f in extra) else ["--compile", "on",
                                                                                                    *extra]  # fmt: skip
    for model in args.model:
        with tempfile.TemporaryDirectory(prefix="warm-start-") as tmp:
            root = Path(tmp)
            for i, name in enumerate(["cold"] + ["warm"] * args.warm):
                log = root / f"serve-{i}.log"
                seconds, compile_s, plan = start(model, flags, root / "cache", log)
                c = plan["compile_cache"]
                warm_up = "-" if compile_s is None else f"{compile_s:.1f} s"
                print(f"{Path(model).name} | {name} | {seconds:.1f} s to SERVING | compile warm-up {warm_up} | "
                      f"compile_cache={c['value']}: {c['reason']} | threads={plan['threads']['value']}",
                      flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
