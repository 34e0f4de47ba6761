"""Chat templates: a model folder's Jinja template turned into the prompt text and token ids for a chat request.

Contract:
- Where the template comes from (`ChatTemplate.from_folder(folder, override=None)`): an override file
  (`--chat-template FILE`) wins; else `chat_template.jinja` in the folder; else `chat_template` in the folder's
  `tokenizer_config.json`, either a string or a list of `{"name", "template"}` objects of which the one named
  "default" is used. None when the folder has none of them and no override is given. The file wins over the config
  entry because that is what transformers' `AutoTokenizer.from_pretrained` does when a folder has both (it is
  also what its `save_pretrained` writes). A template that cannot be read or does not compile, or a malformed
  config entry, is a `ModelLoadError` naming the file.
- Rendering matches transformers: the same `ImmutableSandboxedEnvironment` options (trim_blocks, lstrip_blocks,
  the loopcontrols extension, a `{% generation %}` tag that renders its body), the same globals (`raise_exception`,
  `strftime_now`, `dict`, a `namespace` that refuses underscore names), the same `tojson` filter (no HTML escaping,
  `ensure_ascii=False`, with `indent`, `separators`, `sort_keys`), and the same variables: `messages`, `tools` (the
  request's tool definitions as given, OpenAI's `{"type": "function", "function": {...}}`: `with_tools=` of
  `render`/`encode`, a name no template kwarg can take; else None), `documents`
  (always None here), `add_generation_prompt`, plus the tokenizer's special tokens as transformers'
  `special_tokens_map` holds them (`bos_token`, `eos_token`, `unk_token`, `sep_token`, `pad_token`, `cls_token`,
  `mask_token`, and any other `*_token` string in `tokenizer_config.json`). So `render(messages,
  add_generation_prompt=g)` equals `AutoTokenizer.from_pretrained(folder).apply_chat_template(messages,
  tokenize=False, add_generation_prompt=g)`. Extra keyword arguments of `render`/`encode` (a request's
  `chat_template_kwargs`, e.g. `enable_thinking=False`) become template variables too, as transformers' kwargs do,
  except that they may not replace the variables above (`InvalidRequestError` on `chat_template_kwargs.<name>`).
- Messages are checked first: a non-empty list of objects, each with a `role` (non-empty string) and a `content`:
  a string, or a non-empty list of `{"type": "text", "text": str}` parts, which are joined with "\\n" (PART_SEPARATOR,
  the rule vLLM uses) into one string before the template sees it; any other part is refused. Other keys of a
  message are passed to the template unchanged (JSON values only; keys whose value is null are dropped, and a
  `reasoning_content` / `thinking` / `reasoning` value is copied under the first two names, as transformers does).
  Every refusal is an `InvalidRequestError` naming the field, e.g. `messages[2].role`.
- Bounds (`limits=RenderLimits(max_chars, timeout)` on `render`/`encode`; the server derives `max_chars` from its
  context, the characters `max_model_len` tokens can stand for): a render that writes more than `max_chars`
  characters is stopped as soon as it has (output is collected piece by piece, and the producers that can make
  one huge piece at once are bounded before they allocate it: `tojson`'s `indent` and its output, `*` and `+` on
  strings and lists, the `center`, `indent` and `replace` filters; a `~` concatenation is checked once made, so
  repeated joins stop within twice the bound; these filters and `format` never run when the template is
  compiled, as Jinja otherwise does with constant arguments, unbounded); a render still running `timeout` seconds
  after it started is interrupted (SIGALRM, so only where `encode` runs on a process's main thread: the server
  renders in its tokenizer process, whose memory is also capped, see `inference_svc.tokenizer_process`). Either,
  and a template that runs out of memory, is an `InvalidRequestError` on "chat_template" saying which bound it
  hit. `limits` is therefore not a template variable name a request can set.
- Failures inside the template are the request's: `raise_exception("...")` becomes `InvalidRequestError("messages",
  "...")`; a sandbox violation or any other error while rendering becomes an `InvalidRequestError` on "messages"
  saying so, never a traceback.
- `encode(messages, tokenizer, add_generation_prompt=True) -> (text, ids)`: `text` is `render`'s string; `ids` are
  its tokens, with no BOS/EOS added beyond what the template writes (transformers' `apply_chat_template(
  tokenize=True)` encodes with `add_special_tokens=False` too). The template's own control tokens (written in its
  text or through `bos_token`/`eos_token`) stay control tokens, but text that came from a message's content never
  becomes one, e.g. a user typing `<|eos|>`. Here Tandem departs from transformers (whose default encodes the whole
  string, so typed special-token text becomes control tokens):
    * A content "may form special-token text" when it contains a special token's text, is part of one, or starts
      or ends with a fragment of one (so two neighbouring contents, or content and template text, could join into
      one). When no content may, the whole string is encoded at once: exactly transformers' ids.
    * Otherwise those contents are rendered again wrapped in two private-use sentinel characters that occur nowhere
      else (inside the content's surrounding whitespace, so templates that trim it render the same), and the result
      is split on them. The sentinels must come out balanced and, removed, leave exactly the first rendering; else
      the template transforms content holding special-token text (slices, splits or measures it) and the request
      is refused (`InvalidRequestError` on "messages"). If no special-token text of the rendered string overlaps a
      wrapped content, the whole string is still encoded at once (parity). Otherwise the template's pieces are
      encoded normally and the wrapped contents with `literal=True`, so the ids can differ from transformers' at
      those boundaries.
    * A role, another message field or a `chat_template_kwargs` value holding special-token text is refused
      (`InvalidRequestError` naming it): templates compare and write those as they are, so they cannot be kept
      literal.
  "Special tokens" are the tokenizer's added tokens flagged special: the ones `Tokenizer.encode(literal=True)`
  keeps as text (added tokens not flagged special stay tokens either way). Content that a template transforms
  before writing it (`| lower`, `replace`) is not traced.
- No FastAPI or gRPC import: this module needs only jinja2, tokenizers and the repository. A `ChatTemplate` is
  immutable once built and safe to share between threads.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import json
import operator
import re
import signal
import threading
import weakref
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.compiler
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.exceptions import SecurityError, TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from inference_svc.errors import InvalidRequestError, ModelLoadError
from shared_model.tokenizer import Tokenizer

CHAT_TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_MAP_FILE = "special_tokens_map.json"
"""Legacy file transformers still merges into the special tokens when the config has no `added_tokens_decoder`."""
PART_SEPARATOR = "\n"
"""Joins the text parts of one message's content."""
TEMPLATE_FIELD = "chat_template"
"""The request field that errors about the template itself name (a render over its bounds)."""
KWARGS_FIELD = "chat_template_kwargs"
"""The request field that errors about extra template variables name (`chat_template_kwargs.enable_thinking`)."""

_SERVER_VARIABLES = frozenset({"messages", "tools", "documents", "add_generation_prompt"})

_STANDARD_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")
_SENTINEL_CANDIDATES = range(0x10FFFD, 0x100000, -1)
"""Supplementary Private Use Area-B, from the top: the sentinels are the first two absent from the request."""
_MIN_JINJA = (3, 1, 6)
"""Older jinja2 releases have known sandbox escapes (transformers refuses them too)."""


# ---------------------------------------------------------------------------------------------- bounds
@dataclass(frozen=True)
class RenderLimits:
    """How much one render may write (characters) and how long it may run (seconds; None: no time bound)."""

    max_chars: int
    timeout: float | None = None


class _TooLarge(Exception):
    """The render would write more than its `max_chars`."""


class _RenderTimeout(Exception):
    """The render ran past its `timeout` (raised by the SIGALRM handler)."""


_budget: contextvars.ContextVar[int | None] = contextvars.ContextVar("chat_template_budget", default=None)
"""The most characters the render in progress may write, and the bound on any one string or list it makes
(None: unbounded)."""


def _check_size(n: int) -> None:
    limit = _budget.get()
    if limit is not None and n > limit:
        raise _TooLarge(n)


@contextlib.contextmanager
def _time_limit(timeout: float | None) -> Iterator[None]:
    """Interrupt the block after `timeout` seconds, where a signal can (the main thread); else no bound."""
    if timeout is None or threading.current_thread() is not threading.main_thread():
        yield
        return

    def expired(signum: int, frame: Any) -> None:
        raise _RenderTimeout()

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


# ---------------------------------------------------------------------------------------------- the environment
class _TemplateRaised(TemplateError):
    """Raised by the template's own `raise_exception(message)`."""


def _raise_exception(message: object) -> None:
    raise _TemplateRaised(str(message))


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False
) -> str:
    # Unlike Jinja's own tojson: no HTML escaping of < > & ', and non-ASCII text kept as is.
    # Within a bounded render, encoded piece by piece and stopped at the bound (an indent wider than the bound is
    # refused before one line of it is made).
    limit = _budget.get()
    if limit is None:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    if isinstance(indent, int) and not isinstance(indent, bool):
        _check_size(indent)
    elif isinstance(indent, str):
        _check_size(len(indent))
    encoder = json.JSONEncoder(ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    pieces, size = [], 0
    for piece in encoder.iterencode(value):
        size += len(piece)
        _check_size(size)
        pieces.append(piece)
    return "".join(pieces)


def _sized_binop(op: str, left: Any, right: Any) -> Any:
    """`*` and `+` that refuse a string or list over the render's bound before making it."""
    if op == "*":
        for seq, times in ((left, right), (right, left)):
            if isinstance(seq, str | list | tuple) and isinstance(times, int):
                _check_size(len(seq) * max(times, 0))
    elif op == "+" and isinstance(left, str | list | tuple) and isinstance(right, str | list | tuple):
        _check_size(len(left) + len(right))
    return _BINOPS[op](left, right)


_BINOPS = {"*": operator.mul, "+": operator.add}


def _sized(value: Any) -> Any:
    """A `~` concatenation's result, refused when over the render's bound (so repeated joins, which at most double
    a string each time, never get far past it)."""
    if isinstance(value, str):
        _check_size(len(value))
    return value


def _width(width: Any) -> int:
    return width if isinstance(width, int) else len(width) if isinstance(width, str) else 0


def _bounded_filters(filters: dict[str, Any]) -> None:
    """`center`, `indent` and `replace`, whose result can be far larger than their input, refused before they make
    a result over the render's bound; they, `format` and `tojson` take the context, so that Jinja never calls
    them while it compiles a template (it evaluates filters of constants then, outside any bound)."""
    center, indent, replace, format_ = filters["center"], filters["indent"], filters["replace"], filters["format"]

    @jinja2.pass_context
    def bounded_center(context: Any, value: Any, width: Any = 80) -> str:
        _check_size(_width(width))
        return center(value, width)

    @jinja2.pass_context
    def bounded_indent(context: Any, s: Any, width: Any = 4, *args: Any, **kwargs: Any) -> str:
        text = str(s)
        _check_size(len(text) + (text.count("\n") + 1) * _width(width))
        return indent(s, width, *args, **kwargs)

    @jinja2.pass_context
    def bounded_replace(context: Any, s: Any, old: Any, new: Any, count: Any = None) -> str:
        text, old_s, new_s = str(s), str(old), str(new)
        times = text.count(old_s) if old_s else len(text) + 1
        if isinstance(count, int) and count >= 0:
            times = min(times, count)
        _check_size(len(text) + times * max(len(new_s) - len(old_s), 0))
        return replace(context.eval_ctx, s, old, new, count)

    @jinja2.pass_context
    def unfolded_format(context: Any, value: Any, *args: Any, **kwargs: Any) -> str:
        return format_(value, *args, **kwargs)

    @jinja2.pass_context
    def unfolded_tojson(context: Any, value: Any, *args: Any, **kwargs: Any) -> str:
        return _tojson(value, *args, **kwargs)

    filters.update(
        center=bounded_center, indent=bounded_indent, replace=bounded_replace, format=unfolded_format,
        tojson=unfolded_tojson,
    )  # fmt: skip


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _DictFactory:
    """The `dict` global: builds plain dicts, and exposes nothing else of the `dict` type to the template."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


def _check_namespace_name(name: object) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise SecurityError(f"a chat template may not store the underscore-prefixed attribute {name!r} on a namespace")


class _Namespace(jinja2.utils.Namespace):
    """The `namespace` global: Jinja's, refusing attribute names that start with an underscore."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        # The first positional is `self`, taken from *args as Jinja's Namespace does, so `namespace(self=1)` works.
        ns, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _check_namespace_name(name)
        jinja2.utils.Namespace.__init__(ns, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _check_namespace_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}…{% endgeneration %}` (transformers' marker of assistant text): renders its body as is."""

    tags = frozenset({"generation"})

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Any) -> str:
        return caller()


class _BoundedCodeGenerator(jinja2.compiler.CodeGenerator):
    """Jinja's code generator, with every `~` concatenation's result passed through `_sized`."""

    def visit_Concat(self, node: jinja2.nodes.Concat, frame: Any) -> None:
        self.write("environment.sized_concat(")
        super().visit_Concat(node, frame)
        self.write(")")


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """The sandbox, with `*`, `+`, `~` and the widening filters checked against the render's size bound."""

    intercepted_binops = frozenset(_BINOPS)
    code_generator_class = _BoundedCodeGenerator
    sized_concat = staticmethod(_sized)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        return _sized_binop(operator, left, right)


_environment: ImmutableSandboxedEnvironment | None = None


def _env() -> ImmutableSandboxedEnvironment:
    """The one sandbox all templates compile in (built on first use; a race builds two equal ones)."""
    global _environment
    if _environment is None:
        version = tuple(int(p) for p in re.findall(r"\d+", jinja2.__version__)[:3])
        if version < _MIN_JINJA:
            raise ModelLoadError(f"chat templates need jinja2>=3.1.6 (sandbox fixes); installed: {jinja2.__version__}")
        env = _BoundedSandbox(
            trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
        )
        env.filters["tojson"] = _tojson
        _bounded_filters(env.filters)
        env.globals.update(
            raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_DictFactory(), namespace=_Namespace
        )
        _environment = env
    return _environment


# ---------------------------------------------------------------------------------------------- the template
class ChatTemplate:
    """One compiled chat template plus the special-token variables it is rendered with."""

    def __init__(self, source: str, *, variables: Mapping[str, str] | None = None, origin: str = "chat template"):
        """Compile `source`; a failure is a `ModelLoadError` naming `origin` (the file it came from)."""
        if not isinstance(source, str):
            raise ModelLoadError(f"{origin}: the chat template must be a string, got {type(source).__name__}")
        self.source = source
        self.origin = origin
        self.variables: dict[str, str] = dict(variables or {})
        """Template variables besides the request's: the special tokens (`bos_token`, `eos_token`, …)."""
        try:
            self._template = _env().from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise ModelLoadError(
                f"{origin}: the chat template does not compile (line {exc.lineno}: {exc.message})"
            ) from exc
        except ModelLoadError:
            raise
        except Exception as exc:  # e.g. RecursionError on absurd nesting
            raise ModelLoadError(f"{origin}: the chat template does not compile ({type(exc).__name__}: {exc})") from exc

    def __repr__(self) -> str:
        return f"ChatTemplate(origin={self.origin!r})"

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        """Pickled as its source, variables and origin (a compiled template does not pickle): a tokenizer process
        compiles each template it is sent once."""
        return _compiled, (self.source, tuple(sorted(self.variables.items())), self.origin)

    @classmethod
    def from_folder(cls, folder: str | Path, override: str | Path | None = None) -> ChatTemplate | None:
        """The folder's chat template (see the module docstring for the order), or None when it has none."""
        folder = Path(folder)
        config_file = folder / TOKENIZER_CONFIG_FILE
        config = _read_json(config_file) if config_file.is_file() else {}
        variables = _special_token_variables(folder, config)
        if override is not None:
            path = Path(override)
            return cls(_read_text(path), variables=variables, origin=str(path))
        jinja_file = folder / CHAT_TEMPLATE_FILE
        if jinja_file.is_file():
            return cls(_read_text(jinja_file), variables=variables, origin=str(jinja_file))
        entry = config.get("chat_template")
        if entry is None:
            return None
        if isinstance(entry, str):
            return cls(entry, variables=variables, origin=f"{config_file} (chat_template)")
        if isinstance(entry, list):
            named: dict[str, Any] = {}
            for item in entry:
                if not (isinstance(item, dict) and isinstance(item.get("name"), str) and "template" in item):
                    raise ModelLoadError(
                        f"{config_file}: chat_template as a list must hold {{name, template}} objects, got {item!r:.80}"
                    )
                named[item["name"]] = item["template"]
            if "default" not in named:
                raise ModelLoadError(
                    f"{config_file}: chat_template lists the templates {sorted(named)} but none named 'default'"
                )
            return cls(named["default"], variables=variables, origin=f"{config_file} (chat_template 'default')")
        raise ModelLoadError(
            f"{config_file}: chat_template must be a string or a list of {{name, template}} objects, "
            f"got {type(entry).__name__}"
        )

    # ------------------------------------------------------------------ use
    def render(
        self,
        messages: Any,
        /,
        add_generation_prompt: bool = True,
        limits: RenderLimits | None = None,
        *,
        with_tools: list[dict[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> str:
        """The prompt text for `messages` (checked first; see the module docstring)."""
        chat, extra = _checked_messages(messages), self._with_tools(self._checked_kwargs(template_kwargs), with_tools)
        with self._bounded(limits):
            return self._render(chat, add_generation_prompt, extra)

    def encode(
        self,
        messages: Any,
        tokenizer: Tokenizer,
        /,
        add_generation_prompt: bool = True,
        limits: RenderLimits | None = None,
        *,
        with_tools: list[dict[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> tuple[str, list[int]]:
        """The prompt text and its token ids; content text never becomes a control token (module docstring)."""
        chat = _checked_messages(messages)
        extra = self._with_tools(self._checked_kwargs(template_kwargs), with_tools)
        with self._bounded(limits):
            return self._encode(chat, tokenizer, add_generation_prompt, extra)

    @contextlib.contextmanager
    def _bounded(self, limits: RenderLimits | None) -> Iterator[None]:
        """Renders inside run under `limits`; their overruns become InvalidRequestError on "chat_template"."""
        if limits is None:
            yield
            return
        token = _budget.set(limits.max_chars)
        try:
            with _time_limit(limits.timeout):
                yield
        except _TooLarge:
            raise InvalidRequestError(
                TEMPLATE_FIELD,
                f"the chat template writes more than {limits.max_chars} characters for these messages, more than "
                "this server's context can hold; rendering was stopped there",
            ) from None
        except _RenderTimeout:
            raise InvalidRequestError(
                TEMPLATE_FIELD, f"the chat template did not finish rendering within {limits.timeout:g} s"
            ) from None
        except MemoryError:
            raise InvalidRequestError(
                TEMPLATE_FIELD, "the chat template needed more memory than a render may use"
            ) from None
        finally:
            _budget.reset(token)

    def _encode(
        self, chat: list[dict[str, Any]], tokenizer: Tokenizer, add_generation_prompt: bool, extra: dict[str, Any]
    ) -> tuple[str, list[int]]:
        specials = _special_texts(tokenizer)
        for i, message in enumerate(chat):
            for key, value in message.items():
                if key != "content":
                    specials.refuse_in(value, f"messages[{i}].{key}")
        for key, value in extra.items():
            specials.refuse_in(value, "tools" if key == "tools" else f"{KWARGS_FIELD}.{key}")
        text = self._render(chat, add_generation_prompt, extra)
        suspects = [i for i, message in enumerate(chat) if specials.may_form(message["content"])]
        if not suspects:
            return text, tokenizer.encode(text)

        pieces = self._render_marked(chat, suspects, add_generation_prompt, extra, text)
        spans, pos = [], 0
        for is_content, piece in pieces:
            if is_content:
                spans.append((pos, pos + len(piece)))
            pos += len(piece)
        found = specials.occurrences(text)
        if not any(s < content_end and content_start < e for s, e in found for content_start, content_end in spans):
            return text, tokenizer.encode(text)
        ids: list[int] = []
        for is_content, piece in pieces:
            if not piece:
                continue
            if is_content:
                piece_ids = tokenizer.encode(piece, literal=True)
                if specials.ids.intersection(piece_ids):  # a vocabulary that merges plain text into a control token
                    raise InvalidRequestError(
                        "messages", "a message's content encodes to a control token even as plain text"
                    )
                ids += piece_ids
            else:
                ids += tokenizer.encode(piece)
        return text, ids

    # ------------------------------------------------------------------ internals
    @staticmethod
    def _with_tools(extra: dict[str, Any], tools: list[dict[str, Any]] | None) -> dict[str, Any]:
        """The template variables with `tools` set (the checked kwargs never hold it: it is a reserved name)."""
        return extra if tools is None else {**extra, "tools": [_plain(t, "tools") for t in tools]}

    def _checked_kwargs(self, template_kwargs: dict[str, Any]) -> dict[str, Any]:
        """The request's extra template variables as plain JSON data; none may replace a variable the server sets."""
        checked = {}
        for key, value in template_kwargs.items():
            field = f"{KWARGS_FIELD}.{key}"
            if key in _SERVER_VARIABLES or key in self.variables:
                raise InvalidRequestError(field, "is set by the server, not by the request")
            checked[key] = _plain(value, field)
        return checked

    def _render(self, chat: list[dict[str, Any]], add_generation_prompt: bool, extra: dict[str, Any]) -> str:
        try:
            pieces = self._template.generate(
                messages=chat,
                documents=None,
                add_generation_prompt=bool(add_generation_prompt),
                **self.variables,
                **{"tools": None, **extra},  # `tools` only from `_with_tools`: the kwargs may not set it
            )
            if _budget.get() is None:
                return "".join(pieces)
            out, size = [], 0
            for piece in pieces:  # stopped at the bound, not after the whole text exists
                size += len(piece)
                _check_size(size)
                out.append(piece)
            return "".join(out)
        except (_TooLarge, _RenderTimeout, MemoryError):
            raise
        except _TemplateRaised as exc:
            raise InvalidRequestError("messages", str(exc)) from exc
        except SecurityError as exc:
            raise InvalidRequestError(
                "messages", f"the chat template did something its sandbox forbids: {exc}"
            ) from exc
        except TemplateError as exc:
            raise InvalidRequestError("messages", f"the chat template cannot render these messages: {exc}") from exc
        except Exception as exc:  # TypeError, ZeroDivisionError, … raised by the template's expressions on this input
            raise InvalidRequestError(
                "messages", f"the chat template failed on these messages ({type(exc).__name__}: {exc})"
            ) from exc

    def _render_marked(
        self, chat: list[dict[str, Any]], suspects: list[int], add_generation_prompt: bool, extra: dict, text: str
    ) -> list[tuple[bool, str]]:
        """Render again with the suspect contents wrapped in sentinels; [(is_content, piece), …] whose pieces join
        to `text`, or InvalidRequestError when the template did not pass the wrapped contents through whole."""
        contents = [chat[i]["content"] for i in suspects]
        free = (chr(c) for c in _SENTINEL_CANDIDATES if chr(c) not in text and all(chr(c) not in s for s in contents))
        start, end = next(free), next(free)
        marked = [dict(message) for message in chat]
        for i in suspects:
            # Surrounding whitespace stays outside the sentinels: a template that trims content renders the same.
            content = marked[i]["content"]
            rest = content.lstrip()
            lead, core = content[: len(content) - len(rest)], rest.rstrip()
            trail = rest[len(core) :]
            if not core:
                lead, core, trail = "", content, ""
            marked[i]["content"] = f"{lead}{start}{core}{end}{trail}"
        rendered = self._render(marked, add_generation_prompt, extra)
        pieces: list[tuple[bool, str]] = []
        inside, pos, balanced = False, 0, True
        for match in re.finditer(f"[{start}{end}]", rendered):
            if (match.group() == start) == inside:  # a start inside a content, or an end outside one
                balanced = False
                break
            pieces.append((inside, rendered[pos : match.start()]))
            inside, pos = not inside, match.end()
        pieces.append((False, rendered[pos:]))
        if not balanced or inside or "".join(piece for _, piece in pieces) != text:
            raise InvalidRequestError(
                "messages",
                "the chat template transforms message content that holds special-token text (or a fragment of it), "
                "so that text cannot be kept literal; remove it from the message",
            )
        return pieces


@functools.lru_cache(maxsize=8)
def _compiled(source: str, variables: tuple[tuple[str, str], ...], origin: str) -> ChatTemplate:
    """A `ChatTemplate` rebuilt from its pickled parts, compiled once per distinct template (immutable after
    construction, so one instance serves every caller)."""
    return ChatTemplate(source, variables=dict(variables), origin=origin)


# ---------------------------------------------------------------------------------------------- messages
def _checked_messages(messages: Any) -> list[dict[str, Any]]:
    """Fresh plain-data copies of `messages` as the template sees them, or InvalidRequestError naming the field."""
    if not isinstance(messages, list | tuple) or not messages:
        raise InvalidRequestError("messages", "must be a non-empty list of message objects")
    chat = []
    for i, message in enumerate(messages):
        field = f"messages[{i}]"
        if not isinstance(message, Mapping):
            raise InvalidRequestError(field, f"must be an object with 'role' and 'content', got {_kind(message)}")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise InvalidRequestError(f"{field}.role", f"must be a non-empty string, got {_kind(role)}")
        checked: dict[str, Any] = {}
        for key, value in message.items():
            if not isinstance(key, str):
                raise InvalidRequestError(field, f"keys must be strings, got {_kind(key)}")
            if key == "content":
                checked[key] = _joined_content(value, f"{field}.content")
            elif value is not None:  # transformers drops null fields: templates handle a missing key better
                checked[key] = _plain(value, f"{field}.{key}")
        if "content" not in checked:
            raise InvalidRequestError(f"{field}.content", "is required")
        reasoning = next((checked[k] for k in _REASONING_KEYS if checked.get(k) is not None), None)
        if reasoning is not None:  # the names templates read a message's reasoning under (as transformers fills them)
            checked = {"thinking": reasoning, **checked, "reasoning_content": reasoning}
        chat.append(checked)
    return chat


def _joined_content(content: Any, field: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list | tuple):
        raise InvalidRequestError(field, f"must be a string or a list of text parts, got {_kind(content)}")
    if not content:
        raise InvalidRequestError(field, "must not be an empty list")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind != "text":
            what = f"type {kind!r}" if isinstance(part, Mapping) else _kind(part)
            raise InvalidRequestError(field, f"part {j} has {what}; only {{'type': 'text', 'text': ...}} is supported")
        if not isinstance(part.get("text"), str):
            raise InvalidRequestError(field, f"part {j}'s text must be a string, got {_kind(part.get('text'))}")
        texts.append(part["text"])
    return PART_SEPARATOR.join(texts)


def _plain(value: Any, field: str) -> Any:
    """A copy of a JSON value made of exact builtin types (subclasses could carry methods the sandbox allows)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, list | tuple):
        return [_plain(item, f"{field}[{k}]") for k, item in enumerate(value)]
    if isinstance(value, Mapping):
        out = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise InvalidRequestError(field, f"keys must be strings, got {_kind(key)}")
            out[str.__str__(key)] = _plain(item, f"{field}.{key}")
        return out
    raise InvalidRequestError(field, f"must be a JSON value, got {_kind(value)}")


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


# ---------------------------------------------------------------------------------------------- special tokens
@dataclass(frozen=True)
class _SpecialTexts:
    """A tokenizer's special tokens as text, and the questions `encode` asks about them."""

    texts: frozenset[str]
    ids: frozenset[int]
    special_re: re.Pattern[str]
    """Any special text, longest first."""
    starts_re: re.Pattern[str]
    """Matches (empty) wherever a special text starts, capturing the longest one that starts there."""
    prefixes: frozenset[str]
    """The non-empty proper prefixes of the special texts (a content ending in one may join with what follows)."""
    suffixes: frozenset[str]
    longest: int

    def may_form(self, content: str) -> bool:
        """Whether `content` could be, or be part of, special-token text in the rendered string (as written, or
        with its surrounding whitespace trimmed, as templates often do)."""
        if not self.texts or not content:
            return False
        if self.special_re.search(content):
            return True
        for text in {content, content.strip()} - {""}:
            if len(text) < self.longest and any(text in t for t in self.texts):
                return True
            reach = min(len(text), self.longest - 1)
            if any(text[-k:] in self.prefixes or text[:k] in self.suffixes for k in range(1, reach + 1)):
                return True
        return False

    def occurrences(self, text: str) -> list[tuple[int, int]]:
        """Every (start, end) of special text in `text`, overlapping ones included: a superset of the control
        tokens the tokenizer will find there, whatever the order it matches them in."""
        return [(m.start(), m.start() + len(m.group(1))) for m in self.starts_re.finditer(text)]

    def refuse_in(self, value: Any, field: str) -> None:
        """InvalidRequestError when special-token text appears in any string of `value` (a non-content field)."""
        if isinstance(value, str):
            if self.texts and self.special_re.search(value):
                raise InvalidRequestError(field, "must not contain special-token text")
        elif isinstance(value, list):
            for k, item in enumerate(value):
                self.refuse_in(item, f"{field}[{k}]")
        elif isinstance(value, dict):
            for key, item in value.items():
                self.refuse_in(key, field)
                self.refuse_in(item, f"{field}.{key}")


_special_cache: weakref.WeakKeyDictionary[Tokenizer, _SpecialTexts] = weakref.WeakKeyDictionary()


def _special_texts(tokenizer: Tokenizer) -> _SpecialTexts:
    found = _special_cache.get(tokenizer)
    if found is None:
        # The wrapped `tokenizers.Tokenizer` is the only place that knows which added tokens are special
        # (shared_model.bundle reads `_tk` the same way).
        added = tokenizer._tk.get_added_tokens_decoder()
        texts = frozenset(t.content for t in added.values() if t.special and t.content)
        ids = frozenset(i for i, t in added.items() if t.special and t.content)
        alternation = "|".join(re.escape(t) for t in sorted(texts, key=len, reverse=True)) or "(?!)"  # never matches
        found = _SpecialTexts(
            texts=texts,
            ids=ids | tokenizer.special_ids,
            special_re=re.compile(alternation),
            starts_re=re.compile(f"(?=({alternation}))"),
            prefixes=frozenset(t[:k] for t in texts for k in range(1, len(t))),
            suffixes=frozenset(t[k:] for t in texts for k in range(1, len(t))),
            longest=max((len(t) for t in texts), default=0),
        )
        _special_cache[tokenizer] = found
    return found


# ---------------------------------------------------------------------------------------------- folder files
def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{path}: cannot read the chat template ({exc})") from exc


def _read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{path}: cannot read it as JSON ({exc})") from exc
    if not isinstance(value, dict):
        raise ModelLoadError(f"{path}: must hold a JSON object, got {_kind(value)}")
    return value


def _special_token_variables(folder: Path, config: dict[str, Any]) -> dict[str, str]:
    """The `*_token` variables transformers passes to the template (its tokenizer's `special_tokens_map`)."""
    entries = dict(config)
    legacy = folder / SPECIAL_TOKENS_MAP_FILE
    if "added_tokens_decoder" not in config and legacy.is_file():
        entries.update(_read_json(legacy))  # transformers merges it over the config in that case
    variables = {}
    for key, value in entries.items():
        if key in _STANDARD_TOKEN_KEYS or key.endswith("_token"):
            token = _token_text(value)
            if token is not None:
                variables[key] = token
    extra = config.get("extra_special_tokens")
    if isinstance(extra, dict):  # named extra tokens become variables too
        for key, value in extra.items():
            token = _token_text(value)
            if isinstance(key, str) and token is not None:
                variables[key] = token
    return variables


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json stores it: a string or an AddedToken object {"content": ...}."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None
