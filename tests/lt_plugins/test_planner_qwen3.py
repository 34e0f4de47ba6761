"""The planner: qwen3-8b full fine-tuning does not fit one 80 GB GPU; what fits on 1, 2, 4 and 8; the CLI. Full
fine-tuning only (`lora="off"`); LoRA's fallback is tested in test_planner_cli.py."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from lt_plugins.memory_model import GRADS, MASTER, MOMENTS, WEIGHTS, Hardware, ZeroLayout, lecture_state_terms
from lt_plugins.planner import PlanRequest, plan
from lt_plugins.planner_cli import main, parse_bytes
from shared_model.config import PRESETS, get_preset
from shared_model.ledger import GB

QWEN = get_preset("qwen3-8b")
NOMINAL = PRESETS["qwen3-8b"].nominal_params


def _plan(gpus: int, **kw):
    return plan(QWEN, PlanRequest(gpus=gpus, micro_batch=1, seq_len=4096, lora="off", **kw), model_name="qwen3-8b")


def test_lecture_state_terms_for_qwen3_8b() -> None:
    terms = {t.name: t.gpu_bytes for t in lecture_state_terms(NOMINAL, ZeroLayout(stage=0, world=1))}
    assert [round(terms[k] / GB, 1) for k in (WEIGHTS, MASTER, GRADS, MOMENTS)] == [16.4, 32.8, 32.8, 65.6]
    assert round(sum(terms.values()) / GB, 1) == 147.6
    zero3 = {t.name: t.gpu_bytes for t in lecture_state_terms(NOMINAL, ZeroLayout(stage=3, world=8))}
    assert round(sum(zero3.values()) / GB, 2) == round(147.6 / 8, 2)
    offloaded = lecture_state_terms(NOMINAL, ZeroLayout(stage=2, world=1, offload_optimizer=True))
    assert [round(t.gpu_bytes / GB, 1) for t in offloaded] == [16.4, 0.0, 0.0, 0.0]
    assert round(sum(t.cpu_bytes for t in offloaded) / GB, 1) == 131.2


def test_full_fine_tuning_does_not_fit_one_gpu_without_offload() -> None:
    result = _plan(1)
    plain = [c for c in result.candidates if c.offload == "none"]
    assert plain and not any(c.fits for c in plain)
    stage0 = next(c for c in plain if c.stage == 0 and c.precision == "bf16-mixed" and c.checkpointing == "full")
    assert stage0.limiting == MOMENTS and "optimizer" in (stage0.lever or "")
    assert round(sum(stage0.gpu_bytes[t] for t in (WEIGHTS, MASTER, GRADS, MOMENTS)) / GB, 1) == 147.4
    # What does fit on one GPU: the optimizer (and its fp32 state) in host memory.
    assert result.recommended is not None and result.recommended.offload != "none"
    assert result.recommended.total <= Hardware().usable


def test_what_fits_on_1_2_4_8_gpus() -> None:
    result = _plan(8)
    assert set(result.scaling) == {1, 2, 4, 8}
    for gpus, best in result.scaling.items():
        assert best is not None and best.fits, gpus
    assert result.scaling[1].offload != "none" and result.scaling[2].offload != "none"
    assert result.scaling[4].offload == "none" and result.scaling[8].offload == "none"
    assert result.recommended is result.scaling[8]
    assert result.recommended.stage >= 1  # plain data parallelism cannot hold 147 GB per GPU


def test_activation_term_limits_long_sequences_and_checkpointing_fixes_it() -> None:
    result = _plan(8, modes=("none", "full"))
    long = plan(QWEN, PlanRequest(gpus=8, micro_batch=4, seq_len=8192, modes=("none", "full"), lora="off"), "qwen3-8b")
    blocked = [c for c in long.candidates if not c.fits and c.stage == 3 and c.checkpointing == "none"]
    assert blocked and all(c.limiting == "Saved activations" for c in blocked)
    assert long.recommended is not None and long.recommended.checkpointing == "full"
    assert result.recommended.compute == 1.0 and long.recommended.compute > 1.25


def test_cli_table_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(["--model", "qwen3-8b", "--gpus", "1", "--gpu-memory", "80GB", "--seq-len", "4096", "--lora", "off"]) == 0
    )
    out = capsys.readouterr().out
    assert "147.4 GB > 72.0 GB usable on one GPU: it does not fit" in out
    assert "Recommended: stage" in out and "8 GPU(s):" in out
    assert main(["--model", "qwen3-8b", "--gpus", "2", "--micro-batch", "1", "--lora", "off", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["num_params"] == QWEN.num_parameters() and len(data["candidates"]) == 64
    assert set(data["scaling"]) == {"1", "2", "4", "8"}
    non_fitting = [c for c in data["candidates"] if not c["fits"]]
    assert non_fitting and all(c["limiting"] for c in non_fitting)


def test_cli_exit_codes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--model", "qwen3-8b", "--gpu-memory", "4GB", "--precision", "32-true"]) == 1
    assert "Nothing fits on 1 GPU(s)" in capsys.readouterr().out
    assert main(["--model", "no-such-model"]) == 2
    capsys.readouterr()
    assert main(["--model", "tiny", "--gpu-memory", "eighty"]) == 2
    assert capsys.readouterr().err == (
        "tandem plan: --gpu-memory 'eighty' is not a memory size (examples: 80GB, 141GB, 24GiB)\n"
    )


def test_parse_bytes() -> None:
    assert parse_bytes("80GB") == 80e9 and parse_bytes("24GiB") == 24 * 2**30 and parse_bytes("1.5e9B") == 1.5e9
    assert parse_bytes("80 gb") == 80e9 and parse_bytes("0.5TB") == 5e11
    for bad in ("80", "1.5e9", "0GB", "80GX", ""):
        with pytest.raises(ValueError):
            parse_bytes(bad)


def test_tandem_plan_imports_neither_lightning_nor_deepspeed() -> None:
    code = (
        "import sys; from shared_model.cli import main; main(['plan', '--model', 'tiny', '--json']); "
        "bad = [m for m in ('lightning', 'deepspeed', 'omegaconf') if m in sys.modules]; "
        "sys.exit(3 if bad else 0)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
