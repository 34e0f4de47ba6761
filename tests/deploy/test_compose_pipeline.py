"""docker-compose.yml, run for real without Docker: each service's own command as a local process, in dependency
order — train (one-shot, must exit 0) → inference (must pass its compose healthcheck) → bench (must exit 0) — with
the compose file's arguments, its variables substituted as Compose does, and container paths re-rooted in a temp
folder (see compose_local.py).

The only inputs are environment variables the compose file itself documents: a fast training run through
TANDEM_TRAIN_OVERRIDES, free ports through TANDEM_GRPC_PORT / TANDEM_METRICS_PORT, a short sweep through
TANDEM_BENCH_ARGS and the results folder through TANDEM_BENCH_DIR. configs/demo.yaml is the compose default;
until it exists, TANDEM_TRAIN_CONFIG points at configs/tiny-cpu.yaml.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

from tests.conftest import free_port
from tests.deploy.compose_local import LocalCompose

REPO = Path(__file__).resolve().parents[2]

FAST_TRAIN = (
    "trainer.max_steps=1 trainer.devices=1 trainer.limit_val_batches=0 trainer.enable_progress_bar=false "
    "data.max_documents=8 data.block_size=64 data.batch_size=2 checkpoints.every_n_steps=1 logging.tensorboard=false"
)
SHORT_BENCH = (
    "--concurrency 1,2 --num-requests 6 --warmup 1 --input-len 24 --output-len 8 --len-dist fixed "
    "--duration 30 --no-progress"
)


@pytest.mark.slow
@pytest.mark.timeout(420)
@pytest.mark.skipif(importlib.util.find_spec("lightning") is None, reason="training extra not installed")
def test_compose_services_run_in_order(tmp_path: Path) -> None:
    bench_dir = tmp_path / "bench-results"
    env = {
        "TANDEM_TRAIN_OVERRIDES": FAST_TRAIN,
        "TANDEM_GRPC_PORT": str(free_port()),
        "TANDEM_METRICS_PORT": str(free_port()),
        "TANDEM_BENCH_ARGS": SHORT_BENCH,
        "TANDEM_BENCH_DIR": str(bench_dir),
        "TANDEM_RUN_NAME": "ci",
    }
    if not (REPO / "configs/demo.yaml").is_file():
        env["TANDEM_TRAIN_CONFIG"] = "configs/tiny-cpu.yaml"
    compose = LocalCompose(REPO / "docker-compose.yml", env, tmp_path / "compose")
    assert compose.order(("bench",)) == ["train", "inference", "bench"]

    train = compose.plan("train")
    done = compose.run_one_shot(train, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:]
    bundle_line = [ln for ln in done.stdout.splitlines() if ln.startswith("bundle: ")][-1]
    bundle = Path(bundle_line.removeprefix("bundle: ")).resolve()
    assert bundle == (tmp_path / "compose/volumes/runs/ci/bundle").resolve()  # the named volume, as inference sees it
    assert (bundle / "model.safetensors").is_file()

    serve = compose.plan("inference")
    assert serve.depends_on["train"] == "service_completed_successfully"
    compose.start(serve)
    try:
        compose.wait_healthy(serve, limit=120)
        bench = compose.plan("bench")
        result = compose.run_one_shot(bench, timeout=150)
        assert result.returncode == 0, result.stdout[-3000:]
    finally:
        exit_code = compose.stop(serve)
    assert exit_code == 0, compose.log("inference")[-3000:]
    assert "tandem serve: stopped" in compose.log("inference")

    runs = list(bench_dir.glob("*/results.json"))  # default --out: ./bench-results/<timestamp> in working_dir
    assert len(runs) == 1, result.stdout
    report = json.loads(runs[0].read_text())
    assert [lv["label"] for lv in report["levels"]] == ["c=1", "c=2"]
    for level in report["levels"]:
        s = level["summary"]
        assert s["completed"] == 6 and s["failed"] == 0
        assert s["total_output_tokens"] == 6 * 8
        check = level["server_check"]
        assert check is not None and check["tokens_agree"], check
    assert {p.name for p in runs[0].parent.iterdir()} >= {"throughput_latency.png", "latency_cdf.png"}
    assert re.search(r"results: .*bench-results", result.stdout)
