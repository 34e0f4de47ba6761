"""`tandem train` with a `lora:` section on a random Hugging Face Qwen3 folder, 2 CPU processes over gloo, ZeRO-2 and
ZeRO-3: the loss falls; only the adapters change (every base tensor of the consolidated checkpoint equals the
folder's bit for bit, and the folder's files are unchanged); DeepSpeed keeps optimizer state for the adapters only;
the PEFT folder it exports loads in `peft` with the logits of `tandem export --merge`'s bundle."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from finetune_folder import make_hf_folder

pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("hf") / "qwen3-tiny"
    make_hf_folder(out)
    return out


def _digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def _train(
    folder: Path, tmp_path: Path, stage: int, devices: int = 2, extra: tuple[str, ...] = ()
) -> tuple[subprocess.CompletedProcess, Path]:  # type: ignore[type-arg]
    from tests.conftest import free_port

    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"text": f"<|im_start|>user\nadd {i} and {i + 1}<|im_end|>\n" * 3}) + "\n"
                            for i in range(60)))  # fmt: skip
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "shared_model.cli", "train", "--config", str(REPO / "configs/lora-example.yaml")]
    cmd += [f"model.init_from={folder}", f"data.extra=[{data}]", f"run_dir={run_dir}", f"trainer.devices={devices}"]
    cmd += [f"strategy.stage={stage}", "trainer.max_steps=4", "data.block_size=32", "data.batch_size=2"]
    cmd += ["optim.lr=1e-2", "optim.warmup_steps=1", "trainer.limit_val_batches=0", "trainer.log_every_n_steps=1"]
    cmd += ["trainer.enable_progress_bar=false", "logging.tensorboard=false", "lora.rank=4", "lora.alpha=8"]
    cmd += ["lora.dropout=0.0", "checkpoints.every_n_steps=4", "ledger.enabled=true", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=480)
    return proc, run_dir


def _optimizer_numel(ckpt: Path) -> int:
    """Elements of fp32 master weights DeepSpeed keeps, summed over the ranks' optimizer shards."""
    total = 0
    for f in sorted(ckpt.glob("**/*optim_states.pt")):
        saved = torch.load(f, map_location="cpu", weights_only=False)["optimizer_state_dict"]
        groups = saved.get("fp32_flat_groups") or saved["single_partition_of_fp32_groups"]  # ZeRO-3 or ZeRO-1/2
        total += sum(t.numel() for t in groups)
    assert total > 0
    return total


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("stage", [2, 3])
def test_lora_run_trains_only_the_adapters(folder: Path, tmp_path: Path, stage: int) -> None:
    from lt_plugins.export.checkpoint import consolidate, resolve_checkpoint
    from lt_plugins.metrics_csv import read_metrics
    from shared_model.bundle import FolderTensors, read_config

    before = _digests(folder)
    # at stage 3 nothing stays whole (the tiny model's tensors are all under the default persistence threshold)
    proc, run_dir = _train(folder, tmp_path, stage, extra=("strategy.param_persistence_threshold=0",) * (stage == 3))
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.strip().splitlines()[-1] == f"adapter: {run_dir / 'adapter'}"
    assert _digests(folder) == before  # the base folder's files, byte for byte

    losses = [r["train_loss"] for r in read_metrics(run_dir) if r.get("train_loss") is not None]
    assert len(losses) == 4 and losses[-1] < losses[0], losses

    ckpt = resolve_checkpoint(run_dir)
    state = {k.removeprefix("model."): v for k, v in consolidate(ckpt).items()}
    adapters = {k: v for k, v in state.items() if ".lora_" in k}
    base = {k: v for k, v in state.items() if ".lora_" not in k}
    config = read_config(folder)
    with FolderTensors(folder) as tensors:
        for name, value in base.items():  # every frozen tensor, as the folder holds it
            expected = torch.empty(value.shape, dtype=torch.float32)
            tensors.copy_into(name, expected)
            assert torch.equal(value, expected), name
    assert len(adapters) == 2 * 7 * config.num_layers
    assert all(v.abs().max() > 0 for k, v in adapters.items() if k.endswith("lora_B.weight"))  # B moved off zero
    adapter_numel = sum(v.numel() for v in adapters.values())
    assert adapter_numel <= _optimizer_numel(ckpt) < adapter_numel + 1024  # no optimizer state for the base

    for rank in (0, 1):  # the memory ledger: the frozen base is its own term; every term within 10% on each rank
        rows = {
            r["term"]: r
            for r in json.loads((run_dir / "memory" / f"memory_ledger_rank{rank}.json").read_text())["rows"]
        }
        frozen_numel = sum(v.numel() for v in base.values())
        held = rows["Frozen base weights"]["measured"]
        if stage == 3:  # each rank holds its half of the frozen base (fp32), not the whole
            assert 4 * frozen_numel / 2 <= held < 4 * frozen_numel / 2 + 4 * 2 * len(base)
        else:
            assert held == 4 * frozen_numel
        bad = [r for r in rows.values() if r["ratio"] is not None and abs(r["ratio"] - 1) > 0.10]
        assert not bad, bad

    if stage != 2:
        return
    # the exported PEFT folder on the transformers base = the merged bundle `tandem export --merge` writes
    import transformers

    from shared_model.bundle import load_bundle
    from shared_model.cli import main

    merged = tmp_path / "merged"
    assert main(["export", str(run_dir), str(merged), "--merge", "--dtype", "float32"]) == 0
    ids = torch.randint(0, 300, (2, 10), generator=torch.Generator().manual_seed(0))  # [B, T]
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32)
    with torch.no_grad():
        theirs = peft.PeftModel.from_pretrained(hf, run_dir / "adapter").eval()(ids).logits
        ours = load_bundle(merged, dtype=torch.float32).model.eval()(ids)
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


def test_stage0_int8_lora_run_exports_the_adapter_and_the_merged_bundle(folder: Path, tmp_path: Path) -> None:
    """One process, stage 0 in 32-true (no ZeRO optimizer: DeepSpeed's zero_to_fp32 cannot read that checkpoint,
    export reads the whole module state instead), the base frozen in int8, dropout on, lora.export_merged: both the
    adapter folder and the merged bundle are written; the bundle's adapted weights are the int8 base plus B·A."""
    from shared_model.bundle import load_bundle, read_state_dict

    extra = ("lora.base_dtype=int8", "lora.dropout=0.1", "lora.export_merged=true")
    proc, run_dir = _train(folder, tmp_path, 0, devices=1, extra=extra)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.strip().splitlines()[-2:] == [f"adapter: {run_dir / 'adapter'}", f"bundle: {run_dir / 'bundle'}"]
    merged = read_state_dict(run_dir / "bundle")
    source = make_hf_folder(tmp_path / "again")  # the same seeded weights as `folder`
    q = "model.layers.0.self_attn.q_proj.weight"
    delta = (merged[q].float() - source[q]).abs().max().item()
    assert 0 < delta < 0.05  # int8 rounding (<= half a step of each row's absmax/127) plus the small update
    assert torch.equal(
        merged["model.embed_tokens.weight"].float(), source["model.embed_tokens.weight"].bfloat16().float()
    )
    ids = torch.randint(0, 300, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.isfinite(load_bundle(run_dir / "bundle", dtype=torch.float32).model(ids)).all()

    from shared_model.cli import main  # tandem export: auto picks the adapter; a plain bundle needs --merge

    assert main(["export", str(run_dir), str(tmp_path / "auto")]) == 0
    assert (tmp_path / "auto" / "adapter_config.json").is_file()
    assert main(["export", str(run_dir), str(tmp_path / "plain"), "--format", "bundle"]) == 2
    assert not (tmp_path / "plain").exists()


def test_a_target_matching_nothing_is_refused_before_any_data(folder: Path, tmp_path: Path) -> None:
    proc, run_dir = _train(folder, tmp_path, 0, devices=1, extra=("lora.targets=['*.q_proj','*.qkv_proj']",))
    assert proc.returncode == 2
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("tandem train: error: lora.targets: pattern '*.qkv_proj' matches no nn.Linear of CausalLM")
    assert "model.layers.0.self_attn.q_proj" in line
    assert not (run_dir / "cache").exists()  # refused before the data was read


def test_the_planners_lora_recommendation_trains(folder: Path, tmp_path: Path) -> None:
    """`tandem plan` on the folder with a GPU too small for full fine-tuning without offload recommends LoRA; its
    overrides (on CPU, one process) train: the loss falls and the adapter folder is written."""
    from lt_plugins.memory_model import Hardware
    from lt_plugins.planner import PlanRequest, plan
    from shared_model.ledger_cli import resolve_model

    config, name, _ = resolve_model(str(folder))

    def request(memory: float, lora: str) -> PlanRequest:
        return PlanRequest(gpus=1, micro_batch=2, seq_len=32, hardware=Hardware(gpu_memory=memory), lora=lora)

    lora_min = min(c.total for c in plan(config, request(1e12, "only"), name).candidates)
    full_min = min(c.total for c in plan(config, request(1e12, "off"), name).candidates if c.offload == "none")
    assert lora_min < full_min
    memory = (lora_min + full_min) / 2 / 0.9  # usable = 90%: LoRA fits, full fine-tuning only with offload
    result = plan(config, request(memory, "auto"), name)
    best = result.recommended
    assert result.lora_fallback and best is not None and best.lora_rank == 16
    keep = ("strategy.", "lora.", "checkpointing.", "trainer.precision=", "data.")
    overrides = [o for o in result.overrides(best) if o.startswith(keep)]
    assert "lora.enabled=true" in overrides
    proc, run_dir = _train(folder, tmp_path, best.stage, devices=1, extra=tuple(overrides))
    assert proc.returncode == 0, proc.stderr[-4000:]
    from lt_plugins.metrics_csv import read_metrics

    losses = [r["train_loss"] for r in read_metrics(run_dir) if r.get("train_loss") is not None]
    assert len(losses) == 4 and losses[-1] < losses[0], losses
    assert (run_dir / "adapter" / "adapter_model.safetensors").is_file()
