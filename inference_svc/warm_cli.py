"""`tandem warm BUNDLE [engine flags]`: compile a model's decode step once and store the artifacts inside the bundle
(`BUNDLE/compile_cache/<key>/`), so that `tandem serve` on this machine, or on another of the same kind (same CPU
model and flags, torch and Python), starts without compiling.

Contract:
- The engine flags are `tandem serve`'s (`EngineConfig`, the same names, defaults and `--dtype auto` rule), so the
  key computed here is the key the server computes for the same flags; `--compile` must not be 'off' (warming
  compiles: 'auto' and 'on' both compile here); `--compile-cache` and `--compile-cache-max-mb` are not flags here:
  the bundle's own folder is the destination, and it is never pruned.
- Prints one line `tandem warm: <key> <hit|miss> ...` (the load plan's `compile_cache` choice) and exits 0 when the
  bundle holds the entry afterwards; exits 1 when the model cannot load or compile, 2 on a bad flag.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from inference_svc.dataclass_flags import FlagSpec, add_flags, from_args
from inference_svc.engine.config import EngineConfig
from inference_svc.errors import InferenceError


def _parser() -> argparse.ArgumentParser:
    from inference_svc.cli import ENGINE_FLAGS

    p = argparse.ArgumentParser(
        prog="tandem warm",
        description="Compile a model's decode step and store it in the bundle (compile_cache/) for warm starts.",
        allow_abbrev=False,
    )
    p.add_argument("model", metavar="BUNDLE", help="the model folder (written into: BUNDLE/compile_cache/)")
    skip = frozenset({"compile_cache", "compile_cache_max_mb"})  # the bundle's own folder, never pruned
    spec = FlagSpec(names=ENGINE_FLAGS.names, choices=ENGINE_FLAGS.choices, skip=skip)
    add_flags(p.add_argument_group("engine (as tandem serve)"), EngineConfig, spec)
    return p


def main(argv: Sequence[str]) -> int:
    from inference_svc.cli import _resolve_dtype, set_omp_wait
    from inference_svc.executor.compile_cache import bundle_cache_dir

    parser = _parser()
    args = parser.parse_args(list(argv))
    if args.compile == "off":
        parser.error("--compile off: there is nothing to warm (use auto or on)")
    try:
        set_omp_wait(args.threads, args.omp_wait)  # before `--dtype auto` may import torch
        config = from_args(EngineConfig, args, dtype=_resolve_dtype(args.dtype, args.device), compile="on",
                           compile_cache=str(bundle_cache_dir(args.model)))  # fmt: skip
    except (InferenceError, ValueError) as exc:
        parser.error(str(exc))
    from inference_svc.engine import Engine

    try:
        engine = Engine.from_bundle(args.model, config)
    except InferenceError as exc:
        print(f"tandem warm: {exc}", file=sys.stderr, flush=True)
        return 1
    choice = next(c for c in engine.info().load_plan if c.lever == "compile_cache")
    print(f"tandem warm: {choice.value}: {choice.reason} (compiled in {engine.compile_seconds:.1f} s)", flush=True)
    stored = choice.value == "hit" or "saved to" in choice.reason
    return 0 if stored else 1
