"""Structured outputs: grammars compiled with xgrammar, one matcher per constrained sequence, token bitmasks.

Contract:
- `GrammarCompiler(token_strings, vocab_size, stop_ids, special_ids)` is one engine's compiler (thread-safe; built
  on first use). `compile(so)` returns `so` with its `compiled` handle set, or raises `InvalidRequestError` naming
  `so.param` (`response_format`, `structured_outputs`, ...) with the grammar engine's reason. Compiled grammars
  are cached by `StructuredOutput.key` (kind and text), least recently used out, `cache_entries` of them. Callers
  compile before admission, off the engine thread (`AsyncEngine.generate_many`); the engine compiles what reaches
  it uncompiled (offline `generate`).
  Kinds: "json" (a JSON schema; objects without `additionalProperties` admit no others, as OpenAI's strict mode;
  compact separators, so a model cannot pad the document with whitespace forever), "json_object" (any JSON
  object), "regex", "choice" (one of a list of strings, exactly), "grammar" (EBNF with a `root` rule, as xgrammar
  reads it; a text without `::=` is read as Lark), "tool_calls" (1..max_calls tool calls in the "hermes"
  (`<tool_call>\n{"name", "arguments"}\n</tool_call>`, joined by a newline) or "llama3_json" (`{"name",
  "parameters"}`, joined by "; ") format, each call's arguments valid for its function's JSON schema).
- Special tokens (the tokenizer's control tokens) are never allowed by a grammar; the stop ids (EOS) only where
  the grammar accepts. Ids past the tokenizer's vocabulary (a padded embedding) are never allowed.
- `ConstrainedDecoding` owns the matchers: `add(request_id, so)` when a request enters the engine, `forget` when it
  leaves. `masks(items)` fills one int32 bitmask row per sampling row of the step's constrained items (bit t of
  row r set: token t allowed), reading matcher state only (a verify item's rows walk its drafts and roll back), so
  it may run beside the model's forward. `advance(request_id, tokens)` feeds the emitted tokens to the matcher.
  A matcher that has accepted a stop token allows only stop tokens afterwards (`ignore_eos`).
- `apply_bitmask(logits, bitmask)` sets logits of disallowed tokens to -inf in a copy: one pass over [S, V]
  (xgrammar's CPU kernel; torch's unpack-and-fill elsewhere, the same values).
- Which engine, and why: docs/benchmarks.md §20 ("Which engine").
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from inference_svc.engine.types import StructuredOutput
from inference_svc.errors import InvalidRequestError

CACHE_ENTRIES = 256
"""Compiled grammars kept per engine (by kind and text)."""


def bitmask_width(vocab_size: int) -> int:
    """int32 words per bitmask row."""
    return (vocab_size + 31) // 32


_BITS = torch.arange(32, dtype=torch.int32)


def allowed(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bitmask [S, W] int32 → bool [S, vocab_size]: token t of row r is allowed."""
    bits = (bitmask[:, :, None] >> _BITS.to(bitmask.device)) & 1  # [S, W, 32]
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """A copy of logits [S, V] with every token the bitmask [S, W] disallows at -inf: xgrammar's kernel on fp32
    CPU logits (one pass, no unpacked [S, V] mask), else `apply_bitmask_torch` (the same values)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and bitmask.dtype == torch.int32:
        import xgrammar as xgr

        out = logits.clone()
        xgr.apply_token_bitmask_inplace(out, bitmask.contiguous(), vocab_size=logits.shape[1])
        return out
    return apply_bitmask_torch(logits, bitmask)


def apply_bitmask_torch(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """`apply_bitmask` by torch operations (any device)."""
    return logits.masked_fill(~allowed(bitmask.to(logits.device), logits.shape[1]), float("-inf"))


class GrammarCompiler:
    """Compiles `StructuredOutput`s for one vocabulary, with a cache (see the module docstring)."""

    def __init__(
        self,
        token_strings: Sequence[str],
        vocab_size: int,
        stop_ids: Iterable[int],
        special_ids: Iterable[int] = (),
        cache_entries: int = CACHE_ENTRIES,
    ) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        special = set(special_ids)
        # a control token's text must never be produced as grammar text: an empty string makes it special
        encoded = ["" if i in special else t for i, t in enumerate(token_strings[:vocab_size])]
        self.vocab_size = vocab_size
        self.stop_ids = sorted({t for t in stop_ids if 0 <= t < vocab_size})
        self.info = xgr.TokenizerInfo(
            encoded, vocab_type=xgr.VocabType.BYTE_LEVEL, vocab_size=vocab_size, stop_token_ids=self.stop_ids
        )
        self._compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._entries = cache_entries
        self._lock = threading.Lock()

    def compile(self, so: StructuredOutput) -> StructuredOutput:
        """`so` with its compiled grammar (cached), or InvalidRequestError naming `so.param`."""
        if so.compiled is not None:
            return so
        key = so.key
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return replace(so, compiled=hit)
        compiled = self._compile(so)  # outside the lock: a slow schema does not hold up the others
        with self._lock:
            self._cache[key] = compiled
            self._cache.move_to_end(key)
            while len(self._cache) > self._entries:
                self._cache.popitem(last=False)
        return replace(so, compiled=compiled)

    def _json_grammar(self, schema: str) -> Any:
        """The schema's grammar, with xgrammar's string-length character class (which admits raw control
        characters, invalid in a JSON string) narrowed to the characters JSON allows unescaped."""
        grammar = self._xgr.Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=True)
        text = str(grammar)
        return (
            self._xgr.Grammar.from_ebnf(text.replace(_LENGTH_CLASS, _JSON_CHAR)) if _LENGTH_CLASS in text else grammar
        )

    def _tool_calls_grammar(self, spec: dict[str, Any]) -> Any:
        """1..max_calls calls, in the format's framing, of any of the functions (each with its own schema)."""
        g = self._xgr.Grammar
        hermes = spec["format"] == "hermes"
        key = "arguments" if hermes else "parameters"

        def lit(text: str) -> Any:
            return g.from_ebnf(f"root ::= {json.dumps(text)}")

        bodies = []
        for f in spec["functions"]:
            schema = {
                "type": "object",
                "properties": {"name": {"const": f["name"]}, key: f["parameters"]},
                "required": ["name", key],
                "additionalProperties": False,
            }
            bodies.append(self._json_grammar(json.dumps(schema)))
        body = bodies[0] if len(bodies) == 1 else g.union(*bodies)
        call = g.concat(lit("<tool_call>\n"), body, lit("\n</tool_call>")) if hermes else body
        sep = lit("\n" if hermes else "; ")
        options = [call]
        for _ in range(1, int(spec["max_calls"])):
            options.append(g.concat(options[-1], sep, call))
        return options[0] if len(options) == 1 else g.union(*options)

    def _compile(self, so: StructuredOutput) -> Any:
        c = self._compiler
        try:
            if so.kind == "json":
                try:
                    schema = json.loads(so.spec)
                except json.JSONDecodeError as exc:
                    raise InvalidRequestError(so.param, f"the JSON schema is not valid JSON: {exc}") from None
                if not isinstance(schema, dict | bool):
                    raise InvalidRequestError(so.param, "a JSON schema is an object (or true/false)")
                return c.compile_grammar(self._json_grammar(json.dumps(schema)))
            if so.kind == "json_object":
                return c.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
            if so.kind == "regex":
                return c.compile_regex(so.spec)
            if so.kind == "choice":
                choices = json.loads(so.spec)
                if not isinstance(choices, list) or not choices or not all(isinstance(x, str) for x in choices):
                    raise InvalidRequestError(so.param, "choice: a non-empty list of strings")
                if not all(choices):
                    raise InvalidRequestError(so.param, "choice: an empty string cannot be produced")
                alts = " | ".join(json.dumps(x, ensure_ascii=False) for x in dict.fromkeys(choices))
                return c.compile_grammar(f"root ::= {alts}")
            if so.kind == "tool_calls":
                return c.compile_grammar(self._tool_calls_grammar(json.loads(so.spec)))
            if "::=" in so.spec:
                return c.compile_grammar(so.spec)
            return c.compile_lark(so.spec)
        except InvalidRequestError:
            raise
        except Exception as exc:  # xgrammar's parse/compile errors: RuntimeError, ValueError, its own types
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise InvalidRequestError(so.param, f"{so.kind}: the grammar engine cannot compile it: {reason}") from None


_LENGTH_CLASS = r"[^\"\\\r\n]"
"""The character class xgrammar 0.2 writes for a string with minLength/maxLength (control characters in it)."""
_JSON_CHAR = r"[^\0-\x1f\"\\]"
"""A JSON string's unescaped character: anything but a control character, a quote or a backslash."""


@dataclass
class _Matcher:
    matcher: Any
    stopped: bool = False
    """A stop token was accepted: only stop tokens are allowed from here on."""


@dataclass(frozen=True)
class MaskItem:
    """One sampling item of a step, as `ConstrainedDecoding.masks` needs it."""

    request_id: str
    drafts: tuple[int, ...] = ()
    """A verify item's drafted tokens (its rows: len(drafts) + 1); empty for a plain row."""


class ConstrainedDecoding:
    """The engine's matchers, one per constrained request (see the module docstring)."""

    def __init__(self, compiler: GrammarCompiler) -> None:
        self.compiler = compiler
        self._matchers: dict[str, _Matcher] = {}
        self._xgr = compiler._xgr

    def add(self, request_id: str, so: StructuredOutput) -> None:
        so = self.compiler.compile(so)
        self._matchers[request_id] = _Matcher(self._xgr.GrammarMatcher(so.compiled))

    def forget(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._matchers

    def __len__(self) -> int:
        return len(self._matchers)

    def masks(self, items: Sequence[MaskItem]) -> list[torch.Tensor | None]:
        """Per item: its rows' bitmask [rows, W] int32 (None: the item is not constrained). A verify item's row i is
        the mask after its first i drafts; rows after the first draft the grammar refuses allow everything (that
        draft is rejected by its own row, so they are never used)."""
        out: list[torch.Tensor | None] = []
        width = bitmask_width(self.compiler.vocab_size)
        for item in items:
            m = self._matchers.get(item.request_id)
            if m is None:
                out.append(None)
                continue
            mask = torch.full((len(item.drafts) + 1, width), -1, dtype=torch.int32)  # [rows, W]
            self._fill(m, mask, 0)
            taken = 0
            for i, d in enumerate(item.drafts):
                if m.stopped or not m.matcher.accept_token(d):
                    break
                taken += 1
                self._fill(m, mask, i + 1)
            if taken:
                m.matcher.rollback(taken)
            out.append(mask)
        return out

    def _fill(self, m: _Matcher, mask: torch.Tensor, row: int) -> None:
        if m.stopped or m.matcher.is_terminated():
            mask[row] = 0
            for t in self.compiler.stop_ids:
                mask[row, t // 32] |= _bit(t % 32)
            return
        m.matcher.fill_next_token_bitmask(mask, row)

    def advance(self, request_id: str, tokens: Sequence[int]) -> None:
        """Feed the tokens the request emitted this step (they are ones its masks allowed)."""
        m = self._matchers.get(request_id)
        if m is None:
            return
        for t in tokens:
            if m.stopped:
                continue
            # refused: only a stop token past the grammar's end can be (ignore_eos); terminated: a stop was taken
            if not m.matcher.accept_token(t) or m.matcher.is_terminated():
                m.stopped = True


def _bit(i: int) -> int:
    """Bit i of an int32 word, as a Python int that fits int32 (bit 31 is the sign)."""
    return -(2**31) if i == 31 else 1 << i
