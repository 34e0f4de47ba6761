"""`tandem bench`: a load generator for the Tandem gRPC service, or any OpenAI-compatible server, in the manner of
vLLM's `benchmark_serving`.

Modules, each with one job:
- `workload`: what to send — prompt and output lengths drawn from distributions, prompts cut from the default corpus
  (tokenized by the server itself, so lengths are exact in the served model's tokens), or a JSONL dataset's texts.
- `loadgen`: when to send it — Poisson arrivals at a fixed rate or a fixed number of concurrent clients, bounded by a
  request count and a duration; records per-request timings on the client's monotonic clock. Sends over gRPC.
- `openai_backend`: the same requests as streamed `/v1/completions` (SSE) of an OpenAI-compatible server, timed the
  same way; the set-up calls (`/health`, `/v1/models`, `/tokenize`).
- `stats`: per-level summaries (throughput, TTFT, TPOT, ITL, end-to-end: mean/median/p99; errors by status code).
- `server_metrics`: scrapes the server's Prometheus `/metrics` before and after a level and checks the server's
  TTFT and tokens out against the client's.
- `plots`: throughput against TTFT and TPOT across the sweep, and latency CDFs (PNG).
- `cli`: `tandem bench` — the sweep, the progress bar, the console table, results JSON + PNGs.

Nothing here imports Lightning or DeepSpeed: it runs in the inference image.
"""
