"""A client with no generated stubs and no .proto file: everything comes from server reflection (what grpcurl and
grpc-js reflection clients do). The descriptors live in a private pool filled only by the reflection service."""

from __future__ import annotations

import grpc
from google.protobuf import descriptor_pool, json_format, message_factory
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

SERVICE = "tandem.inference.v1.Inference"


def test_call_through_reflection_alone(server) -> None:
    with grpc.insecure_channel(server.target) as channel:
        db = ProtoReflectionDescriptorDatabase(channel)
        assert SERVICE in db.get_services()
        assert "grpc.health.v1.Health" in db.get_services()
        pool = descriptor_pool.DescriptorPool(db)
        service = pool.FindServiceByName(SERVICE)
        assert {m.name for m in service.methods} == {"Generate", "GenerateStream", "Tokenize", "GetModelInfo", "Embed"}

        def rpc(method_name: str, request_json: dict, streaming: bool = False):
            method = service.FindMethodByName(method_name)
            request_cls = message_factory.GetMessageClass(method.input_type)
            response_cls = message_factory.GetMessageClass(method.output_type)
            request = json_format.ParseDict(request_json, request_cls())
            factory = channel.unary_stream if streaming else channel.unary_unary
            call = factory(
                f"/{SERVICE}/{method_name}",
                request_serializer=lambda m: m.SerializeToString(),
                response_deserializer=response_cls.FromString,
            )
            result = call(request, timeout=30)
            if streaming:
                return [json_format.MessageToDict(m) for m in result]
            return json_format.MessageToDict(result)

        unary = rpc("Generate", {"prompt": "def f(x):", "sampling": {"maxNewTokens": 6, "ignoreEos": True}})
        assert len(unary["tokenIds"]) == 6
        assert unary["finishReason"] == "FINISH_REASON_LENGTH"
        assert unary["usage"]["completionTokens"] == 6
        stream = rpc(
            "GenerateStream", {"prompt": "def f(x):", "sampling": {"maxNewTokens": 6, "ignoreEos": True}}, True
        )
        assert "".join(m.get("text", "") for m in stream) == unary.get("text", "")
        assert stream[-1]["finishReason"] == "FINISH_REASON_LENGTH"
        info = rpc("GetModelInfo", {})
        assert info["config"]["modelType"] == "qwen3"
        tok = rpc("Tokenize", {"text": "hello"})
        assert len(tok["tokenIds"]) == len(tok["tokens"]) > 0
