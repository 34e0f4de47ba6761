"""The tokenizer work a `TokenizeGate` runs: module-level functions `job(tokenizer, *args) -> result`.

Contract:
- Each job takes the tokenizer first and returns a picklable result. Jobs are named by module and function, so a
  tokenizer process (`inference_svc.tokenizer_process`) can import and run them with its own copy of the tokenizer;
  their arguments and results travel pickled.
- The same job gives the same result whether it runs on the caller's thread, the gate's worker thread or the
  tokenizer process: it depends on nothing but the tokenizer and its arguments.
- `OFF_LOOP` jobs (rendering a chat template) always go to the gate's worker, never inline on the event loop.
- This module imports neither torch nor gRPC (a tokenizer process starts in a fraction of a second): only the
  tokenizer, the generated protobuf messages and the chat template.
"""

from __future__ import annotations

from array import array
from typing import Any

from inference_svc.chat_template import KWARGS_FIELD, ChatTemplate, RenderLimits
from inference_svc.errors import InvalidRequestError
from inference_svc.proto_gen import inference_pb2 as pb
from shared_model.tokenizer import Tokenizer

RESPONSE_CHUNK_TOKENS = 8192
"""Tokens per piece of a Tokenize response: each piece is built and serialized in about a millisecond, so a
thread that builds a long one lets the others run between pieces."""


def encode(tokenizer: Tokenizer, text: str, add_bos: bool = False) -> list[int]:
    """The token ids of `text` (special-token text becomes control tokens, as in transformers)."""
    return tokenizer.encode(text, add_bos)


def encode_prompt(tokenizer: Tokenizer, text: str) -> array:
    """The ids of a text prompt as a compact `array('i')`: it crosses from a tokenizer process as one block of
    bytes, and a prompt too long for the context is refused before its ids become a list of Python ints."""
    return array("i", tokenizer.encode(text))


def decode(tokenizer: Tokenizer, ids: list[int]) -> str:
    """The text of `ids`."""
    return tokenizer.decode(ids)


def tokenize_response(
    tokenizer: Tokenizer, text: str, add_bos: bool = False, chunk_tokens: int = RESPONSE_CHUNK_TOKENS
) -> bytes:
    """The serialized `TokenizeResponse` for `text`: its ids and every id's vocabulary string, built in pieces
    of `chunk_tokens` that concatenate to one message (repeated fields append on the wire)."""
    ids = tokenizer.encode(text, add_bos)
    strings = tokenizer.token_strings()
    step = chunk_tokens
    return b"".join(
        pb.TokenizeResponse(
            token_ids=ids[i : i + step], tokens=[strings[t] for t in ids[i : i + step]]
        ).SerializeToString()
        for i in range(0, len(ids), step)
    )


def chat_encode(
    tokenizer: Tokenizer,
    template: ChatTemplate,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool,
    limits: RenderLimits | None = None,
    template_kwargs: dict[str, Any] | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    """The ids of `messages` rendered by `template` within `limits`, with the request's extra template variables
    (`chat_template_kwargs`) and `tools` (as transformers passes them); content text never becomes a control token."""
    extra = dict(template_kwargs or {})
    for key in ("add_generation_prompt", "limits", "with_tools"):  # encode's own parameters: never template variables
        if key in extra:
            raise InvalidRequestError(f"{KWARGS_FIELD}.{key}", "is set by the server, not by the request")
    return template.encode(
        messages, tokenizer, add_generation_prompt=add_generation_prompt, limits=limits, with_tools=tools, **extra
    )[1]


OFF_LOOP = frozenset({chat_encode})
"""Jobs that run code the request does not bound (a chat template): never run on the caller's thread, however
short their input."""
