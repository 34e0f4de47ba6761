"""Generated protobuf and gRPC modules for tandem.inference.v1 (do not edit; see inference_svc.proto_codegen)."""
