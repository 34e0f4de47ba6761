"""The local compose runner's own contract: Compose interpolation rules and how a service becomes a process."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.deploy.compose_local import InterpolationError, LocalCompose, interpolate, parse_duration, read_dockerfile

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("text", "env", "expected"),
    [
        ("${A}", {"A": "x"}, "x"),
        ("$A/b", {"A": "x"}, "x/b"),
        ("${A}", {}, ""),
        ("${A:-d}", {"A": ""}, "d"),
        ("${A-d}", {"A": ""}, ""),
        ("${A-d}", {}, "d"),
        ("${A:+alt}", {"A": "1"}, "alt"),
        ("${A:+alt}", {"A": ""}, ""),
        ("${A+alt}", {"A": ""}, "alt"),
        ("${A:-${B:-deep}}", {}, "deep"),
        ("${A:-/runs/${B:-demo}/bundle}", {"B": "x"}, "/runs/x/bundle"),
        ("$$A ${A}", {"A": "v"}, "$A v"),
        ("cost $5", {}, "cost $5"),
    ],
)
def test_interpolation_follows_compose(text: str, env: dict[str, str], expected: str) -> None:
    assert interpolate(text, env) == expected


def test_required_variable_missing_is_an_error() -> None:
    with pytest.raises(InterpolationError, match="B"):
        interpolate("${B:?set B}", {})
    with pytest.raises(InterpolationError):
        interpolate("${A", {})


def test_durations() -> None:
    assert parse_duration("1m30s") == 90
    assert parse_duration("500ms") == 0.5
    with pytest.raises(ValueError):
        parse_duration("5 seconds")


def test_dockerfiles_final_stage_facts() -> None:
    train = read_dockerfile(REPO / "docker/train.Dockerfile")
    assert train.entrypoint == ["tandem"]
    assert train.workdir == "/home/tandem"
    assert ("configs", "/home/tandem/configs") in train.copies
    serve = read_dockerfile(REPO / "docker/inference.Dockerfile")
    assert serve.entrypoint == ["tandem"]
    assert not serve.copies  # the runtime stage copies only the venv from the builder stage


def test_plans_map_paths_hosts_and_env(tmp_path: Path) -> None:
    env = {"TANDEM_RUN_NAME": "r1", "TANDEM_GRPC_PORT": "50123", "TANDEM_TRAIN_OVERRIDES": "trainer.max_steps=1"}
    compose = LocalCompose(REPO / "docker-compose.yml", env, tmp_path)
    assert compose.order(("bench", "monitoring")) == ["train", "inference", "bench"]
    assert compose.external(("monitoring",)) == ["prometheus"]
    train = compose.plan("train")
    root = tmp_path / "train" / "root"
    assert train.argv[1:] == [
        "train",
        "--config",
        "configs/demo.yaml",
        f"run_dir={root}/runs/r1",
        "trainer.max_steps=1",
    ]
    assert train.cwd == root / "home/tandem"
    assert (train.cwd / "configs").resolve() == (REPO / "configs").resolve()
    serve = compose.plan("inference")
    argv = serve.argv
    assert argv[argv.index("--model") + 1] == f"{tmp_path}/inference/root/runs/r1/bundle"
    assert argv[argv.index("--host") + 1] == "127.0.0.1"
    assert argv[argv.index("--port") + 1] == "50123"
    assert "--api-key-file" not in argv  # only with TANDEM_API_KEYS_FILE
    assert serve.healthcheck is not None and serve.healthcheck[-1] == "127.0.0.1:50123"
    assert serve.depends_on == {"train": "service_completed_successfully"}
    bench = compose.plan("bench")
    assert bench.argv[bench.argv.index("--target") + 1] == "127.0.0.1:50123"
    assert (bench.cwd / "bench-results").is_symlink()


def test_api_keys_switch_on_with_one_variable(tmp_path: Path) -> None:
    keys = tmp_path / "keys.txt"
    keys.write_text("k1\n")
    compose = LocalCompose(REPO / "docker-compose.yml", {"TANDEM_API_KEYS_FILE": str(keys)}, tmp_path / "w")
    for name in ("inference", "bench"):
        plan = compose.plan(name)
        path = Path(plan.argv[plan.argv.index("--api-key-file") + 1])
        assert path.read_text() == "k1\n"
