"""`tandem plan` as a new user meets it: units are required, counts read at every scale, headers are whole, and
each recommendation comes with the `tandem train` overrides that apply it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lt_plugins.planner_cli import main

QWEN_8 = ["--model", "qwen3-8b", "--gpus", "8", "--gpu-memory", "80GB", "--seq-len", "4096", "--micro-batch", "1"]
TINY_8 = ["--model", "tiny", "--gpus", "8", "--gpu-memory", "80GB", "--seq-len", "4096", "--micro-batch", "1"]
CONFIG = Path(__file__).resolve().parents[2] / "configs" / "tiny-cpu.yaml"
HEADERS = ["stage", "offload", "precision", "ckpt", "lora", "weights", "frozen", "master", "grads", "moments"]
HEADERS += ["activations"]
HEADERS += ["buckets", "total", "fits", "compute", "comm {unit}", "s/step", "limited by"]


def _run(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[int, str, str]:
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("flag,value", [("--gpu-memory", "80"), ("--gpu-memory", "141"), ("--cpu-memory", "512")])
def test_a_bare_number_is_a_one_line_error_that_suggests_gb(capsys, flag, value) -> None:
    code, out, err = _run(capsys, ["--model", "qwen3-8b", flag, value])
    assert code == 2 and out == ""
    assert err == (
        f"tandem plan: {flag} {value} has no unit: write {value}GB (10^9 bytes per GB) or {value}GiB "
        "(2^30 bytes per GiB)\n"
    )


def test_units_are_read_as_written(capsys) -> None:
    _, out, _ = _run(capsys, ["--model", "qwen3-8b", "--gpu-memory", "80GB"])
    assert "1 GPU(s) x 80.0 GB (72.0 GB usable)" in out
    _, out, _ = _run(capsys, ["--model", "qwen3-8b", "--gpu-memory", "80GiB"])
    assert "1 GPU(s) x 85.9 GB (77.3 GB usable)" in out  # 80 * 2^30 bytes, printed in decimal GB


@pytest.mark.parametrize(
    "model,expected",
    [("tiny", "5.25M parameters (5,245,696)"), ("small", "101M parameters (100,684,032)"),
     ("qwen3-0.6b", "596M parameters (596,049,920)"), ("qwen3-8b", "8.19B parameters (8,190,735,360)")],
)  # fmt: skip
def test_parameter_counts_are_human_readable_at_every_scale(capsys, model, expected) -> None:
    _, out, _ = _run(capsys, ["--model", model, "--gpu-memory", "80GB"])
    assert out.splitlines()[0].startswith(f"Training plan: {model}, {expected}, 1 GPU(s)")


def test_human_count() -> None:
    from shared_model.ledger import human_count

    assert [human_count(n) for n in (0, 512, 999_999, 5_245_696, 100_684_032, 8_190_735_360, 1.5e12)] == [
        "0", "512", "1M", "5.25M", "101M", "8.19B", "1.5T",
    ]  # fmt: skip


@pytest.mark.parametrize("argv,unit", [(QWEN_8, "GB"), (TINY_8, "MB")])
def test_every_header_is_whole_and_columns_line_up(capsys, argv, unit) -> None:
    _, out, _ = _run(capsys, [*argv, "--top", "0"])
    lines = out.splitlines()
    i = next(k for k, line in enumerate(lines) if line.startswith("stage"))
    assert lines[i - 1].startswith(f"Per-GPU {unit} by term (decimal: 1 {unit} = 10^")
    header, rows = lines[i], lines[i + 1 : i + 65]
    names = [h.format(unit=unit) for h in HEADERS]
    assert [part.strip() for part in header.split("  ") if part.strip()] == names  # whole, in order, none cut
    starts = []
    pos = 0
    for name in names:
        pos = header.index(name, pos)
        starts.append(pos)
        pos += len(name)
    assert len(rows) == 64 and all(r.split()[0] in "0123" for r in rows)
    for name, start in zip(names[5:17], starts[5:17], strict=True):  # numeric columns end under their header
        end = start + len(name)
        for r in rows:
            assert r[end - 1] != " " and (end == len(r) or r[end] == " "), (name, r)


def test_recommendations_print_and_return_the_train_overrides_that_apply_them(capsys) -> None:
    _, out, _ = _run(capsys, [*QWEN_8, "--lora", "off"])  # full fine-tuning only (auto plans LoRA on 1 GPU)
    rec = (
        "model.preset=qwen3-8b trainer.accelerator=cuda trainer.devices=8 trainer.precision=bf16-mixed "
        "strategy.name=zero strategy.stage=2 strategy.offload_optimizer=false strategy.offload_params=false "
        "checkpointing.mode=none data.batch_size=1 data.block_size=4096"
    )
    assert f"\n  tandem train [--config FILE] {rec}\n" in out
    one_gpu = rec.replace("devices=8", "devices=1").replace("stage=2", "stage=1")
    one_gpu = one_gpu.replace("offload_optimizer=false", "offload_optimizer=true")
    assert "\n   1 GPU(s): stage 1, offload optimizer, bf16-mixed, checkpointing none (50.8 GB/GPU)\n" in out
    assert f"\n             {one_gpu}\n" in out

    _, out, _ = _run(capsys, [*QWEN_8, "--lora", "off", "--json"])
    data = json.loads(out)
    assert data["recommended"]["overrides"] == rec.split()
    assert data["scaling"]["1"]["overrides"] == one_gpu.split() and data["scaling"]["8"]["overrides"] == rec.split()
    assert all(c["overrides"] for c in data["candidates"])

    _, out, _ = _run(capsys, [*QWEN_8[:3], "16", *QWEN_8[4:], "--json"])
    assert "trainer.devices=8" in (o := json.loads(out)["recommended"]["overrides"]) and "trainer.num_nodes=2" in o


def test_the_overrides_load_into_the_training_config(capsys) -> None:
    from lt_plugins.config import load_config

    _, out, _ = _run(capsys, [*QWEN_8[:3], "1", *QWEN_8[4:], "--lora", "off", "--json"])
    best = json.loads(out)["recommended"]
    cfg = load_config(CONFIG, best["overrides"])
    assert (cfg.strategy.name, cfg.strategy.stage, cfg.strategy.offload_optimizer) == ("zero", best["stage"], True)
    assert cfg.checkpointing.mode == best["checkpointing"] and cfg.trainer.precision == best["precision"]
    assert (cfg.model.preset, cfg.trainer.devices, cfg.trainer.accelerator) == ("qwen3-8b", 1, "cuda")
    assert (cfg.data.batch_size, cfg.data.block_size) == (1, 4096)


def test_the_chunked_loss_shrinks_activations_at_stages_0_to_2_and_its_override_loads(capsys) -> None:
    from lt_plugins.config import load_config
    from lt_plugins.memory_model import FP32
    from shared_model.config import get_preset

    argv = [*QWEN_8[:-1], "8", "--lora", "off", "--precision", "bf16-mixed", "--checkpointing", "full", "--json"]
    plain = {(c["stage"], c["offload"]): c for c in json.loads(_run(capsys, argv)[1])["candidates"]}
    data = json.loads(_run(capsys, [*argv, "--loss-chunk-tokens", "1024"])[1])
    chunked = {(c["stage"], c["offload"]): c for c in data["candidates"]}
    config = get_preset("qwen3-8b")
    # 8 x 4096 tokens: targets (8 B) and fp32 log-softmax over the vocabulary a token, less the head weight gradient
    saved = 8 * 4096 * (8 + FP32 * config.vocab_size) - (FP32 * config.vocab_size * config.hidden_size + 8)
    assert saved > 10e9  # above the break-even of about hidden-size tokens
    for key, c in chunked.items():
        drop = plain[key]["gpu_bytes"]["Saved activations"] - c["gpu_bytes"]["Saved activations"]
        assert drop == pytest.approx(0.0 if c["stage"] == 3 else saved), key  # ZeRO-3: the unchunked path
    assert "model.loss_chunk_tokens=1024" in data["recommended"]["overrides"]
    cfg = load_config(CONFIG, data["recommended"]["overrides"])
    assert cfg.model.loss_chunk_tokens == 1024


def test_default_sequence_length_is_capped_by_the_model(capsys) -> None:
    _, out, _ = _run(capsys, ["--model", "tiny", "--gpu-memory", "80GB"])
    assert "micro-batch 1 x 2048 tokens" in out  # tiny's max_position_embeddings; 4096 is the default otherwise
    _, out, _ = _run(capsys, ["--model", "qwen3-8b", "--gpu-memory", "80GB"])
    assert "micro-batch 1 x 4096 tokens" in out


def test_lora_is_recommended_when_full_fine_tuning_does_not_fit_and_its_overrides_load(capsys) -> None:
    """qwen3-8b on one 24 GB GPU: 147 GB of full fine-tuning state fits only with everything offloaded, so `tandem
    plan` plans LoRA, says so, and recommends a LoRA configuration whose overrides are a valid training config."""
    from lt_plugins.config import load_config

    argv = ["--model", "qwen3-8b", "--gpu-memory", "24GB", "--seq-len", "4096"]
    code, out, _ = _run(capsys, argv)
    assert code == 0
    assert "Full fine-tuning does not fit 1 GPU(s) without offload: planning LoRA (rank 16 on all seven" in out
    assert "43.6M adapter parameters at 18 B each" in out and "it fits, recommended." in out
    _, out, _ = _run(capsys, [*argv, "--json"])
    data = json.loads(out)
    best = data["recommended"]
    assert data["lora_fallback"] and best["lora_rank"] == 16 and best["fits"]
    assert best["gpu_bytes"]["Frozen base weights"] > 0 and best["total"] <= 0.9 * 24e9
    cfg = load_config(CONFIG, best["overrides"])
    assert cfg.lora.enabled and cfg.lora.rank == 16 and cfg.strategy.stage == best["stage"]
    _, out, _ = _run(capsys, [*argv, "--lora", "off", "--json"])
    assert json.loads(out)["recommended"]["lora_rank"] is None  # off: full fine-tuning with offload, as before
