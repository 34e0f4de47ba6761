"""One native batch-1 kernel at two commits, in one process: the baseline's source and this checkout's, built side
by side under op namespaces of their own, timed in interleaved rounds on the decoder's projections.

A kernel change moves a projection by a few percent, and this host's speed moves by a third between minutes: two
runs of a benchmark minutes apart cannot tell the change from the host. Here both builds run in the same process,
taking turns round by round on the same weights, so the host's drift moves both sides of each ratio alike.

What it does:
1. Reads the kernel's file (`--kernel row_gemm` or `tile_gemm`, bf16 only: tandem_native/csrc/row_gemm.cpp;
   `int4_gemv`: int4_gemv.cpp; `int8_gemv`, one row only: int8_gemv.cpp) and the headers beside it at `--baseline`
   (a git revision, through `git show`) and in this checkout, renames the op namespace (`tandem` -> `tandem_ab_base`
   / `tandem_ab_new`), leaves out the module's Python registrations, and builds each alone (with the files it calls
   into there, `COMPANIONS`) with the library's own flags (`tandem_native.loader.FLAGS`) under
   `~/.cache/tandem/kernel_ab/<hash of the source>`.
2. Checks what each computes: at 1-4 rows and `--rows`, whether the two builds give the same bits, and each one's
   largest difference from the fp32 reference (`x @ w.T` for the dense kernels; `shared_model.int4_gemv.reference`
   for int4, `shared_model.int8_gemv.reference` for int8).
3. Times one token's projections of the decoder (`--hidden`, `--intermediate`, `--kv-size`, `--layers`, and the
   LM head of `--vocab` rows but for int4, whose model's LM head is an int8 copy): every matrix its own weights,
   called back to back from Python, `--rounds` rounds in turns (the order reversed every round), per thread count;
   prints each build's median ms a token, GB/s of weight bytes, and new / base (> 1: this checkout faster).

    .venv/bin/python benchmarks/kernel_ab.py --baseline HEAD~1 --kernel row_gemm --dtype fp32
    .venv/bin/python benchmarks/kernel_ab.py --baseline e613777 --kernel int4_gemv --rows 1 --threads 2,1
    .venv/bin/python benchmarks/kernel_ab.py --baseline HEAD --kernel tile_gemm --dtype bf16 --rows 64
    .venv/bin/python benchmarks/kernel_ab.py --baseline 24cbd50 --kernel int8_gemv --dtype bf16
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch.utils.cpp_extension import load

from shared_model import int4_gemv, int8_gemv
from shared_model.quantize import quantize_int4, quantize_int8
from tandem_native import loader

REPO = Path(__file__).resolve().parents[1]
CSRC = "tandem_native/csrc"
KERNELS = {
    "row_gemm": "row_gemm.cpp",
    "tile_gemm": "row_gemm.cpp",
    "int4_gemv": "int4_gemv.cpp",
    "int8_gemv": "int8_gemv.cpp",
}
COMPANIONS = {"row_gemm.cpp": ("dot_gemm.cpp",)}
"""Files a kernel file calls into (`row_gemm.cpp`'s `table_gemm` runs `dot_gemm.cpp`'s kernel without AMX): built
beside it where the revision has them, so the side loads without an undefined symbol."""
DENSE = ("row_gemm", "tile_gemm")
"""The dense kernels (bf16 or fp32 weights; `tile_gemm`: bf16 on AMX tiles, for many rows)."""
CACHE = Path.home() / ".cache" / "tandem" / "kernel_ab"
GROUP = 64
"""int4 group size (the serving default)."""


def source_at(rev: str | None, path: str) -> str:
    """The file's text at git revision `rev` (None: this checkout's working tree)."""
    if rev is None:
        return (REPO / path).read_text()
    return subprocess.run(["git", "show", f"{rev}:{path}"], cwd=REPO, check=True, capture_output=True, text=True).stdout


def headers_at(rev: str | None) -> dict[str, str]:
    if rev is None:
        return {p.name: p.read_text() for p in (REPO / CSRC).glob("*.h")}
    names = subprocess.run(["git", "ls-tree", "--name-only", rev, f"{CSRC}/"], cwd=REPO, check=True,
                           capture_output=True, text=True).stdout.split()  # fmt: skip
    return {Path(n).name: source_at(rev, n) for n in names if n.endswith(".h")}


def namespaced(text: str, namespace: str, what: str) -> str:
    """A kernel file's text with its ops under `namespace` instead of `tandem` and without the module's pybind
    registrations (`void register_...`, the file's end); SystemExit naming `what` when it declares no ops."""
    cut = text.find("\nvoid register_")
    text = text if cut < 0 else text[:cut] + "\n"
    for macro in ("TORCH_LIBRARY_FRAGMENT", "TORCH_LIBRARY_IMPL"):
        if f"{macro}(tandem," not in text:
            raise SystemExit(f"{what} has no {macro}(tandem, ...)")
        text = text.replace(f"{macro}(tandem,", f"{macro}({namespace},")
    return text


def companions_at(rev: str | None, file: str) -> list[str]:
    """`COMPANIONS` of `file` that exist at `rev` (None: this checkout)."""
    names = COMPANIONS.get(file, ())
    if rev is None:
        return [n for n in names if (REPO / CSRC / n).exists()]
    listed = subprocess.run(["git", "ls-tree", "--name-only", rev, f"{CSRC}/"], cwd=REPO, check=True,
                            capture_output=True, text=True).stdout.split()  # fmt: skip
    return [n for n in names if f"{CSRC}/{n}" in listed]


def build(kernel: str, rev: str | None, namespace: str):
    """`kernel`'s file at `rev` (and its `COMPANIONS` there) built with its ops under `torch.ops.<namespace>`;
    returns that namespace."""
    file = KERNELS[kernel]
    texts = [
        namespaced(source_at(rev, f"{CSRC}/{name}"), namespace, f"{name} at {rev or 'this checkout'}")
        for name in (file, *companions_at(rev, file))
    ]
    headers = headers_at(rev)
    key = hashlib.sha256("\0".join([*texts, *sorted(headers.values()), *loader.FLAGS, torch.__version__]).encode())
    folder = CACHE / f"{namespace}-{key.hexdigest()[:16]}"
    folder.mkdir(parents=True, exist_ok=True)
    sources = []
    for i, text in enumerate(texts):
        sources.append(folder / (f"{namespace}.cpp" if i == 0 else f"{namespace}_{i}.cpp"))
        sources[-1].write_text(text)
    for name, body in headers.items():
        (folder / name).write_text(body)
    t0 = time.monotonic()
    load(name=namespace, sources=[str(s) for s in sources], extra_cflags=loader.FLAGS,
         extra_ldflags=["-fopenmp"], build_directory=str(folder), is_python_module=False)  # fmt: skip
    print(f"built {kernel} at {rev or 'this checkout'} as torch.ops.{namespace} ({time.monotonic() - t0:.0f} s)")
    return getattr(torch.ops, namespace)


class Projections:
    """One token's projections of the decoder, `mats` [(weight operands, K)], and how each build's op multiplies
    one (`call`), what it should give (`reference`) and a whole token's worth (`token`)."""

    def __init__(self, kernel: str, dtype: torch.dtype, args: argparse.Namespace) -> None:
        h, f, kv = args.hidden, args.intermediate, args.kv_size
        shapes = [(h + 2 * kv, h), (h, h), (2 * f, h), (h, f)] * args.layers  # [N, K]: qkv, o, gate_up, down
        if kernel != "int4_gemv":  # the int4 model's LM head is an int8 copy (int8_gemv's)
            shapes.append((args.vocab, h))
        gen = torch.Generator().manual_seed(0)
        self.kernel, self.mats, self.bytes = kernel, [], 0
        for n, k in shapes:
            w = torch.randn(n, k, generator=gen) * 0.02
            if kernel in DENSE:
                wt = w.to(dtype)
                self.mats.append(((wt,), k))
                self.bytes += wt.numel() * wt.element_size()
            elif kernel == "int8_gemv":
                q, s = quantize_int8(w)
                sc = s.to(dtype)  # [N]
                self.mats.append(((q, sc), k))
                self.bytes += q.numel() + sc.numel() * sc.element_size()
            else:
                q, s, z = quantize_int4(w, GROUP)
                codes = int4_gemv.pack(q, GROUP)  # a fresh tensor: 64-byte aligned, as the kernel requires
                sz = torch.stack([s, z]).to(dtype).contiguous()  # [2, N, G]
                self.mats.append(((codes, sz), k))
                self.bytes += codes.numel() + sz.numel() * sz.element_size()

    def call(self, ns, x: torch.Tensor, operands: tuple) -> torch.Tensor:
        if self.kernel in DENSE:
            return getattr(ns, self.kernel)(x, operands[0])
        if self.kernel == "int8_gemv":  # one row: x [1, K] -> [1, N]
            return ns.int8_gemv(x[0], operands[0], operands[1], int8_gemv.activation_group(x.shape[1]))[None]
        return ns.int4_gemv(x, operands[0], operands[1], GROUP)

    def reference(self, x: torch.Tensor, operands: tuple) -> torch.Tensor:
        if self.kernel in DENSE:
            return x.float() @ operands[0].float().t()
        if self.kernel == "int8_gemv":
            return int8_gemv.reference(x[0], operands[0], operands[1]).float()[None]
        return int4_gemv.reference(x, operands[0], operands[1], GROUP).float()

    def token(self, ns, xs: dict[int, torch.Tensor]) -> None:
        for operands, k in self.mats:
            self.call(ns, xs[k], operands)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--baseline", required=True, help="git revision whose kernel is the baseline")
    p.add_argument("--kernel", choices=sorted(KERNELS), default="row_gemm")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32",
                   help="row_gemm's weights and activations; int4's and int8's activations and scales")  # fmt: skip
    p.add_argument("--rows", type=int, default=1, help="activation rows a call (decode streams)")
    p.add_argument("--threads", default="2", help="comma-separated intra-op thread counts")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--intermediate", type=int, default=2048)
    p.add_argument("--kv-size", type=int, default=256, help="K (and V) projection width")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--vocab", type=int, default=8192)
    args = p.parse_args(argv)
    if loader.unsupported() is not None:
        raise SystemExit(f"the native kernels cannot run here: {loader.unsupported()}")
    if args.rows < 1 or args.rounds < 1:
        p.error("--rows and --rounds must be at least 1")
    if args.kernel == "int8_gemv" and args.rows != 1:
        p.error("int8_gemv takes one row (--rows 1)")
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    sides = {
        "base": build(args.kernel, args.baseline, "tandem_ab_base"),
        "new": build(args.kernel, None, "tandem_ab_new"),
    }
    proj = Projections(args.kernel, dtype, args)
    gen = torch.Generator().manual_seed(1)
    operands, k = proj.mats[2]  # gate_up: the widest projection
    x = torch.randn(max(4, args.rows), k, generator=gen).to(dtype)
    for m in [1] if args.kernel == "int8_gemv" else sorted({1, 2, 3, 4, args.rows}):
        out = {name: proj.call(ns, x[:m], operands) for name, ns in sides.items()}
        ref = proj.reference(x[:m], operands)
        diffs = ", ".join(f"{name} {(o.float() - ref).abs().max().item():.3g}" for name, o in out.items())
        print(f"{m} row{'s' if m > 1 else ''}: same bits {torch.equal(out['base'], out['new'])}; "
              f"largest difference from the fp32 reference: {diffs}")  # fmt: skip
    xs = {kk: torch.randn(args.rows, kk, generator=gen).to(dtype) for kk in {kk for _, kk in proj.mats}}
    print(f"{args.kernel} {args.dtype}, {args.rows} row(s), {len(proj.mats)} matrices ({proj.bytes / 1e6:.0f} MB a "
          f"token), {args.rounds} rounds; base {args.baseline}, new this checkout")  # fmt: skip
    for threads in [int(t) for t in args.threads.split(",") if t.strip()]:
        torch.set_num_threads(threads)
        times: dict[str, list[float]] = {name: [] for name in sides}
        for r in range(args.rounds):
            for name in sides if r % 2 == 0 else reversed(list(sides)):
                proj.token(sides[name], xs)  # its first pass after the other's: the caches hold the other's lines
                t0 = time.perf_counter()
                for _ in range(5):
                    proj.token(sides[name], xs)
                times[name].append((time.perf_counter() - t0) / 5)
        med = {name: statistics.median(v) for name, v in times.items()}
        cells = [f"{name} {med[name] * 1e3:.3f} ms ({proj.bytes / med[name] / 1e9:.1f} GB/s)" for name in sides]
        print(f"{threads} thread(s): {', '.join(cells)}; new / base {med['base'] / med['new']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
