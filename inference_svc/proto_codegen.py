"""Regenerate `inference_svc/proto_gen/` from `proto/tandem/inference/v1/inference.proto`.

Contract:
- The generated modules are committed, so `pip install -e .` gives working stubs without running codegen.
  `python -m inference_svc.proto_codegen` rewrites them; `tests/inference_svc/server/test_proto_drift.py` fails
  when the committed files differ from what this produces (run it after editing the .proto).
- protoc (from grpcio-tools) runs with `-I proto`, so the descriptor's file name is
  `tandem/inference/v1/inference.proto` (what reflection clients see). The one absolute import protoc writes into
  the gRPC module (`from tandem.inference.v1 import inference_pb2`) is rewritten to point into this package.
- The gRPC module's `GRPC_GENERATED_VERSION` (the least grpcio it imports under) is written as the `grpcio>=`
  floor of pyproject.toml's `serve` extra, not the generating grpcio-tools' own version: the committed stubs then
  depend on the .proto alone, and a fresh install that resolves a newer grpcio-tools regenerates the same bytes.
"""

from __future__ import annotations

import re
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
PROTO_ROOT = REPO_ROOT / "proto"
PROTO_FILE = "tandem/inference/v1/inference.proto"
OUT_DIR = Path(__file__).resolve().parent / "proto_gen"
GENERATED = ("inference_pb2.py", "inference_pb2.pyi", "inference_pb2_grpc.py")
_IMPORT_FROM = "from tandem.inference.v1 import inference_pb2"
_IMPORT_TO = "from inference_svc.proto_gen import inference_pb2"
_VERSION_LINE = re.compile(r"^GRPC_GENERATED_VERSION = '[^']*'$", re.MULTILINE)


def generate() -> dict[str, str]:
    """Run protoc into a temporary folder; return {file name: text} of the modules to commit."""
    from grpc_tools import protoc  # dev-only dependency (grpcio-tools)

    with tempfile.TemporaryDirectory() as tmp:
        include = str(Path(protoc.__file__).parent / "_proto")
        args = [
            "grpc_tools.protoc",
            f"-I{PROTO_ROOT}",
            f"-I{include}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            str(PROTO_ROOT / PROTO_FILE),
        ]
        rc = protoc.main(args)
        if rc != 0:
            raise RuntimeError(f"protoc failed with exit code {rc}: {' '.join(args)}")
        gen_dir = Path(tmp) / Path(PROTO_FILE).parent
        out = {name: (gen_dir / name).read_text() for name in GENERATED}
    grpc_module = out["inference_pb2_grpc.py"].replace(_IMPORT_FROM, _IMPORT_TO)
    grpc_module, found = _VERSION_LINE.subn(f"GRPC_GENERATED_VERSION = '{grpcio_floor()}'", grpc_module, count=1)
    if found != 1:
        raise RuntimeError("protoc's gRPC module has no GRPC_GENERATED_VERSION line to pin")
    out["inference_pb2_grpc.py"] = grpc_module
    return out


def grpcio_floor(pyproject: Path = REPO_ROOT / "pyproject.toml") -> str:
    """The X of the `"grpcio>=X"` requirement in pyproject.toml (the `serve` extra's; read as text: Python 3.10
    has no TOML parser)."""
    match = re.search(r'^\s*"grpcio>=([0-9][0-9.]*)"', pyproject.read_text(), re.MULTILINE)
    if match is None:
        raise RuntimeError(f"{pyproject}: no '\"grpcio>=X\"' requirement")
    return match.group(1)


def main() -> int:
    OUT_DIR.mkdir(exist_ok=True)
    for name, text in generate().items():
        (OUT_DIR / name).write_text(text)
        print(f"wrote {OUT_DIR / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
