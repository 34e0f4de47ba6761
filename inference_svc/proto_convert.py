"""Conversions between `tandem.inference.v1` messages and the engine's types, and nothing else.

Contract:
- `sampling_from_proto` maps every SamplingParams field; an unset optional field takes the engine default, so
  validation stays in `SamplingParams` (an invalid value raises `InvalidRequestError` naming the field).
  `n` is not an engine setting: `n_from_proto` reads it (default 1). `structured_output` becomes a
  `StructuredOutput` whose errors name `structured_output`.
- `stream_message(out)` is one GenerateStreamResponse per increment; `response_from(completions)` builds the unary
  GenerateResponse from the `Completion`s the engine's increments accumulated into (one per choice).
- Prompt logprobs go out as one `PositionLogprobs` per prompt token after the first (the first has none).
- `model_info_to_proto` names the model by its served name (the folder's own name by default), never a path.
- Pure functions of their arguments (on CUDA, `model_info_to_proto` also reads the allocator's peak); no I/O.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from inference_svc.engine.types import (
    Completion,
    EngineInfo,
    FinishReason,
    RequestOutput,
    SamplingParams,
    StructuredOutput,
    Timing,
    TokenLogprob,
    Usage,
)
from inference_svc.errors import InvalidRequestError
from inference_svc.proto_gen import inference_pb2 as pb

_SAMPLING_OPTIONAL = (
    "max_new_tokens", "temperature", "top_k", "top_p", "min_p", "seed", "repetition_penalty",
    "presence_penalty", "frequency_penalty", "min_tokens", "top_logprobs", "prompt_logprobs",
    "num_speculative_tokens",
)  # fmt: skip

FINISH_REASONS = {
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.CANCELLED: pb.FINISH_REASON_CANCELLED,
}


def sampling_from_proto(s: pb.SamplingParams, lora_name: str = "") -> SamplingParams:
    """proto SamplingParams (and GenerateRequest.lora_name, "" for the base model) → engine SamplingParams (unset
    optional fields take the engine defaults)."""
    kwargs: dict[str, Any] = {name: getattr(s, name) for name in _SAMPLING_OPTIONAL if s.HasField(name)}
    return SamplingParams(
        **kwargs,
        stop=tuple(s.stop),
        stop_token_ids=tuple(s.stop_token_ids),
        ignore_eos=s.ignore_eos,
        logprobs=s.logprobs,
        logit_bias=dict(s.logit_bias),
        structured=structured_from_proto(s.structured_output) if s.HasField("structured_output") else None,
        lora_name=lora_name or None,
    )


def structured_from_proto(so: pb.StructuredOutput) -> StructuredOutput:
    param = "structured_output"
    kind = so.WhichOneof("kind")
    if kind is None:
        raise InvalidRequestError(param, "set one of json_schema, json_object, regex, grammar, choice")
    if kind == "json_schema":
        return StructuredOutput("json", so.json_schema, param)
    if kind == "json_object":
        return StructuredOutput("json_object", "", param)
    if kind == "choice":
        return StructuredOutput("choice", json.dumps(list(so.choice.choices)), param)
    return StructuredOutput(kind, getattr(so, kind), param)


def n_from_proto(s: pb.SamplingParams) -> int:
    return s.n if s.HasField("n") else 1


def prompt_from_proto(request: pb.GenerateRequest) -> str | list[int]:
    which = request.WhichOneof("input")
    if which == "prompt":
        return request.prompt
    if which == "prompt_token_ids":
        return list(request.prompt_token_ids.ids)
    raise InvalidRequestError("prompt", "set either prompt (text) or prompt_token_ids")


def usage_to_proto(u: Usage) -> pb.Usage:
    return pb.Usage(**asdict(u))


def usage_total(completions: Sequence[Completion]) -> Usage:
    """One request's usage over its n completions: the prompt once, everything generated summed."""
    first = completions[0].usage
    return Usage(
        prompt_tokens=first.prompt_tokens,
        completion_tokens=sum(c.usage.completion_tokens for c in completions),
        cached_prompt_tokens=first.cached_prompt_tokens,
        draft_tokens=sum(c.usage.draft_tokens for c in completions),
        accepted_draft_tokens=sum(c.usage.accepted_draft_tokens for c in completions),
        decode_steps=sum(c.usage.decode_steps for c in completions),
    )


def timing_to_proto(t: Timing | None) -> pb.Timing:
    t = t or Timing()
    return pb.Timing(queue_ms=t.queue_ms, ttft_ms=t.ttft_ms, tpot_ms=t.tpot_ms, total_ms=t.total_ms)


def position_to_proto(e: TokenLogprob) -> pb.PositionLogprobs:
    return pb.PositionLogprobs(
        token_id=e.token_id, logprob=e.logprob, top=[pb.TokenLogprob(token_id=t, logprob=v) for t, v in e.top]
    )


def _prompt_positions(entries: Sequence[TokenLogprob | None] | None) -> list[pb.PositionLogprobs]:
    return [position_to_proto(e) for e in entries or () if e is not None]


def _set_stop(msg: Any, stop_reason: str | int | None) -> None:
    if isinstance(stop_reason, str):
        msg.stop_string = stop_reason
    elif isinstance(stop_reason, int):
        msg.stop_token_id = stop_reason


def stream_message(out: RequestOutput) -> pb.GenerateStreamResponse:
    msg = pb.GenerateStreamResponse(
        request_id=out.request_id, text=out.text_delta, token_ids=out.new_token_ids, index=out.index
    )  # one per streamed token: the repeated fields below are set only when the request asked for them
    if out.logprobs:
        msg.logprobs.extend(out.logprobs)
    if out.top_logprobs:
        msg.top_logprobs.extend(position_to_proto(e) for e in out.top_logprobs)
    if out.prompt_logprobs:
        msg.prompt_logprobs.extend(_prompt_positions(out.prompt_logprobs))
    if out.finished:
        msg.finish_reason = FINISH_REASONS.get(out.finish_reason, pb.FINISH_REASON_UNSPECIFIED)
        msg.usage.CopyFrom(usage_to_proto(out.usage))
        msg.timing.CopyFrom(timing_to_proto(out.timing))
        _set_stop(msg, out.stop_reason)
    return msg


def response_from(request_id: str, completions: Sequence[Completion]) -> pb.GenerateResponse:
    """The unary answer: choice 0 at the top level, every choice in `choices` when there are several."""
    first = completions[0]
    response = pb.GenerateResponse(
        request_id=request_id,
        text=first.text,
        token_ids=first.token_ids,
        finish_reason=FINISH_REASONS.get(first.finish_reason, pb.FINISH_REASON_UNSPECIFIED),  # type: ignore[arg-type]
        logprobs=first.logprobs or [],
        top_logprobs=[position_to_proto(e) for e in first.top_logprobs or ()],
        prompt_logprobs=_prompt_positions(first.prompt_logprobs),
    )
    _set_stop(response, first.stop_reason)
    response.usage.CopyFrom(usage_to_proto(usage_total(completions)))
    response.timing.CopyFrom(timing_to_proto(first.timing))
    if len(completions) > 1:
        for c in completions:
            choice = pb.Choice(
                index=c.index,
                text=c.text,
                token_ids=c.token_ids,
                finish_reason=FINISH_REASONS.get(c.finish_reason, pb.FINISH_REASON_UNSPECIFIED),  # type: ignore[arg-type]
                logprobs=c.logprobs or [],
                top_logprobs=[position_to_proto(e) for e in c.top_logprobs or ()],
            )
            _set_stop(choice, c.stop_reason)
            response.choices.append(choice)
    return response


def lora_adapters_to_proto(slots: Any) -> tuple[list[pb.LoraAdapter], int]:
    """(The loaded adapters by name, the slot count) of a `LoraSlots` (None: LoRA off) for `ModelInfo`."""
    if slots is None:
        return [], 0
    loaded = sorted(dict(slots.loaded).values(), key=lambda a: a.name)  # a copy: the engine thread may change it
    return [pb.LoraAdapter(name=a.name, path=a.path, rank=a.rank) for a in loaded], slots.max_loras


def model_info_to_proto(
    info: EngineInfo, max_request_bytes: int, model_name: str, http_port: int | None, metrics_port: int | None
) -> pb.ModelInfo:
    mc = asdict(info.model_config)
    typed = {k: mc[k] for k in pb.ModelConfig.DESCRIPTOR.fields_by_name if k in mc and k != "config_json"}
    config = pb.ModelConfig(**typed, num_parameters=info.num_parameters, config_json=json.dumps(mc, sort_keys=True))
    extra = {"peak_workspace_bytes": float(info.peak_workspace_bytes), **_ledger_figures(info, model_name)}
    if info.device.startswith("cuda"):  # the allocator's own peak (`tandem bench --compare` reads it)
        import torch

        extra["peak_allocated_bytes"] = float(torch.cuda.max_memory_allocated(info.device))
    ledger = pb.MemoryLedger(
        weight_bytes=info.weight_bytes,
        kv_bytes_per_token=info.kv_bytes_per_token,
        kv_cache_bytes=info.kv_cache_bytes,
        kv_capacity_tokens=info.kv_capacity_tokens,
        kv_blocks_total=info.kv_blocks_total,
        kv_block_size=info.config.block_size,
        extra=extra,
        kv_bytes_per_block=info.kv_bytes_per_block,
        draft_kv_bytes_per_block=info.draft_kv_bytes_per_block,
        draft_kv_cache_bytes=info.draft_kv_cache_bytes,
        draft_weight_bytes=info.draft_weight_bytes,
    )
    return pb.ModelInfo(
        model_name=model_name,
        config=config,
        max_context=info.max_model_len,
        dtype=info.dtype,
        attention_backend=info.attention_backend,
        device=info.device,
        kv_capacity_tokens=info.kv_capacity_tokens,
        ledger=ledger,
        max_new_tokens_limit=info.config.max_new_tokens_limit,
        max_request_bytes=max_request_bytes,
        quantization=info.quantization,
        http_port=http_port or 0,
        metrics_port=metrics_port or 0,
        kv_cache_dtype=info.kv_cache_dtype,
        draft_model=info.draft_model_path.name if info.draft_model_path is not None else "",
        compiled=info.compiled,
        compile_seconds=info.compile_seconds,
        load_plan=[pb.LoadChoice(lever=c.lever, value=c.value, reason=c.reason) for c in info.load_plan],
    )


def _ledger_figures(info: EngineInfo, model_name: str) -> dict[str, float]:
    """The shared memory ledger's formulas for the served model at its max context (one sequence)."""
    from shared_model.ledger import ledger_report

    rep = ledger_report(
        info.model_config, model_name, context=info.max_model_len,
        kv_dtype=info.kv_cache_dtype, weight_dtype=info.dtype, quantization=info.quantization,
        group_size=info.config.quantization_group_size, kv_block_size=info.config.block_size,
    )  # fmt: skip
    return {  # the formula for what the engine measured (ledger.weight_bytes): the two agree
        "ledger.weight_bytes": float(rep.inference["served_weight_bytes"]),
        "ledger.kv_bytes_per_sequence_at_max_context": float(rep.kv_cache["bytes"]),
    }
