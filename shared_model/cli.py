"""The `tandem` console script: a dispatcher that imports only the subcommand it runs.

Contract:
- `SUBCOMMANDS` maps each subcommand to "module:function" and the extra it needs. The function takes the
  remaining argv and returns an exit code.
- Nothing is imported until a subcommand is chosen, so `tandem serve` and `tandem ledger` start where Lightning
  and DeepSpeed are not installed.
- A subcommand whose module is missing from this installation says so plainly (an incomplete checkout or a
  broken install); one whose extra is missing names the `pip install` that fixes it.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Subcommand:
    target: str
    """"module:function" called with the remaining arguments."""
    help: str
    extra: str | None
    """The optional-dependency group it needs (pip install 'tandem[extra]')."""


SUBCOMMANDS: dict[str, Subcommand] = {
    "train": Subcommand("lt_plugins.cli:train_main", "train a model from an OmegaConf YAML config", "train"),
    "export": Subcommand(
        "lt_plugins.cli:export_main", "export a checkpoint: a bundle, a safetensors state dict or a HF folder", "train"
    ),
    "plan": Subcommand("lt_plugins.planner_cli:main", "pick the cheapest training configuration that fits", None),
    "ledger": Subcommand("shared_model.ledger_cli:main", "print the memory ledger of a model", None),
    "serve": Subcommand("inference_svc.cli:serve_main", "serve a model over gRPC and the OpenAI API", "serve"),
    "warm": Subcommand(
        "inference_svc.warm_cli:main",
        "compile a bundle's decode step into it (compile_cache/) for warm starts",
        "serve",
    ),
    "generate": Subcommand("inference_svc.generate_cli:generate_main", "stream a completion from a server", "serve"),
    "eval": Subcommand(
        "inference_svc.eval_cli:main", "held-out perplexity and bits per byte, offline and through a server", "serve"
    ),
    "build-kernels": Subcommand(
        "tandem_native.loader:main", "build Tandem's native CPU kernels now (else the first start does)", None
    ),
    "bench": Subcommand("inference_svc.bench.cli:main", "load-test a server and plot latency/throughput", "serve"),
    "serve-ray": Subcommand(
        "inference_svc.ray_serve:main", "serve N replicas on Ray Serve behind its prefix-affinity router", "ray"
    ),
}

_OWN_PACKAGES = ("shared_model", "lt_plugins", "inference_svc", "tandem_native")


def _usage() -> str:
    lines = ["usage: tandem <command> [args...]", "", "commands:"]
    lines += [f"  {name:<9} {sub.help}" for name, sub in SUBCOMMANDS.items()]
    lines += ["", "Run `tandem <command> --help` for a command's options."]
    return "\n".join(lines)


def _resolve(name: str, sub: Subcommand) -> Callable[[list[str]], int] | str:
    """The subcommand's function, or a message saying why it cannot run here."""
    module_name, func_name = sub.target.split(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        if missing.split(".")[0] in _OWN_PACKAGES:
            return f"tandem {name}: this installation lacks {missing}: reinstall from a complete checkout"
        hint = f" (pip install 'tandem[{sub.extra}]')" if sub.extra else ""
        return f"tandem {name}: needs the Python package '{missing}', which is not installed{hint}"
    func = getattr(module, func_name, None)
    if func is None:
        return f"tandem {name}: this installation lacks {sub.target}: reinstall from a complete checkout"
    return func


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0 if args else 2
    name, rest = args[0], args[1:]
    sub = SUBCOMMANDS.get(name)
    if sub is None:
        print(f"tandem: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    func = _resolve(name, sub)
    if isinstance(func, str):
        print(func, file=sys.stderr)
        return 3
    return int(func(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
