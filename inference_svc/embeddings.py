"""Embeddings of several inputs through the served engine, shared by `POST /v1/embeddings` and the `Embed` RPC.

Contract:
- `embed(engine, inputs, pooling, dimensions, field)` tokenizes the text inputs as prompts are (through the
  tokenizer gate; no BOS or EOS added), takes token-id inputs as given, and returns ([N, H'] float32 vectors in
  input order, prompt tokens summed): `AsyncEngine.embed` (prompt-only forwards on the engine thread between
  steps, pooled by `pooling`), then `dimensions` truncation when given (`Pooling.truncate`).
- Refusals are `InvalidRequestError`s naming the request's own parameter: `field` for an input (empty, too long
  for the context, an id outside the vocabulary), `dimensions` above the model's hidden size. Nothing runs on the
  engine before every input is tokenized and `dimensions` checked.
"""

from __future__ import annotations

from typing import Any

import torch

from inference_svc.engine.pooling import Pooling
from inference_svc.errors import InvalidRequestError

MAX_EMBEDDING_INPUTS = 2048
"""Most inputs one embeddings request may hold (OpenAI's limit)."""
_INPUT_FIELDS = frozenset({"prompt", "prompt_token_ids"})


async def embed(
    engine: Any, inputs: list[str | list[int]], pooling: Pooling, dimensions: int | None, field: str
) -> tuple[torch.Tensor, int]:
    """([N, dimensions or H] float32, prompt tokens) for `inputs` (see the module docstring)."""
    width = engine.engine.model_config.hidden_size
    if dimensions is not None and dimensions > width:
        raise InvalidRequestError("dimensions", f"{dimensions} is above the model's {width} dimensions")
    try:
        prompts = [await engine.prompt_ids(x) for x in inputs]
        vectors = await engine.embed(prompts, pooling)  # [N, H]
    except InvalidRequestError as exc:
        if type(exc) is not InvalidRequestError or exc.field not in _INPUT_FIELDS:
            raise
        raise InvalidRequestError(field, str(exc).removeprefix(f"{exc.field}: ")) from None
    if dimensions is not None:
        vectors = pooling.truncate(vectors, dimensions)
    return vectors, sum(len(ids) for ids in prompts)
