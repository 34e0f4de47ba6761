"""The committed generated code matches the .proto: regenerate into a temporary folder and compare byte for byte.
After editing `proto/tandem/inference/v1/inference.proto`, run `python -m inference_svc.proto_codegen`."""

from __future__ import annotations

import subprocess
import sys

import pytest

from inference_svc import proto_codegen


def test_generated_code_matches_proto() -> None:
    pytest.importorskip("grpc_tools")
    generated = proto_codegen.generate()
    assert set(generated) == set(proto_codegen.GENERATED)
    for name, text in generated.items():
        committed = (proto_codegen.OUT_DIR / name).read_text()
        assert committed == text, f"{name} drifted from the .proto: run `python -m inference_svc.proto_codegen`"


def test_generated_package_imports_without_grpc_tools() -> None:
    """A fresh install needs no codegen step: the stubs import in a clean interpreter without grpc_tools."""
    code = (
        "import sys; sys.modules['grpc_tools'] = None\n"
        "from inference_svc.proto_gen import inference_pb2, inference_pb2_grpc\n"
        "assert inference_pb2.DESCRIPTOR.name == 'tandem/inference/v1/inference.proto'\n"
        "assert hasattr(inference_pb2_grpc, 'InferenceStub')\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_field_numbers_are_stable() -> None:
    """Wire compatibility: these numbers are published; changing one is a breaking change (see the .proto policy)."""
    from inference_svc.proto_gen import inference_pb2 as pb

    def numbers(msg) -> dict[str, int]:
        return {f.name: f.number for f in msg.DESCRIPTOR.fields}

    assert numbers(pb.GenerateRequest) == {
        "request_id": 1, "prompt": 2, "prompt_token_ids": 3, "sampling": 4, "lora_name": 5,
    }  # fmt: skip
    assert numbers(pb.SamplingParams) == {
        "max_new_tokens": 1, "temperature": 2, "top_k": 3, "top_p": 4, "min_p": 5, "seed": 6,
        "repetition_penalty": 7, "stop": 8, "stop_token_ids": 9, "ignore_eos": 10, "logprobs": 11,
        "presence_penalty": 12, "frequency_penalty": 13, "logit_bias": 14, "min_tokens": 15, "top_logprobs": 16,
        "prompt_logprobs": 17, "n": 18, "num_speculative_tokens": 19, "structured_output": 20,
    }  # fmt: skip
    assert numbers(pb.StructuredOutput) == {"json_schema": 1, "json_object": 2, "regex": 3, "grammar": 4, "choice": 5}
    assert numbers(pb.ChoiceList) == {"choices": 1}
    assert numbers(pb.Usage) == {
        "prompt_tokens": 1, "completion_tokens": 2, "cached_prompt_tokens": 3, "draft_tokens": 4,
        "accepted_draft_tokens": 5, "decode_steps": 6,
    }  # fmt: skip
    assert numbers(pb.Timing) == {"queue_ms": 1, "ttft_ms": 2, "tpot_ms": 3, "total_ms": 4}
    common = {
        "request_id": 1, "text": 2, "token_ids": 3, "finish_reason": 4, "usage": 5, "timing": 6, "logprobs": 7,
        "top_logprobs": 8, "prompt_logprobs": 9, "stop_string": 10, "stop_token_id": 11,
    }  # fmt: skip
    assert numbers(pb.GenerateResponse) == {**common, "choices": 12}
    assert numbers(pb.GenerateStreamResponse) == {**common, "index": 12}
    assert numbers(pb.Choice) == {
        "index": 1, "text": 2, "token_ids": 3, "finish_reason": 4, "logprobs": 5, "top_logprobs": 6,
        "stop_string": 7, "stop_token_id": 8,
    }  # fmt: skip
    assert numbers(pb.TokenLogprob) == {"token_id": 1, "logprob": 2}
    assert numbers(pb.PositionLogprobs) == {"token_id": 1, "logprob": 2, "top": 3}
    assert numbers(pb.ModelInfo)["http_port"] == 12 and numbers(pb.ModelInfo)["metrics_port"] == 13
    assert numbers(pb.ModelInfo)["kv_cache_dtype"] == 14
    assert numbers(pb.MemoryLedger)["kv_bytes_per_block"] == 8
    assert numbers(pb.ModelInfo)["draft_model"] == 15
    assert numbers(pb.ModelInfo)["lora_adapters"] == 19 and numbers(pb.ModelInfo)["max_loras"] == 20
    assert numbers(pb.LoraAdapter) == {"name": 1, "path": 2, "rank": 3}
    draft = {k: v for k, v in numbers(pb.MemoryLedger).items() if k.startswith("draft_")}
    assert draft == {"draft_kv_bytes_per_block": 9, "draft_kv_cache_bytes": 10, "draft_weight_bytes": 11}
    assert dict(pb.FinishReason.items()) == {
        "FINISH_REASON_UNSPECIFIED": 0, "FINISH_REASON_STOP": 1, "FINISH_REASON_LENGTH": 2,
        "FINISH_REASON_CANCELLED": 3,
    }  # fmt: skip
