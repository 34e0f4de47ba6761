"""Hostile input against a served model: a flood of 1 MB prompts, requests with the most stop strings allowed, the
engine wedge (requests whose prompts × n cannot fit the queue), idle HTTP connections, and unbounded chat templates.

What it measures, against `tandem serve` run as a subprocess from `--repo` (default: this checkout; give an older
checkout, e.g. a `git worktree` of an earlier commit, to measure "before"), on a free loopback port:
- flood: a bystander streams tokens; meanwhile `--flood` concurrent Generate calls each send a text prompt of
  `--prompt-mb` MB (inside the default --max-request-bytes) and `--tokenize` Tokenize calls the same text. Reported:
  the bystander's p99 and largest inter-token gap during the flood against its own unloaded p99 (same run), the
  status codes the flood got, and the server's RSS before and after, its process and its children (the
  tokenizer process) together (goals: p99 < 3x unloaded, largest gap < 250 ms, RSS back within 100 MiB); also
  the flood's p99 against the p99 of the bystander's own 400 gaps just before the flood
  (`p99_ratio_same_stream`: same stream, same conditions). Two models: one whose context
  cannot hold 1 MB of text (refused unread) and one whose context could (the prompts go through the metered
  tokenizer).
- stops: a bystander's time per output token while `--neighbours` other streams decode with 16 stop strings of
  256 characters each, against the same with plain neighbours (goal: at most 1.2x).
- wedge: `--wedge-clients` processes' threads (4) send, for `--wedge-seconds` (60), `/v1/completions` requests of
  17 prompts with `n: 16` (272 sequences, more than the default queue of 256) back to back, each as soon as the
  last was answered (5 s client timeout). A bystander streams tokens over gRPC throughout (new streams of 2,000
  tokens one after the other). Reported: the bystander's largest inter-token gap during the burst and after it,
  the time from the burst's end to the bystander's next token and to the answer of a fresh one-token Generate
  (goals: no gap over 1 s, answering within 1 s after the burst; the waits are capped at `--wedge-wait` s), the
  burst's status codes, and the server's RSS before and after.
- idle (HTTP): `--idle` connections (default 2,000) that send nothing and one that trickles a request head a byte
  every 0.5 s, held for `--idle-s` seconds; meanwhile `GET /health` on a new connection every 0.25 s. Reported:
  the health answers by status (and whether they were JSON), their worst latency, how many idle sockets the server
  closed and when the last one was, and what the trickler got when. The process's open-file limit is raised to
  fit (the server inherits it).
- template (HTTP): a chat template that renders `lipsum(n=60000)`, ten million words, or `tojson(indent=1e8)` on
  demand (`--template-attacks`); for each, the status and error `param` of the chat request, its duration, the
  worst `/health` latency while it ran, and the server's RSS (its process and the tokenizer process) at its peak
  and 3 s after. The `words-1m` attack (one million words) keeps an unbounded "before" within a shared
  machine's memory; `indent` made an unbounded server take 13 GB and is not for a "before" run on one.
Random weights: only speed and memory mean anything here. Writes JSON (`--out`) and prints a summary.

    python benchmarks/hostile_input.py [--repo DIR] [--out FILE] [--flood 32] [--prompt-mb 1.0] [--floods 1]
        [--cases flood,stops,wedge,idle,template] [--wedge-seconds 60] [--wedge-clients 4] [--idle 2000]
        [--template-attacks lipsum,words,indent]

With `--floods N` the same server takes N floods in a row; `rss_after_each_flood_mib` shows whether memory keeps
growing (a leak) or levels off (allocations made once). The gap figures are the first flood's.
"""

from __future__ import annotations

import argparse
import collections
import functools
import itertools
import json
import multiprocessing
import resource
import selectors
import socket
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc

from inference_svc.client import NO_RETRY, TandemClient, build_request
from inference_svc.serve_process import ServeProcess, free_port
from shared_model.bundle import save_bundle
from shared_model.config import ModelConfig
from shared_model.corpus import CorpusConfig, load_corpus
from shared_model.model import build_model
from shared_model.tokenizer import Tokenizer

REPO = Path(__file__).resolve().parents[1]

STOPS = [("ab" * 128)[:255] + chr(0x41 + i) for i in range(16)]  # 16 x 256 characters, the allowed maximum


REFERENCE_GAPS = 400
"""Gaps of the bystander's own stream measured just before each flood: a second reference beside the separate
unloaded stream, from the same stream and conditions (reported, not the goal's figure)."""


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _descendants(pid: int) -> list[int]:
    kids = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        kids += [int(k) for k in (task / "children").read_text().split()]
    return [k for kid in kids for k in (kid, *_descendants(kid))]


def _tree_rss_mib(pid: int) -> float:
    """The RSS of `pid` and every process under it (the server and its tokenizer process)."""
    return sum(_rss_mib(p) for p in (pid, *_descendants(pid)))


def make_bundle(folder: Path, tokenizer: Tokenizer, max_positions: int) -> Path:
    config = ModelConfig(
        model_type="qwen3", vocab_size=tokenizer.vocab_size, hidden_size=64, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=16, intermediate_size=128, qk_norm=True, max_position_embeddings=max_positions,
    )  # fmt: skip
    return save_bundle(folder, config, build_model(config, seed=0), tokenizer)


class Server:
    """`tandem serve` from `repo` (`inference_svc.serve_process`), with its memory readings."""

    def __init__(
        self, repo: Path, bundle: Path, kv_memory: str, env: dict[str, str] | None = None, http: bool = False
    ) -> None:
        self.http_port = free_port() if http else None
        flags = ["--no-metrics", "--device", "cpu", "--kv-cache-memory", kv_memory, "--log-level", "ERROR"]
        flags += ["--http-port", str(self.http_port)] if http else ["--no-http"]
        self.process = ServeProcess(bundle, flags, env={"PYTHONPATH": str(repo), **(env or {})}, cwd=repo)
        self.proc, self.port, self.target = self.process.proc, self.process.port, self.process.target
        self.process.wait_serving(300)

    def rss(self) -> float:
        """The server's memory: its own process and its children (the tokenizer process)."""
        return _tree_rss_mib(self.proc.pid)

    def own_rss(self) -> float:
        return _rss_mib(self.proc.pid)

    def close(self) -> None:
        self.process.stop(30)


def _stream_times(target: str, stop_event: threading.Event, out: list[float], **sampling: Any) -> None:
    """Stream until finished or `stop_event`; append each message's arrival time to `out`."""
    with TandemClient(target, retry=NO_RETRY, timeout=600) as c:
        stream = c.stub.GenerateStream(build_request("x = 1\n", **sampling), timeout=600)
        try:
            for _ in stream:
                out.append(time.perf_counter())
                if stop_event.is_set():
                    stream.cancel()
                    return
        except grpc.RpcError:
            return


def _gaps_ms(times: list[float], start: float = 0.0, end: float = float("inf")) -> list[float]:
    return [(b - a) * 1000 for a, b in itertools.pairwise(times) if start <= a and b <= end]


def _p99(values: list[float]) -> float:
    # inclusive: within the samples (the default, exclusive, extrapolates past the largest of a short flood's gaps)
    return statistics.quantiles(values, n=100, method="inclusive")[98] if len(values) >= 2 else float("nan")


def _flood_call(target: str, prompt: str, kind: str) -> str:
    with TandemClient(target, retry=NO_RETRY, timeout=300, max_message_bytes=8 << 20) as c:
        try:
            c.tokenize(prompt) if kind == "tokenize" else c.generate(prompt, max_new_tokens=2)
            return f"{kind}:OK"
        except grpc.RpcError as exc:
            return f"{kind}:{exc.code().name}"


def _flood(target: str, n_flood: int, n_tokenize: int, prompt: str) -> dict[str, int]:
    """The flood, all calls at once; run in its own process so that its threads do not share the bystander's GIL."""
    kinds = ["generate"] * n_flood + ["tokenize"] * n_tokenize
    with ThreadPoolExecutor(len(kinds)) as pool:
        return collections.Counter(pool.map(functools.partial(_flood_call, target, prompt), kinds))


def flood_case(
    server: Server, flooder: ProcessPoolExecutor, n_flood: int, n_tokenize: int, prompt: str
) -> dict[str, Any]:
    alone: list[float] = []
    _stream_times(server.target, threading.Event(), alone, max_new_tokens=300, ignore_eos=True)
    unloaded_p99 = _p99(_gaps_ms(alone[1:]))
    rss_before, own_before = server.rss(), server.own_rss()
    done, times = threading.Event(), []
    bystander = threading.Thread(
        target=_stream_times, args=(server.target, done, times), kwargs={"max_new_tokens": 4000, "ignore_eos": True}
    )
    bystander.start()
    while len(times) < 20 + REFERENCE_GAPS and bystander.is_alive():
        time.sleep(0.01)
    reference = _gaps_ms(times[20:])  # the same stream just before the flood (its first 20 tokens warm up)
    t0 = time.perf_counter()
    codes = flooder.submit(_flood, server.target, n_flood, n_tokenize, prompt).result()
    t1 = time.perf_counter()
    done.set()
    bystander.join(60)
    time.sleep(3.0)  # let the server free the flood's buffers (and trim its heap) before reading RSS
    during = _gaps_ms(times, t0, t1)
    return {
        "unloaded_p99_gap_ms": unloaded_p99,
        "flood_s": t1 - t0,
        "gaps_during_flood": len(during),
        "p99_gap_ms": _p99(during),
        "max_gap_ms": max(during, default=float("nan")),
        "p99_ratio": _p99(during) / unloaded_p99,
        "same_stream_unloaded_p99_gap_ms": _p99(reference),
        "p99_ratio_same_stream": _p99(during) / _p99(reference),
        "codes": dict(codes),
        "rss_before_mib": rss_before,
        "rss_after_mib": server.rss(),
        "rss_growth_mib": server.rss() - rss_before,
        "server_process_rss_growth_mib": server.own_rss() - own_before,
    }


def stops_case(server: Server, neighbours: int) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for name, stops in (("plain", []), ("stops", STOPS)):
        done = threading.Event()
        others = [
            threading.Thread(
                target=_stream_times,
                args=(server.target, done, []),
                kwargs={"max_new_tokens": 4000, "ignore_eos": True, "stop": stops, "temperature": 1.0, "seed": i},
            )
            for i in range(neighbours)
        ]
        for t in others:
            t.start()
        time.sleep(0.5)
        times: list[float] = []
        _stream_times(server.target, threading.Event(), times, max_new_tokens=200, ignore_eos=True)
        done.set()
        for t in others:
            t.join(60)
        result[f"{name}_tpot_ms"] = (times[-1] - times[1]) * 1000 / (len(times) - 2)
    result["ratio"] = result["stops_tpot_ms"] / result["plain_tpot_ms"]
    return result


WEDGE_PROMPTS = 17
WEDGE_N = 16


def _wedge_client(url: str, until: float, prompts: list[str]) -> collections.Counter:
    """Send the wedge request back to back until `until` (wall clock); count the answers by status."""
    import httpx2 as httpx

    body = {"prompt": prompts, "n": WEDGE_N, "max_tokens": 16}
    codes: collections.Counter = collections.Counter()
    with httpx.Client(timeout=5.0) as c:
        while time.time() < until:
            try:
                codes[str(c.post(url, json=body).status_code)] += 1
            except httpx.HTTPError as exc:
                codes[type(exc).__name__] += 1
    return codes


def _wedge_burst(url: str, clients: int, seconds: float, prompts: list[str]) -> dict[str, int]:
    """The burst, from its own process (its threads do not share the bystander's GIL)."""
    until = time.time() + seconds
    with ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(lambda _: _wedge_client(url, until, prompts), range(clients)))
    return dict(sum(results, collections.Counter()))


def _bystander(target: str, stop_event: threading.Event, out: list[float]) -> None:
    """Stream tokens (2,000 at a time, stream after stream) until `stop_event`; every message's arrival time."""
    while not stop_event.is_set():
        _stream_times(target, stop_event, out, max_new_tokens=2000, ignore_eos=True)


def wedge_case(server: Server, burster: ProcessPoolExecutor, clients: int, seconds: float, wait: float) -> dict:
    url = f"http://127.0.0.1:{server.http_port}/v1/completions"
    prompts = [f"def handler_{i}(request, context):\n    return request.value + {i}\n" for i in range(WEDGE_PROMPTS)]
    rss_before = server.rss()
    done, times = threading.Event(), []
    bystander = threading.Thread(target=_bystander, args=(server.target, done, times))
    bystander.start()
    while len(times) < 50 and bystander.is_alive():
        time.sleep(0.01)
    t0 = time.perf_counter()
    codes = burster.submit(_wedge_burst, url, clients, seconds, prompts).result()
    t1 = time.perf_counter()
    answer_s: float | str
    with TandemClient(server.target, retry=NO_RETRY, timeout=wait) as c:
        try:
            c.generate("x = 1\n", max_new_tokens=1)
            answer_s = time.perf_counter() - t1
        except grpc.RpcError as exc:
            answer_s = f"no answer within {wait:g} s ({exc.code().name})"
    deadline = time.perf_counter() + wait
    while not [t for t in times if t > t1] and time.perf_counter() < deadline:
        time.sleep(0.01)
    after = [t for t in times if t > t1]
    next_token_s = (after[0] - t1) if after else f"none within {wait:g} s"
    time.sleep(2.0)
    done.set()
    bystander.join(wait + 60)
    during = _gaps_ms(times, t0, t1)
    last_before_end = max((t for t in times if t <= t1), default=t0)
    stall_at_end_ms = ((after[0] if after else time.perf_counter()) - last_before_end) * 1000
    return {
        "burst_s": t1 - t0,
        "clients": clients,
        "request": f"{WEDGE_PROMPTS} prompts x n={WEDGE_N}",
        "codes": codes,
        "bystander_tokens_during_burst": len(during),
        "max_gap_during_burst_ms": max([*during, stall_at_end_ms]),
        "max_gap_after_burst_ms": max(_gaps_ms(times, t1), default=float("nan")),
        "bystander_next_token_after_burst_s": next_token_s,
        "fresh_generate_answered_after_burst_s": answer_s,
        "rss_before_mib": rss_before,
        "rss_after_mib": server.rss(),
    }


def _health(port: int, timeout: float = 30.0) -> tuple[str, float]:
    """One `GET /health` on a new connection: ("200 json" / "503 text" / "error: ..."), seconds it took."""
    import httpx2 as httpx

    t0 = time.perf_counter()
    try:
        r = httpx.get(f"http://127.0.0.1:{port}/health", timeout=timeout)
        kind = "json" if r.headers.get("content-type", "").startswith("application/json") else "text"
        return f"{r.status_code} {kind}", time.perf_counter() - t0
    except Exception as exc:
        return f"error: {type(exc).__name__}", time.perf_counter() - t0


def _raise_open_files(n: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = n + 1024
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want if hard == resource.RLIM_INFINITY else min(want, hard), hard))


def idle_case(server: Server, n_idle: int, hold_s: float) -> dict[str, Any]:
    """Idle sockets and a trickled head against the HTTP port while /health is asked (see the module docstring)."""
    assert server.http_port is not None
    port = server.http_port
    baseline = [_health(port)[1] for _ in range(5)]
    t0 = time.perf_counter()
    socks = []
    for _ in range(n_idle):
        try:
            socks.append(socket.create_connection(("127.0.0.1", port), timeout=10))
        except OSError:
            break
    opened_s = time.perf_counter() - t0
    sel = selectors.DefaultSelector()
    for sock in socks:
        sock.setblocking(False)
        sel.register(sock, selectors.EVENT_READ)
    closed_at: list[float] = []
    trickler = socket.create_connection(("127.0.0.1", port), timeout=10)
    trickle_head = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 1000
    trickle: dict[str, Any] = {"cut_after_s": None, "answer": None}
    stop = threading.Event()

    def trickle_bytes() -> None:
        start = time.perf_counter()
        trickler.settimeout(0.5)
        for i in range(len(trickle_head)):
            if stop.is_set():
                return
            try:
                trickler.sendall(trickle_head[i : i + 1])
                reply = trickler.recv(4096)
            except TimeoutError:
                continue
            except OSError as exc:
                reply = f"{type(exc).__name__}".encode()
            trickle["cut_after_s"] = time.perf_counter() - start
            trickle["answer"] = reply.split(b"\r\n", 1)[0].decode(errors="replace") or "closed without an answer"
            return

    tt = threading.Thread(target=trickle_bytes, daemon=True)
    tt.start()
    statuses: collections.Counter = collections.Counter()
    latencies = []
    start = time.perf_counter()
    next_health = start
    while time.perf_counter() - start < hold_s:
        for key, _ in sel.select(timeout=0.05):
            try:
                data = key.fileobj.recv(1)  # type: ignore[union-attr]
            except OSError:
                data = b""
            if not data:
                closed_at.append(time.perf_counter() - start)
                sel.unregister(key.fileobj)
        if time.perf_counter() >= next_health:
            status, seconds = _health(port, timeout=5.0)
            statuses[status] += 1
            latencies.append(seconds)
            next_health = time.perf_counter() + 0.25
    stop.set()
    tt.join(5)
    for sock in [*socks, trickler]:
        sock.close()
    return {
        "idle_opened": len(socks),
        "open_s": opened_s,
        "hold_s": hold_s,
        "health_unloaded_max_ms": max(baseline) * 1000,
        "health_during": dict(statuses),
        "health_max_ms": max(latencies) * 1000,
        "health_p50_ms": statistics.median(latencies) * 1000,
        "idle_closed_by_server": len(closed_at),
        "last_idle_closed_s": max(closed_at, default=None),
        "trickler": trickle,
    }


TEMPLATE_ATTACKS = {
    "lipsum": "{{ lipsum(n=60000) }}",
    "words": "{% for i in range(100000) %}{% for j in range(100) %}word {% endfor %}{% endfor %}",
    "words-1m": "{% for i in range(10000) %}{% for j in range(100) %}word {% endfor %}{% endfor %}",
    "indent": "{{ messages | tojson(indent=100000000) }}",
}


def template_bundle(bundle: Path) -> Path:
    """`bundle` with a chat template that runs the attack a user message names, else a plain chat."""
    branches = "".join(
        f"{{% {'if' if i == 0 else 'elif'} messages[0]['content'] == '{name}' %}}{source}"
        for i, (name, source) in enumerate(TEMPLATE_ATTACKS.items())
    )
    plain = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    config_path = bundle / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = branches + "{% else %}" + plain + "{% endif %}"
    config_path.write_text(json.dumps(config))
    return bundle


def template_case(server: Server, attacks: list[str]) -> dict[str, Any]:
    import httpx2 as httpx

    assert server.http_port is not None
    base = f"http://127.0.0.1:{server.http_port}"
    out: dict[str, Any] = {"rss_idle_mib": server.rss()}
    for attack in attacks:
        body = {"messages": [{"role": "user", "content": attack}], "max_tokens": 1}
        result: dict[str, Any] = {}

        def send(body: dict = body, result: dict = result) -> None:
            t0 = time.perf_counter()
            try:
                r = httpx.post(base + "/v1/chat/completions", json=body, timeout=600)
                error = (
                    r.json().get("error", {})
                    if r.headers.get("content-type", "").startswith("application/json")
                    else {}
                )
                result.update(
                    status=r.status_code, param=error.get("param"), message=(error.get("message") or r.text)[:160]
                )
            except Exception as exc:
                result.update(status=f"error: {type(exc).__name__}")
            result["seconds"] = time.perf_counter() - t0

        rss_before = server.rss()
        t = threading.Thread(target=send)
        t.start()
        worst, peak = 0.0, rss_before
        while t.is_alive():
            _, seconds = _health(server.http_port, timeout=600)
            worst = max(worst, seconds)
            peak = max(peak, server.rss())
            time.sleep(0.1)
        t.join()
        time.sleep(3.0)
        out[attack] = {**result, "health_max_ms": worst * 1000, "rss_before_mib": rss_before, "rss_peak_mib": peak,
                       "rss_after_3s_mib": server.rss()}  # fmt: skip
        print(attack, json.dumps(out[attack]), flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repo", type=Path, default=REPO, help="source tree whose `tandem serve` is measured")
    p.add_argument("--out", type=Path, default=None, help="JSON results file")
    p.add_argument("--flood", type=int, default=32, help="concurrent large Generate calls")
    p.add_argument("--tokenize", type=int, default=8, help="concurrent large Tokenize calls")
    p.add_argument("--prompt-mb", type=float, default=1.0, help="size of each flood prompt in MB (ASCII text)")
    p.add_argument("--neighbours", type=int, default=8, help="streams beside the bystander in the stop case")
    p.add_argument("--floods", type=int, default=1, help="floods in a row against the same server (RSS after each)")
    p.add_argument("--cases", default="flood,stops,wedge,idle,template", help="comma-separated cases to run")
    p.add_argument("--wedge-seconds", type=float, default=60.0, help="length of the wedge burst")
    p.add_argument("--wedge-clients", type=int, default=4, help="concurrent clients sending the wedge request")
    p.add_argument("--wedge-wait", type=float, default=300.0, help="most seconds to wait for an answer after it")
    p.add_argument("--idle", type=int, default=2000, help="idle HTTP connections in the idle case")
    p.add_argument("--idle-s", type=float, default=12.0, help="seconds the idle connections are held")
    p.add_argument("--template-attacks", default="lipsum,words,indent", help=f"of {','.join(TEMPLATE_ATTACKS)}")
    args = p.parse_args(argv)
    cases_run = set(args.cases.split(","))
    corpus = load_corpus(CorpusConfig(max_documents=80))
    text = "".join(corpus.texts())
    prompt = (text * (1 + int(args.prompt_mb * 1e6) // len(text)))[: int(args.prompt_mb * 1e6 * 0.999)]
    tokenizer = Tokenizer.train(corpus.texts(), vocab_size=2048)
    results: dict[str, Any] = {"repo": str(args.repo), "prompt_chars": len(prompt), "flood": args.flood}
    with tempfile.TemporaryDirectory() as tmp:
        if "wedge" in cases_run:
            server = Server(args.repo, make_bundle(Path(tmp) / "wedge", tokenizer, 4096), "8MiB", http=True)
            burster = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
            try:
                burster.submit(int).result()
                results["wedge"] = wedge_case(server, burster, args.wedge_clients, args.wedge_seconds, args.wedge_wait)
            finally:
                burster.shutdown()
                server.close()
            print("wedge", json.dumps(results["wedge"], indent=1), flush=True)
        if "idle" in cases_run:
            _raise_open_files(args.idle)
            server = Server(args.repo, make_bundle(Path(tmp) / "idle", tokenizer, 4096), "8MiB", http=True)
            try:
                results["idle"] = idle_case(server, args.idle, args.idle_s)
            finally:
                server.close()
            print("idle", json.dumps(results["idle"], indent=1), flush=True)
        if "template" in cases_run:
            bundle = template_bundle(make_bundle(Path(tmp) / "template", tokenizer, 4096))
            server = Server(args.repo, bundle, "8MiB", http=True)
            try:
                results["template"] = template_case(server, args.template_attacks.split(","))
            finally:
                server.close()
        cases = {"context_4k": (4096, "8MiB"), "context_64k": (65536, "40MiB")}
        for name, (positions, kv) in cases.items():
            if "flood" not in cases_run and not (name == "context_4k" and "stops" in cases_run):
                continue
            server = Server(args.repo, make_bundle(Path(tmp) / name, tokenizer, positions), kv)
            flooder = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
            try:
                flooder.submit(int).result()  # the flooding process is started (and has imported) before timing
                if "flood" in cases_run:
                    first = flood_case(server, flooder, args.flood, args.tokenize, prompt)
                    later = [
                        flood_case(server, flooder, args.flood, args.tokenize, prompt) for _ in range(args.floods - 1)
                    ]
                    first["rss_after_each_flood_mib"] = [r["rss_after_mib"] for r in (first, *later)]
                    results[f"flood_{name}"] = first
                    print(name, json.dumps(results[f"flood_{name}"], indent=1), flush=True)
                if name == "context_4k" and "stops" in cases_run:
                    results["stops"] = stops_case(server, args.neighbours)
            finally:
                flooder.shutdown()
                server.close()
    if "stops" in results:
        print("stops", json.dumps(results["stops"], indent=1))
    if args.out:
        args.out.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
