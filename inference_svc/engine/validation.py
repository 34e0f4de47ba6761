"""Request validation: every check a request gets before it reaches the scheduler, against what is fixed at load.

Contract:
- `RequestValidator` holds only what is fixed when the engine is built (its config, the model's config, the
  tokenizer, the EOS ids, the context length and the KV pool's size), so any thread may call it: the async engine
  refuses a whole multi-prompt request before any of it reaches the engine.
- Every refusal is an `InvalidRequestError` naming the field (`prompt`, `prompt_token_ids`, `max_new_tokens`,
  `stop_token_ids`, `logit_bias`, `min_tokens`) and saying what the limit is and which setting sets it.
- `check_text_prompt` / `check_encoded` are the checks a text prompt gets before and after tokenization, shared by
  the engine and the async engine (which tokenizes off the engine thread).
"""

from __future__ import annotations

from dataclasses import dataclass

from inference_svc.engine.config import EngineConfig
from inference_svc.engine.types import SamplingParams
from inference_svc.errors import InvalidRequestError
from shared_model.config import ModelConfig
from shared_model.tokenizer import Tokenizer


@dataclass(frozen=True)
class RequestValidator:
    """The engine's request checks, over what is fixed at load."""

    config: EngineConfig
    model_config: ModelConfig
    tokenizer: Tokenizer
    eos_ids: frozenset[int]
    max_model_len: int
    num_blocks: int

    def check_request(self, prompt_ids: list[int], sampling: SamplingParams) -> None:
        """`InvalidRequestError` naming the field when `Engine.add_request` would refuse these token ids or these
        sampling parameters (everything but the request id)."""
        self.prompt_ids(prompt_ids)
        self.check_sampling(sampling)

    def check_prompt_length(self, num_tokens: int) -> None:
        """InvalidRequestError when a prompt of `num_tokens` tokens cannot fit the context (prompt + at least one
        generated token). Reads only what is fixed at load, so any thread may call it (the async engine does,
        before a long prompt's ids become a list)."""
        if num_tokens >= self.max_model_len:
            raise InvalidRequestError(
                "prompt",
                f"the prompt has {num_tokens} tokens; this engine's context holds {self.max_model_len} "
                f"(prompt + at least one generated token), limited by {self.context_limit()}",
            )

    def context_limit(self) -> str:
        """What sets `max_model_len`, in the words of the setting a user would change."""
        if self.max_model_len == self.model_config.max_position_embeddings:
            return f"the model's max_position_embeddings ({self.model_config.max_position_embeddings}, config.json)"
        if self.max_model_len == self.config.max_model_len:
            return f"max_model_len ({self.config.max_model_len}, --max-model-len)"
        return f"the KV-cache pool ({self.num_blocks} blocks of {self.config.block_size} tokens)"

    def prompt_ids(self, prompt: str | list[int]) -> list[int]:
        """The checked token ids of a prompt (a text prompt is encoded first)."""
        if isinstance(prompt, str):
            check_text_prompt(prompt)
            ids = check_encoded(self.tokenizer.encode(prompt))
            self.check_prompt_length(len(ids))
            return ids
        ids = list(prompt)
        if not ids:
            raise InvalidRequestError("prompt_token_ids", "the prompt has no tokens")
        self.check_prompt_length(len(ids))  # before the scan below, which is as long as the prompt
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError("prompt_token_ids", f"ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        return ids

    def check_sampling(self, sampling: SamplingParams) -> None:
        """`InvalidRequestError` naming the field when these sampling parameters do not fit this engine."""
        if sampling.max_new_tokens > self.config.max_new_tokens_limit:
            raise InvalidRequestError(
                "max_new_tokens",
                f"{sampling.max_new_tokens} is above this engine's limit of {self.config.max_new_tokens_limit}",
            )
        vocab = self.model_config.vocab_size
        bad_stop = [t for t in sampling.stop_token_ids if t >= vocab]
        if bad_stop:
            raise InvalidRequestError("stop_token_ids", f"ids {bad_stop} are outside the vocabulary")
        bad_bias = [t for t, _ in sampling.logit_bias if t >= vocab]
        if bad_bias:
            raise InvalidRequestError("logit_bias", f"token ids {bad_bias[:5]} are outside the vocabulary [0, {vocab})")
        check_min_tokens(sampling, vocab, self.eos_ids)


def check_text_prompt(text: str) -> None:
    """The checks a text prompt gets before it is tokenized (the engine's and the async engine's, one place)."""
    if not text:
        raise InvalidRequestError("prompt", "the prompt is empty")


def check_min_tokens(sampling: SamplingParams, vocab: int, eos_ids: frozenset[int]) -> None:
    """Refuse `min_tokens` > 0 when the tokens it keeps out until then (the stop token ids, and EOS unless
    `ignore_eos`) are the whole vocabulary: nothing could be sampled before `min_tokens`."""
    if sampling.min_tokens <= 0:
        return
    banned = set(sampling.stop_token_ids) | (set() if sampling.ignore_eos else set(eos_ids))
    if len({t for t in banned if 0 <= t < vocab}) >= vocab:
        raise InvalidRequestError(
            "min_tokens",
            f"every token id of the vocabulary ({vocab}) is a stop token (stop_token_ids, and EOS unless ignore_eos), "
            "so no token could be sampled before min_tokens; lower min_tokens to 0 or stop on fewer ids",
        )


def check_encoded(ids: list[int]) -> list[int]:
    """The check a text prompt gets once tokenized."""
    if not ids:
        raise InvalidRequestError("prompt", "the prompt encodes to no tokens")
    return ids
