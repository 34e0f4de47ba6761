"""Command-line flags derived from a settings dataclass: one declaration of each setting, its default and its
help, read by both `argparse` and the dataclass.

Contract:
- `add_flags(group, cls, spec)` adds one flag per field of the frozen dataclass `cls`: the name is `--field-name`
  (plus the spellings in `spec.names[field]`, the first of which is the primary one, so existing flags keep their
  names and the dataclass's spelling is an alias), the default is the dataclass's default, the help is the field's
  docstring (its first sentence), `choices` come from `spec.choices`; `bool` fields become `--x / --no-x` pairs;
  a `tuple[str, ...]` field is a repeatable flag (each use adds one item).
  Fields in `spec.skip` get no flag.
- `from_args(cls, args, **resolved)` builds the dataclass from the parsed namespace (every flag's `dest` is its
  field name); `resolved` replaces values the caller resolves itself (e.g. `dtype` 'auto' on CPU). Validation
  stays in the dataclass's `__post_init__`.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import functools
import inspect
import itertools
import textwrap
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class FlagSpec:
    names: Mapping[str, Sequence[str]] = field(default_factory=dict)
    """Field → flag spellings (primary first) when not just `--field-name`."""
    choices: Mapping[str, Sequence[Any]] = field(default_factory=dict)
    skip: frozenset[str] = frozenset()


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """{field: docstring} from the string literal written under each annotated field of `cls` and of its dataclass
    bases (a subclass's text wins). A class generated at run time names the class whose source holds its fields'
    texts in `__field_docs_from__`."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__[1:]):
        if dataclasses.is_dataclass(klass):
            with contextlib.suppress(OSError, TypeError):  # a base without source (built at run time) adds none
                docs.update(_own_field_docs(klass.__dict__.get("__field_docs_from__", klass)))
    docs.update(_own_field_docs(cls.__dict__.get("__field_docs_from__", cls)))
    return docs


def _own_field_docs(cls: type) -> dict[str, str]:
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for stmt, nxt in itertools.pairwise(body):
        if (
            isinstance(stmt, ast.AnnAssign)
            and isinstance(stmt.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[stmt.target.id] = " ".join(nxt.value.value.split())
    return docs


def _first_sentence(text: str) -> str:
    head, sep, _ = text.partition(". ")
    return head + ("." if sep else "")


def _scalar_type(hint: Any) -> type:
    """int | None → int; int | str | None → str (parsed by the dataclass); plain types as they are."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return args[0] if len(args) == 1 else str
    return hint


def add_flags(group: Any, cls: type, spec: FlagSpec = FlagSpec()) -> None:
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        if f.name in spec.skip:
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        names = list(spec.names.get(f.name, ()))
        canonical = "--" + f.name.replace("_", "-")
        if canonical not in names:
            names.append(canonical)
        kind = _scalar_type(hints[f.name])
        text = _first_sentence(docs.get(f.name, ""))
        if typing.get_origin(kind) is tuple:
            group.add_argument(*names, dest=f.name, default=list(default), action="append", help=text)
            continue
        if kind is bool:
            group.add_argument(*names, dest=f.name, default=default, action=argparse.BooleanOptionalAction, help=text)
            continue
        shown = "" if default is None else f" (default: {default})"
        group.add_argument(
            *names, dest=f.name, type=kind, default=default, choices=spec.choices.get(f.name), help=text + shown
        )


def from_args(cls: type, args: argparse.Namespace, **resolved: Any) -> Any:
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
    values = {k: tuple(v) if isinstance(v, list) else v for k, v in values.items()}  # repeatable flags
    values.update(resolved)
    return cls(**values)
