"""`python -m inference_svc.healthcheck HOST:PORT`: exit 0 iff the server's grpc.health.v1 says SERVING.

Contract: one `Check` call for `--service` (default "", the whole server) with a `--timeout` deadline (default 3 s).
Exit 0 on SERVING; 1 on any other status, an RPC error or no answer in time, with one line on stderr saying which.
Health is never behind the API key, so no credentials are needed; `--tls-ca` (or `--tls`) for a TLS server. This is
the container healthcheck of `docker-compose.yml` and works as a Kubernetes exec probe.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path


def check(target: str, service: str = "", timeout: float = 3.0, root_ca: bytes | None = None, tls: bool = False) -> str:
    """The serving status name ('SERVING', 'NOT_SERVING', ...); raises grpc.RpcError when there is no answer."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    if tls or root_ca is not None:
        channel = grpc.secure_channel(target, grpc.ssl_channel_credentials(root_certificates=root_ca))
    else:
        channel = grpc.insecure_channel(target)
    with channel:
        resp = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=timeout
        )
    return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)


def main(argv: Sequence[str] | None = None) -> int:
    import grpc

    p = argparse.ArgumentParser(prog="python -m inference_svc.healthcheck", description=__doc__.splitlines()[0])
    p.add_argument("target", help="HOST:PORT of the gRPC server")
    p.add_argument("--service", default="", help="service name to check ('' = the whole server)")
    p.add_argument("--timeout", type=float, default=3.0, help="deadline in seconds")
    p.add_argument("--tls", action="store_true", help="use TLS with the system roots")
    p.add_argument("--tls-ca", default=None, help="PEM file of the CA to trust (implies --tls)")
    args = p.parse_args(sys.argv[1:] if argv is None else list(argv))
    root = Path(args.tls_ca).read_bytes() if args.tls_ca else None
    try:
        status = check(args.target, args.service, args.timeout, root, args.tls)
    except grpc.RpcError as exc:
        print(f"healthcheck {args.target}: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    if status != "SERVING":
        print(f"healthcheck {args.target}: {status}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
