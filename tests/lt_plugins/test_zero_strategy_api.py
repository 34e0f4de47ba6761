"""ZeroStrategy as a Lightning user meets it: registered names, DeepSpeedStrategy's argument names, a DeepSpeed
config dict or JSON file, unknown DeepSpeed keys refused by name, and lazy `from lt_plugins import ...`."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import lightning.pytorch as pl
import pytest

import lt_plugins
from lt_plugins.errors import TrainingConfigError
from lt_plugins.strategy import ZeroStrategy
from lt_plugins.zero_config import DEEPSPEED_TOP_LEVEL_KEYS, ZeroConfig

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("name", "stage", "offload_optimizer", "offload_params"),
    [
        ("tandem_zero", 2, False, False),
        ("tandem_zero_stage_1", 1, False, False),
        ("tandem_zero_stage_2", 2, False, False),
        ("tandem_zero_stage_2_offload", 2, True, False),
        ("tandem_zero_stage_3", 3, False, False),
        ("tandem_zero_stage_3_offload", 3, True, True),
    ],
)
def test_registered_names_resolve_to_zero_strategy(name, stage, offload_optimizer, offload_params) -> None:  # type: ignore[no-untyped-def]
    trainer = pl.Trainer(strategy=name, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
    assert isinstance(trainer.strategy, ZeroStrategy)
    assert trainer.strategy.zero_config == ZeroConfig(
        stage=stage, offload_optimizer=offload_optimizer, offload_params=offload_params
    )
    assert set(lt_plugins.STRATEGY_NAMES) == {
        "tandem_zero",
        "tandem_zero_stage_1",
        "tandem_zero_stage_2",
        "tandem_zero_stage_2_offload",
        "tandem_zero_stage_3",
        "tandem_zero_stage_3_offload",
    }


def test_import_is_cheap_and_the_names_are_registered_explicitly() -> None:
    # importing lt_plugins changes nothing outside it (no import hook, nothing heavy); register_strategies() adds the
    # names to Lightning's registry without importing DeepSpeed, and a Trainer then resolves them
    code = (
        "import sys\n"
        "hooks = list(sys.meta_path)\n"
        "import lt_plugins\n"
        "heavy = [m for m in ('lightning', 'deepspeed', 'torch') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
        "assert sys.meta_path == hooks, sys.meta_path\n"
        "import lightning.pytorch as pl\n"
        "from lightning.pytorch.strategies import StrategyRegistry\n"
        "assert 'tandem_zero_stage_2' not in StrategyRegistry\n"
        "lt_plugins.register_strategies()\n"
        "assert 'deepspeed' not in sys.modules\n"
        "t = pl.Trainer(strategy='tandem_zero_stage_2', accelerator='cpu', devices=1, logger=False)\n"
        "from lt_plugins import ZeroStrategy\n"
        "assert type(t.strategy) is ZeroStrategy and t.strategy.zero_config.stage == 2, t.strategy\n"
        "print('ok')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


def test_public_classes_are_importable_from_the_package() -> None:
    from lt_plugins import MemoryLedger, SelectiveCheckpointing
    from lt_plugins import ZeroStrategy as FromPackage
    from lt_plugins.checkpointing import SelectiveCheckpointing as Own
    from lt_plugins.ledger_callback import MemoryLedger as OwnLedger

    assert FromPackage is ZeroStrategy and SelectiveCheckpointing is Own and MemoryLedger is OwnLedger
    assert set(lt_plugins._LAZY) <= set(lt_plugins.__all__)
    for name in lt_plugins.__all__:
        assert getattr(lt_plugins, name) is not None, name
    assert "ZeroStrategy" in dir(lt_plugins)
    with pytest.raises(AttributeError, match="ZeroStrategyy"):
        lt_plugins.ZeroStrategyy  # noqa: B018


def test_deepspeed_strategy_argument_names_are_accepted() -> None:
    strategy = ZeroStrategy(
        stage=3,
        offload_optimizer=True,
        offload_parameters=True,
        offload_params_device="cpu",
        offload_optimizer_device="cpu",
        pin_memory=True,
        allgather_bucket_size=2_000_000,
        reduce_bucket_size=2_000_000,
        timeout=timedelta(minutes=5),
        contiguous_gradients=True,  # what ZeroStrategy does anyway
        logging_batch_size_per_gpu="auto",
        loss_scale=0,  # Lightning's own fp16 settings pass through
    )
    assert strategy.zero_config == ZeroConfig(
        stage=3, offload_optimizer=True, offload_params=True, pin_memory=True, bucket_size=2_000_000, timeout_s=300
    )
    zero = strategy.config["zero_optimization"]
    assert zero["offload_param"]["device"] == "cpu" and zero["reduce_bucket_size"] == 2_000_000
    assert ZeroStrategy(zero_optimization=False).zero_config.stage == 0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"contiguous_gradients": False}, r"'contiguous_gradients'.*extra=\{'zero_optimization': \{'contiguous_grad"),
        ({"partition_activations": True}, r"'partition_activations'.*extra=\{'activation_checkpointing'"),
        ({"nvme_path": "/nvme"}, r"'nvme_path'.*NVMe offload"),
        ({"offload_params_device": "nvme", "stage": 3}, r"offload_params_device='nvme'.*CPU memory only"),
        ({"offload_parameters": True, "offload_params": False, "stage": 3}, r"offload_parameters=True.*offload_p"),
        ({"allgather_bucket_size": 1, "reduce_bucket_size": 2}, r"allgather_bucket_size=1.*reduce_bucket_size=2"),
        ({"stag": 2}, r"unknown argument.*'stag'.*did you mean 'stage'"),
    ],
)
def test_deepspeed_names_without_an_equivalent_are_errors_naming_them(kwargs: dict, message: str) -> None:
    with pytest.raises(TrainingConfigError, match=message):
        ZeroStrategy(**kwargs)


def test_a_deepspeed_config_dict_or_json_file_is_accepted(tmp_path: Path) -> None:
    ds = {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}, "steps_per_print": 7}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds))
    for given in (ds, path, str(path)):
        strategy = ZeroStrategy(config=given)
        assert strategy.zero_config.stage == 3 and strategy.zero_config.offload_params
        assert strategy.config["steps_per_print"] == 7
        assert strategy.config["zero_optimization"]["offload_param"]["device"] == "cpu"
    assert ZeroStrategy(config={"steps_per_print": 7}).zero_config.stage == 0  # DeepSpeed's reading: no ZeRO section
    with pytest.raises(TrainingConfigError, match=r"got stage=2 but its DeepSpeed config .* sets stage=3"):
        ZeroStrategy(config=ds, stage=2)
    with pytest.raises(TrainingConfigError, match=r"zero_optimization\.stage'=2 conflicts with strategy\.stage=3"):
        ZeroStrategy(config={"zero_optimization": {"stage": 3}}, extra={"zero_optimization": {"stage": 2}})
    with pytest.raises(TrainingConfigError, match=r"ds\.json: unknown DeepSpeed config key 'steps_per_prnt'"):
        path.write_text(json.dumps({"steps_per_prnt": 7}))
        ZeroStrategy(config=path)
    with pytest.raises(TrainingConfigError, match=r"ZeroStrategy config: unknown DeepSpeed config key 'zero_opt"):
        ZeroStrategy(config={"zero_optimization": {"stage": 2, "overlap_com": True}})
    with pytest.raises(TrainingConfigError, match="no such DeepSpeed config file"):
        ZeroStrategy(config=tmp_path / "missing.json")


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"zero_optimisation": {"stage": 2}}, r"'zero_optimisation' \(did you mean 'zero_optimization'\?\)"),
        ({"wall": 1}, r"'wall'"),
        ({"zero_optimization": {"sub_group_sise": 10}}, r"'zero_optimization\.sub_group_sise'"),
        ({"bf16": {"enable": True}}, r"'bf16\.enable'"),
        ({"tensorboard": {"enabled": False, "output": "x"}}, r"'tensorboard\.output'"),
        ({"zero_optimization": {"reduce_bucket_size": "big"}}, r"'zero_optimization\.reduce_bucket_size'"),
    ],
)
def test_unknown_keys_in_extra_are_errors_naming_them(extra: dict, named: str) -> None:
    with pytest.raises(TrainingConfigError, match=r"strategy\.extra: .*" + named):
        ZeroStrategy(extra=extra)


def test_known_top_level_keys_cover_what_deepspeed_reads() -> None:
    # DeepSpeedConfig over a dict that records every top-level key it looks up: none may be missing from ours
    import deepspeed.runtime.config as ds_config

    seen: set[str] = set()

    class Keys:
        def __init__(self, keys: object) -> None:
            self.keys = keys

        def __contains__(self, key: str) -> bool:
            seen.add(key)
            return key in self.keys  # type: ignore[operator]

        def __iter__(self):  # type: ignore[no-untyped-def]
            return iter(self.keys)  # type: ignore[call-overload]

    class Recording(dict):
        def __contains__(self, key: object) -> bool:
            seen.add(str(key))
            return dict.__contains__(self, key)

        def get(self, key, default=None):  # type: ignore[no-untyped-def]
            seen.add(key)
            return dict.get(self, key, default)

        def __getitem__(self, key):  # type: ignore[no-untyped-def]
            seen.add(key)
            return dict.__getitem__(self, key)

        def keys(self):  # type: ignore[no-untyped-def]
            return Keys(dict.keys(self))

        def __copy__(self):  # type: ignore[no-untyped-def]
            return self

    ds_config.DeepSpeedConfig(Recording({"train_micro_batch_size_per_gpu": 1}))
    removed = set(getattr(ds_config, "_REMOVED_TOP_LEVEL_CONFIG_KEYS", {}))
    assert len(seen) > 30
    assert seen - removed - DEEPSPEED_TOP_LEVEL_KEYS == set()
