"""Backend selection and launch-policy functions: pure host logic, no kernel launch."""

from __future__ import annotations

import torch

from inference_svc.attention.triton import configs
from inference_svc.attention.triton_ops import reference_ops, triton_available, triton_ops

NEEDS_KERNELS = False


def test_triton_available_reports_a_reason() -> None:
    ok, why = triton_available()
    assert isinstance(why, str) and why
    assert ok == (torch.cuda.is_available() or configs.interpret_mode())


def test_every_implementation_satisfies_the_protocol() -> None:
    """`AttentionOps` is a Protocol: the reference, the CPU path and (where they run) the Triton kernels satisfy it,
    and only the CPU path has a one-call decode step."""
    from inference_svc.attention.interface import AttentionOps
    from inference_svc.attention.torch_ops import torch_ops

    impls = [reference_ops(), torch_ops(native=False)] + ([triton_ops()] if triton_available()[0] else [])
    assert [ops.name for ops in impls] == ["reference", "torch", "triton"][: len(impls)]
    assert all(isinstance(ops, AttentionOps) for ops in impls)
    q = torch.zeros(1, 1, 2, 16)
    assert impls[0].decode_step(q, q, q, None, None, None, None, None, 1.0) is None
    assert not isinstance(object(), AttentionOps)


def test_num_splits_follows_lengths() -> None:
    sms = 264  # 2 programs per SM on an H200
    assert configs.decode_num_splits(64, 8, 512, sms) == 1  # a full batch of short contexts: no split
    assert configs.decode_num_splits(1, 8, 256, sms) == 1  # too short to be worth a merge
    long_one = configs.decode_num_splits(1, 8, 32768, sms)
    assert 1 < long_one <= configs.MAX_SPLITS
    assert configs.decode_num_splits(1, 8, 4096, sms) <= 4096 // configs.MIN_KEYS_PER_SPLIT
    assert configs.decode_num_splits(8, 8, 32768, sms) < long_one  # more sequences already fill the device


def test_prefill_tiles_hold_a_gqa_group() -> None:
    for head_dim in (16, 64, 128, 256):
        for group in (1, 2, 3, 4, 8, 16, 32):
            for interpret in (False, True):
                c = configs.prefill_config(configs.pad_pow2(head_dim), group, interpret)
                assert c.block_m >= group and c.block_m & (c.block_m - 1) == 0


def test_autotune_space_is_pruned_per_shape() -> None:
    kept = configs.prune_prefill_configs(configs.prefill_autotune_configs(), {"GROUP": 128, "HEAD_DIM_PAD": 256})
    assert kept  # never empty, even when no config fits the group
    kept = configs.prune_prefill_configs(configs.prefill_autotune_configs(), {"GROUP": 4, "HEAD_DIM_PAD": 256})
    assert all(c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] <= 64 * 64 for c in kept)
    assert not configs.autotune_possible() or torch.cuda.is_available()


def test_padding_to_power_of_two() -> None:
    assert [configs.pad_pow2(d) for d in (16, 24, 64, 80, 96, 128, 256)] == [16, 32, 64, 128, 128, 128, 256]
    assert configs.pad_pow2(3, minimum=1) == 4
