"""Generate docs/configuration.md from the structured configs, so the reference cannot drift from the code.

Sources (read, never edited):
- the training schema: `lt_plugins.config.TrainConfig` and its section dataclasses (YAML keys `section.field`);
- the service: `inference_svc.settings.ServerSettings` / `AdmissionLimits` / `HttpLimits`,
  `inference_svc.engine.config.EngineConfig` and the `tandem serve` argument parser (flags, defaults, help);
- `tandem bench`'s argument parser;
- docker-compose.yml's `${VAR:-default}` variables.
Each field's text is the docstring written under it in its dataclass (read with `ast`); defaults are the live values.

Usage:  python scripts/gen_config_docs.py            write docs/configuration.md
        python scripts/gen_config_docs.py --check    exit 1 if the committed file differs from what would be written
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
import typing
from pathlib import Path
from typing import Any

from inference_svc.dataclass_flags import field_docs  # the one reader of field docstrings

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "docs" / "configuration.md"


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return dataclasses.MISSING


def _fmt_default(value: Any) -> str:
    if value is dataclasses.MISSING:
        return "*required*"
    if dataclasses.is_dataclass(value):
        return "(section)"
    if value is None:
        return "`null`"
    return f"`{value!r}`" if not isinstance(value, bool) else f"`{str(value).lower()}`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _type_name(hint: Any) -> str:
    """A field's type as written in source: annotations are strings here, generated fields' types are objects."""
    if isinstance(hint, str):
        return hint
    return hint.__name__ if isinstance(hint, type) and not typing.get_args(hint) else str(hint).replace("typing.", "")


def dataclass_table(cls: type, prefix: str = "", yaml_style: bool = False) -> list[str]:
    docs = field_docs(cls)
    rows = ["| key | type | default | meaning |", "| --- | --- | --- | --- |"]
    for f in dataclasses.fields(cls):
        default = _default(f)
        if dataclasses.is_dataclass(default):
            continue
        shown = _fmt_default(default)
        if yaml_style and isinstance(default, bool):
            shown = f"`{str(default).lower()}`"
        kind = _cell(_type_name(f.type))
        rows.append(f"| `{prefix}{f.name}` | `{kind}` | {_cell(shown)} | {_cell(docs.get(f.name, ''))} |")
    return rows


def parser_table(parser: argparse.ArgumentParser) -> list[str]:
    rows = ["| flag | default | meaning |", "| --- | --- | --- |"]
    for action in parser._actions:  # argparse has no public iterator over its actions
        if not action.option_strings or action.dest == "help":
            continue
        flag = ", ".join(action.option_strings)
        if action.choices:
            flag += " {" + ",".join(map(str, action.choices)) + "}"
        default = action.default
        shown = "" if default in (None, False, argparse.SUPPRESS) or default == [] else f"`{default}`"
        rows.append(f"| `{flag}` | {_cell(shown)} | {_cell(' '.join((action.help or '').split()))} |")
    return rows


def compose_variables(text: str) -> list[str]:
    """`${VAR:-default}` / `${VAR:+alt}` / `${VAR}` uses in docker-compose.yml, by variable (first default wins)."""
    found: dict[str, tuple[str, set[str]]] = {}
    services = _service_of_lines(text)
    for lineno, line in enumerate(text.splitlines()):
        if line.lstrip().startswith("#"):
            continue
        for name, op, arg in _variables(line):
            if op in (":-", "-"):
                default = f"`{arg}`" if arg else "(empty)"
            elif op in (":+", "+"):
                default = "(unset: off)"
            else:
                default = "(empty)"
            prev_default, where = found.get(name, (default, set()))
            where.add(services.get(lineno, "top level"))
            found[name] = (prev_default, where)
    rows = ["| variable | default | used by |", "| --- | --- | --- |"]
    for name in sorted(found):
        default, where = found[name]
        rows.append(f"| `{name}` | {_cell(default)} | {', '.join(sorted(where))} |")
    return rows


def _variables(line: str) -> list[tuple[str, str, str]]:
    """(name, operator, argument) of every `${...}` in `line`, nested ones included."""
    out: list[tuple[str, str, str]] = []
    for start in [m.start() for m in re.finditer(r"\$\{", line)]:
        depth, end = 0, start
        for end in range(start, len(line)):
            if line.startswith("${", end):
                depth += 1
            elif line[end] == "}":
                depth -= 1
                if depth == 0:
                    break
        m = re.match(r"([A-Z_][A-Z0-9_]*)(:?[-+?])?(.*)", line[start + 2 : end], re.S)
        if m:
            out.append((m.group(1), m.group(2) or "", m.group(3)))
    return out


def _service_of_lines(text: str) -> dict[int, str]:
    out: dict[int, str] = {}
    section, current = "", "top level"
    for i, line in enumerate(text.splitlines()):
        top = re.match(r"^([a-z_]+):", line)
        if top:
            section = top.group(1)
            current = "top level" if section != "services" else current
        svc = re.match(r"^  ([a-z_-]+):\s*$", line)
        if svc:
            current = svc.group(1) if section == "services" else f"{section}.{svc.group(1)}"
        out[i] = current
    return out


def render() -> str:
    from inference_svc.bench.cli import build_parser as bench_parser
    from inference_svc.cli import _serve_parser
    from inference_svc.engine.config import EngineConfig
    from inference_svc.settings import (
        AdmissionLimits,
        HttpLimits,
        OpenAIApiSettings,
        ScaleOutSettings,
        ServerSettings,
    )
    from lt_plugins.config import TrainConfig

    lines = [
        "# Configuration reference",
        "",
        "<!-- GENERATED by scripts/gen_config_docs.py from the config dataclasses, the CLI parsers and",
        "     docker-compose.yml. Do not edit by hand: change the docstrings in the code and rerun the script.",
        "     tests/deploy/test_config_docs.py fails when this file is stale. -->",
        "",
        "Every setting of Tandem lives in one typed place; this page is generated from those places.",
        "",
        "- Training: an OmegaConf structured schema (`lt_plugins/config.py`). Set keys in a YAML file under",
        "  `configs/` or on the command line:",
        "  `tandem train --config configs/tiny-cpu.yaml trainer.max_steps=50 strategy.stage=3`.",
        "  Unknown keys and wrong types are errors naming the key.",
        "- Serving: `tandem serve` flags, which build `ServerSettings` + `AdmissionLimits` + `HttpLimits` +",
        "  `ScaleOutSettings` + `OpenAIApiSettings` (`inference_svc/settings.py`) and `EngineConfig`",
        "  (`inference_svc/engine/config.py`).",
        "  Invalid values exit 2 naming the flag.",
        "- Load benchmark: `tandem bench` flags.",
        "- Deployment: the environment variables of `docker-compose.yml` (see docs/deployment.md).",
        "",
        "## Training (`tandem train`)",
        "",
    ]
    top = TrainConfig
    lines += [f"### top level — `{top.__name__}`", "", " ".join((top.__doc__ or "").split()), ""]
    lines += dataclass_table(top, yaml_style=True)
    for f in dataclasses.fields(top):
        default = _default(f)
        if not dataclasses.is_dataclass(default):
            continue
        cls = type(default)
        lines += ["", f"### `{f.name}` — `{cls.__name__}`", "", " ".join((cls.__doc__ or "").split()), ""]
        lines += dataclass_table(cls, prefix=f"{f.name}.", yaml_style=True)
    lines += ["", "## Serving (`tandem serve`)", "", "### Flags", ""]
    lines += parser_table(_serve_parser())
    for cls in (ServerSettings, AdmissionLimits, HttpLimits, ScaleOutSettings, OpenAIApiSettings, EngineConfig):
        lines += ["", f"### `{cls.__name__}` (`{cls.__module__}`)", "", " ".join((cls.__doc__ or "").split()), ""]
        lines += dataclass_table(cls)
    lines += ["", "## Load benchmark (`tandem bench`)", ""]
    lines += parser_table(bench_parser())
    lines += [
        "",
        "## Deployment (`docker-compose.yml` variables)",
        "",
        "Set them in the shell or in a `.env` file next to `docker-compose.yml`.",
        "",
    ]
    lines += compose_variables((REPO / "docker-compose.yml").read_text())
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="exit 1 if docs/configuration.md is stale")
    args = p.parse_args(argv)
    text = render()
    if args.check:
        if not OUT.is_file() or OUT.read_text() != text:
            print(f"{OUT.relative_to(REPO)} is stale: run python scripts/gen_config_docs.py", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
