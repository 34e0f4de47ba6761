"""docker-compose.yml against the Compose specification's JSON schema, taken from a package, plus the shape the
operator guide promises (one-shot train → healthy inference → bench; optional Prometheus).

The schema is `compose/config/compose_spec.json` inside the PyPI wheel of docker-compose 1.29.2, fetched at test
time with `pip download` into a cache folder (~/.cache/tandem-tests, or $TANDEM_TEST_CACHE). The test is skipped
only when the package registry cannot be reached.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from tests.deploy.compose_local import interpolate_tree

REPO = Path(__file__).resolve().parents[2]
PACKAGE = "docker-compose==1.29.2"
SCHEMA_MEMBER = "compose/config/compose_spec.json"
_OFFLINE_HINTS = (
    "Could not find a version",
    "NewConnectionError",
    "Max retries exceeded",
    "Network is unreachable",
    "Temporary failure in name resolution",
    "ConnectionError",
    "timed out",
)


def _cache_dir() -> Path:
    base = os.environ.get("TANDEM_TEST_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "tandem-tests")
    path = Path(base) / "compose-spec"
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="module")
def compose_schema() -> dict[str, Any]:
    cache = _cache_dir()
    wheels = sorted(cache.glob("docker_compose-1.29.2-*.whl"))
    if not wheels:
        cmd = [sys.executable, "-m", "pip", "download", PACKAGE, "--no-deps", "--only-binary=:all:", "-d", str(cache)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
        if proc.returncode != 0:
            if any(h in proc.stdout + proc.stderr for h in _OFFLINE_HINTS):
                pytest.skip(f"package registry unreachable, cannot fetch {PACKAGE}: {proc.stderr.strip()[-300:]}")
            raise AssertionError(f"pip download {PACKAGE} failed:\n{proc.stdout}\n{proc.stderr}")
        wheels = sorted(cache.glob("docker_compose-1.29.2-*.whl"))
    assert wheels, f"pip download left no wheel of {PACKAGE} in {cache}"
    with zipfile.ZipFile(wheels[0]) as wheel:
        return json.loads(wheel.read(SCHEMA_MEMBER))


@pytest.fixture(scope="module")
def compose_file() -> dict[str, Any]:
    return yaml.safe_load((REPO / "docker-compose.yml").read_text())


def _validate(schema: dict[str, Any], doc: dict[str, Any]) -> None:
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    cls(schema).validate(doc)


def test_compose_file_matches_the_spec(compose_schema: dict[str, Any], compose_file: dict[str, Any]) -> None:
    assert compose_schema["title"] == "Compose Specification"
    _validate(compose_schema, compose_file)
    # Compose validates after interpolation too: with defaults, and with every knob set.
    _validate(compose_schema, interpolate_tree(compose_file, {}))
    knobs = {"TANDEM_API_KEYS_FILE": "/k", "TANDEM_SERVE_ARGS": "--no-warmup", "TANDEM_BENCH_ARGS": "--warmup 0"}
    _validate(compose_schema, interpolate_tree(compose_file, knobs))


def test_the_schema_is_strict_enough_to_catch_mistakes(
    compose_schema: dict[str, Any], compose_file: dict[str, Any]
) -> None:
    bad = copy.deepcopy(compose_file)
    bad["services"]["inference"]["depends_on"]["train"]["condition"] = "service_finished"
    with pytest.raises(jsonschema.ValidationError):
        _validate(compose_schema, bad)
    bad = copy.deepcopy(compose_file)
    bad["services"]["inference"]["healthcheck"]["probe"] = "x"
    with pytest.raises(jsonschema.ValidationError):
        _validate(compose_schema, bad)


def test_the_pipeline_shape(compose_file: dict[str, Any]) -> None:
    s = compose_file["services"]
    assert set(s) == {"train", "inference", "prometheus", "bench"}
    assert s["train"]["restart"] == "no" and "profiles" not in s["train"]
    assert any(v.startswith("runs:/runs") for v in s["train"]["volumes"])
    assert "runs" in compose_file["volumes"]
    assert s["inference"]["depends_on"] == {"train": {"condition": "service_completed_successfully"}}
    assert s["inference"]["healthcheck"]["test"][1:4] == ["python", "-m", "inference_svc.healthcheck"]
    assert s["inference"]["ports"] and "profiles" not in s["inference"]
    assert s["prometheus"]["profiles"] == ["monitoring"]
    assert s["bench"]["profiles"] == ["bench"]
    assert s["bench"]["depends_on"] == {"inference": {"condition": "service_healthy"}}
    assert s["bench"]["command"].startswith("bench --target inference:")


def test_prometheus_scrapes_the_metrics_port(compose_file: dict[str, Any]) -> None:
    prom = yaml.safe_load((REPO / "docker/prometheus.yml").read_text())
    targets = [t for job in prom["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]]
    default_metrics_port = (
        interpolate_tree(compose_file, {})["services"]["inference"]["command"].split("--metrics-port ")[1].split()[0]
    )
    assert targets == [f"inference:{default_metrics_port}"]
    mount = compose_file["services"]["prometheus"]["volumes"][0]
    assert mount.startswith("./docker/prometheus.yml:") and (REPO / "docker/prometheus.yml").is_file()
