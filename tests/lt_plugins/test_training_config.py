"""Config schema, ZeroStrategy argument and Trainer-conflict errors, and precision refusals (single process)."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from lt_plugins.config import load_config, to_yaml
from lt_plugins.errors import PrecisionError, TrainingConfigError
from lt_plugins.precision import check_precision
from lt_plugins.strategy import ZeroStrategy
from lt_plugins.zero_config import ZeroConfig, merge_deepspeed_config


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (["trainer.devicez=2"], "trainer.devicez"),
        (["trainer.devices=two"], "trainer.devices"),
        (["strategy.stage=5"], "strategy.stage"),
        (["strategy.offload_params=true"], "strategy.offload_params"),
        (["model.preset=huge"], "model.preset"),
        (["trainer.precision=16-true"], "trainer.precision"),
        (["optim.lr=-1"], "optim.lr"),
        (["strategy.extra.zero_optimization.stage=1"], "strategy.stage"),
        (["strategy.extra.zero_optimization.sub_group_sise=1"], "zero_optimization.sub_group_sise"),
        (["strategy.extra.steps_per_prnt=1"], "steps_per_prnt"),
        (["nonsense=1"], "nonsense"),
    ],
)
def test_bad_config_names_the_key(overrides: list[str], named: str) -> None:
    with pytest.raises(TrainingConfigError, match=named.replace(".", r"\.")):
        load_config("configs/tiny-cpu.yaml", overrides)


def test_config_files_load_and_round_trip(tmp_path) -> None:  # type: ignore[no-untyped-def]
    for name in ("tiny-cpu", "demo"):
        cfg = load_config(f"configs/{name}.yaml", ["trainer.devices=2", "strategy.stage=3"])
        assert cfg.trainer.devices == 2 and cfg.strategy.stage == 3
        (tmp_path / "c.yaml").write_text(to_yaml(cfg))
        assert load_config(tmp_path / "c.yaml") == cfg


def test_extra_may_add_keys_but_not_change_owned_ones() -> None:
    extra = {"zero_optimization": {"sub_group_size": 7}, "wall_clock_breakdown": True}
    merged = merge_deepspeed_config(ZeroConfig(stage=3), extra)
    assert merged["zero_optimization"]["stage"] == 3
    assert merged["zero_optimization"]["sub_group_size"] == 7 and merged["wall_clock_breakdown"] is True
    with pytest.raises(TrainingConfigError, match=r"strategy\.extra: unknown DeepSpeed config key 'wall'"):
        merge_deepspeed_config(ZeroConfig(stage=3), {"wall": 1})  # DeepSpeed itself would ignore it
    with pytest.raises(TrainingConfigError, match=r"zero_optimization\.stage.*strategy\.stage"):
        ZeroStrategy(stage=2, extra={"zero_optimization": {"stage": 3}})
    with pytest.raises(TrainingConfigError, match="unknown argument"):
        ZeroStrategy(stag=2)


class _Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(4, 1)

    def training_step(self, batch: torch.Tensor, idx: int) -> torch.Tensor:
        return self.net(batch).float().pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(port: int, monkeypatch: pytest.MonkeyPatch, strategy: ZeroStrategy, **trainer_kwargs: object) -> None:
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **trainer_kwargs,  # type: ignore[arg-type]
    )
    trainer.fit(_Tiny(), torch.utils.data.DataLoader(torch.randn(8, 4), batch_size=2))


def test_fp16_mixed_on_cpu_is_refused(port: int, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(PrecisionError, match=r"16-mixed.*CUDA"):
        check_precision("16-mixed", "cpu")
    with pytest.raises(PrecisionError, match="bf16-mixed"):
        _fit(port, monkeypatch, ZeroStrategy(stage=2), precision="16-mixed")


def test_trainer_conflicts_name_both_sides(port: int, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(TrainingConfigError, match=r"gradient_accumulation_steps.*accumulate_grad_batches=2"):
        _fit(port, monkeypatch, ZeroStrategy(extra={"gradient_accumulation_steps": 4}), accumulate_grad_batches=2)
    with pytest.raises(TrainingConfigError, match=r"gradient_clipping.*gradient_clip_val=1\.0"):
        _fit(port, monkeypatch, ZeroStrategy(extra={"gradient_clipping": 0.5}), gradient_clip_val=1.0)
    with pytest.raises(TrainingConfigError, match=r"bf16\.enabled.*precision='32-true'"):
        _fit(port, monkeypatch, ZeroStrategy(extra={"bf16": {"enabled": True}}), precision="32-true")


def test_only_launched_processes_read_the_run_dir_handed_down(tmp_path, monkeypatch) -> None:
    """TANDEM_RUN_DIR is how the first process tells the ones Lightning launches where the run lives; left in a
    user's shell it must not redirect a new run."""
    from lt_plugins.cli import RUN_DIR_ENV, resolve_run_dir

    cfg = load_config(str(Path(__file__).resolve().parents[2] / "configs/tiny-cpu.yaml"), [])
    for var in ("RANK", "SLURM_PROCID", "LOCAL_RANK", "NODE_RANK"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv(RUN_DIR_ENV, str(tmp_path / "stale"))
    monkeypatch.chdir(tmp_path)
    assert resolve_run_dir(cfg).parent == tmp_path / "runs"
    monkeypatch.setenv("LOCAL_RANK", "1")  # a process Lightning launched
    assert resolve_run_dir(cfg) == tmp_path / "stale"


def test_loading_a_training_config_does_not_import_the_strategy() -> None:
    """The typed ZeRO settings (`lt_plugins.zero_config`) are Lightning-free: validating a YAML config does not import
    the strategy module (DeepSpeed's own config classes are read to check `strategy.extra` keys, and the callbacks'
    config sections bring Lightning's core)."""
    config = Path(__file__).resolve().parents[2] / "configs/tiny-cpu.yaml"
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from lt_plugins.config import load_config\n"
        f"cfg = load_config({str(config)!r}, ['strategy.stage=3'])\n"
        "assert cfg.strategy.stage == 3\n"
        "heavy = [m for m in ('lt_plugins.strategy',) if m in sys.modules]\n"
        "assert not heavy, heavy\n"
        "print('ok')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]
