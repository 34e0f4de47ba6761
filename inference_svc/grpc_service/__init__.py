"""The gRPC face of the server: the `tandem.inference.v1.Inference` servicer (`servicer`), the guard that answers
requests whose bytes are not the RPC's message before they are parsed (`wire_guard`), and API-key auth (`auth`).

The process that runs them (lifecycle, health, engine thread, metrics, the OpenAI HTTP API beside it, start and
shutdown) is `inference_svc.server.TandemServer`; nothing here starts a server or an engine.
"""

from inference_svc.proto_gen import inference_pb2 as pb

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Inference"].full_name
"""`tandem.inference.v1.Inference`: the service these modules serve and guard."""
