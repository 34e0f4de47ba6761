"""trainer.autocast: the rule behind `auto`, the config's refusals, and real fits under ZeroStrategy and ddp where
the Linear layers compute in bf16 while the attention core, the weights and the optimizer stay fp32."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lt_plugins.autocast import (
    deepspeed_section,
    fp32_classes,
    lightning_precision,
    resolve_autocast,
    resolved_config,
)
from lt_plugins.config import load_config
from lt_plugins.errors import TrainingConfigError

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
AMX = {"amx_bf16": True, "amx_tile": True, "avx512_bf16": True}
NO_AMX = {"amx_bf16": False, "amx_tile": False, "avx512_bf16": True, "avx512_f": True}  # an AMD Zen 4
NO_BF16 = {"amx_bf16": False, "amx_tile": False, "avx512_bf16": False, "avx512_f": True}  # an Ice Lake


@pytest.mark.parametrize(
    ("mode", "precision", "caps", "expected"),
    [
        ("auto", "32-true", AMX, "bf16"),
        ("auto", "32-true", NO_AMX, "bf16"),  # AVX-512 BF16 dot products: native bf16 matmuls (§48)
        ("auto", "32-true", NO_BF16, "none"),  # emulated bf16 matmuls
        ("auto", "32-true", {}, "none"),
        ("auto", "bf16-mixed", AMX, "none"),  # the precision already computes in bf16
        ("bf16", "32-true", NO_BF16, "bf16"),  # asked for: given, whatever the CPU
        ("none", "32-true", AMX, "none"),
    ],
)
def test_auto_rule_on_cpu(mode: str, precision: str, caps: dict, expected: str) -> None:
    choice = resolve_autocast(mode, precision, "cpu", caps)
    assert choice.mode == expected
    assert choice.reason


@pytest.mark.parametrize(
    ("mode", "precision", "message"),
    [
        ("bf16", "bf16-mixed", "trainer.autocast=bf16 needs trainer.precision=32-true"),
        ("fp16", "32-true", "trainer.autocast must be one of none, bf16, auto, got 'fp16'"),
        (False, "32-true", "trainer.autocast must be one of none, bf16, auto, got False"),  # YAML's `off`
    ],
)
def test_invalid_modes_are_refused_naming_the_key(mode: object, precision: str, message: str) -> None:
    with pytest.raises(TrainingConfigError, match=re.escape(message)):
        resolve_autocast(mode, precision, "cpu", AMX)  # type: ignore[arg-type]


def test_the_config_refuses_bad_values_and_two_places_for_autocast() -> None:
    tiny = REPO / "configs/tiny-cpu.yaml"
    with pytest.raises(TrainingConfigError, match=re.escape("trainer.autocast=bf16 needs trainer.precision=32-true")):
        load_config(tiny, ["trainer.autocast=bf16"])  # tiny-cpu.yaml trains in bf16-mixed
    with pytest.raises(TrainingConfigError, match=re.escape("trainer.autocast must be one of none, bf16, auto")):
        load_config(tiny, ["trainer.precision=32-true", "trainer.autocast=off"])  # OmegaConf reads off as False
    both = ["trainer.precision=32-true", "trainer.autocast=bf16", "strategy.extra.torch_autocast.enabled=true"]
    with pytest.raises(TrainingConfigError, match=re.escape("strategy.extra.torch_autocast both set autocast")):
        load_config(tiny, both)
    assert load_config(tiny).trainer.autocast == "none"


@pytest.mark.parametrize(("caps", "expected"), [(AMX, "bf16"), (NO_AMX, "bf16"), (NO_BF16, "none")])
def test_resolved_config_replaces_auto_by_the_machines_choice(
    monkeypatch: pytest.MonkeyPatch, caps: dict, expected: str
) -> None:
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: caps)
    cfg = load_config(REPO / "configs/tiny-cpu.yaml", ["trainer.precision=32-true", "trainer.autocast=auto"])
    resolved = resolved_config(cfg)
    assert resolved.trainer.autocast == expected
    assert resolved.trainer.precision == "32-true" and resolved.strategy == cfg.strategy
    assert resolved_config(resolved) == resolved  # resolved once: nothing left to choose


@pytest.mark.parametrize(("native_bf16", "expected"), [(True, "bf16"), (False, "none")])
def test_auto_on_cuda_takes_native_bf16_only(monkeypatch: pytest.MonkeyPatch, native_bf16: bool, expected: str) -> None:
    asked: list[bool] = []

    def bf16_supported(including_emulation: bool = True) -> bool:
        asked.append(including_emulation)
        return native_bf16 or including_emulation  # a V100 or T4: emulated only

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", bf16_supported)
    assert resolve_autocast("auto", "32-true", "cuda", AMX).mode == expected
    assert resolve_autocast("auto", "32-true", "auto", NO_AMX).mode == expected  # auto finds the GPU
    assert asked == [False, False]


def test_where_each_strategy_takes_the_choice() -> None:
    assert deepspeed_section("bf16") == {"torch_autocast": {"enabled": True, "dtype": "bfloat16"}}
    assert deepspeed_section("none") == {}
    with pytest.raises(ValueError, match="not resolved"):
        deepspeed_section("auto")
    assert lightning_precision("bf16", "32-true") == "bf16-mixed"  # Lightning's autocast over fp32 weights
    assert lightning_precision("none", "32-true") == "32-true"
    assert fp32_classes("bf16", "cpu") == ("CoreAttention",)
    assert fp32_classes("bf16", "cuda") == ()  # bf16 flash attention is the fast path there
    assert fp32_classes("none", "cpu") == ()


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["zero", "ddp"])
def test_a_fit_computes_linears_in_bf16_and_keeps_attention_and_weights_fp32(tmp_path: Path, strategy: str) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), str(HERE), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, str(HERE / "autocast_worker.py"), str(tmp_path / "run"), strategy],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("REPORT "))
    report = json.loads(line.removeprefix("REPORT "))
    if strategy == "zero":  # DeepSpeed's own autocast section; no 16-bit weights (its bf16 section)
        assert report["torch_autocast"] == {"enabled": True, "dtype": "bfloat16"}
        assert report["bf16_section"] is None and report["trainer_precision"] == "32-true"
        # one process: ZeroStrategy started DeepSpeed's backend without building its shared-memory allreduce op,
        # where DeepSpeed would have built it, and left DeepSpeed's table of compatible ops as it found it
        if not report["shm_compatible_before"]:
            pytest.skip("DeepSpeed cannot build its shared-memory op here (no compiler or no CPU op builder)")
        assert report["shm_allreduce_op"] is False
        assert report["shm_compatible_after"] is True
    else:  # Lightning's bf16-mixed plugin: torch.autocast over fp32 weights
        assert report["trainer_precision"] == "bf16-mixed"
    assert report["linear_out"] == ["torch.bfloat16"]
    assert report["attention"] == ["torch.float32 autocast=False"]  # the policy keeps the core fp32 on CPU
    assert report["param_dtypes"] == ["torch.float32"] and report["finite"]
    losses = report["losses"]
    assert len(losses) == 3 and losses[-1] < losses[0]
