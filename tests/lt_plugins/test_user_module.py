"""`model.class_path` / `model.init_args`: your own LightningModule trained by `tandem train` on the same batches
(int64 token rows), with `vocab_size` injected; and the schema's refusals, each naming the class or argument."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from lt_plugins.config import load_config
from lt_plugins.errors import TrainingConfigError

pytestmark = pytest.mark.slow  # a training run (not in make test-fast)

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (
            ["model.class_path=no_such_pkg.Model"],
            r"model\.class_path='no_such_pkg\.Model': cannot import 'no_such_pkg'",
        ),
        (["model.class_path=user_module_example.Missing"], r"module 'user_module_example' has no 'Missing'"),
        (["model.class_path=user_module_example.NotAModule"], r"'user_module_example\.NotAModule' is not a Lightning"),
        (["model.class_path=Model"], r"must be 'package\.module\.ClassName'"),
        (
            ["model.class_path=user_module_example.BagOfTokens", "model.init_args.hiden=4"],
            r"model\.init_args\.hiden: BagOfTokens\.__init__ has no parameter 'hiden'",
        ),
        (["model.init_args.hidden=4"], r"model\.init_args=\{'hidden': 4\} needs model\.class_path"),
    ],
)
def test_bad_class_path_is_one_clear_error(overrides: list[str], expected: str) -> None:
    with pytest.raises(TrainingConfigError, match=expected):
        load_config(REPO / "configs/tiny-cpu.yaml", overrides)


def test_user_module_trains_on_the_corpus_batches(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "shared_model.cli", "train", "--config", str(REPO / "configs/tiny-cpu.yaml")]
    cmd += ["model.class_path=user_module_example.BagOfTokens", "model.init_args.hidden=4", "model.init_args.lr=0.1"]
    cmd += ["data.max_documents=12", "data.block_size=16", "data.batch_size=2", "data.vocab_size=300"]
    cmd += ["trainer.max_steps=2", "trainer.precision=32-true", "trainer.val_check_interval=2"]
    cmd += ["trainer.limit_val_batches=1", "trainer.log_every_n_steps=1", "trainer.enable_progress_bar=false"]
    cmd += ["logging.tensorboard=false", "export.dtype=float32", f"run_dir={run_dir}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), str(HERE), env.get("PYTHONPATH")]))
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    hparams = yaml.safe_load((run_dir / "logs" / "hparams.yaml").read_text())
    assert hparams["hidden"] == 4 and hparams["lr"] == 0.1
    assert 259 <= hparams["vocab_size"] <= 300  # injected: the ids the trained tokenizer emits
    metrics = (run_dir / "logs" / "metrics.csv").read_text().splitlines()
    assert {"train_loss", "val_loss"} <= set(metrics[0].split(","))
    assert "class_path: user_module_example.BagOfTokens" in (run_dir / "config.yaml").read_text()
    # the end of training exports the module's own state dict (not a Tandem bundle, which it could not be)
    assert f"bundle: {run_dir / 'bundle'}" in proc.stdout
    from safetensors.torch import load_file

    state = load_file(run_dir / "bundle" / "model.safetensors")
    assert set(state) == {"embed.weight", "head.weight", "head.bias"}
    assert state["embed.weight"].shape == (hparams["vocab_size"], 4) and state["embed.weight"].dtype == torch.float32
