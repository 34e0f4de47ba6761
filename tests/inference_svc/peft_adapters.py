"""Test helper: random LoRA adapters in PEFT's own format for a tiny random Hugging Face folder (never a hub).

`make_base(folder, tokenizer, seed)` saves a tiny random Qwen3 (peaked logits: few greedy near-ties) with the given
tokenizer. `make_adapter(base_dir, out_dir, seed, ...)` wraps the folder's model with `peft.get_peft_model` under a
`LoraConfig`, gives every B matrix random values (PEFT starts B at zero, which would make the adapter a no-op), saves
it with `save_pretrained` and returns the PEFT model (eval mode, fp32) for reference outputs.
`greedy(model, prompt, n)` is transformers' greedy continuation, one argmax per position, no EOS stop.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


def make_base(folder: Path, tokenizer, seed: int) -> Path:
    import transformers

    cfg = transformers.Qwen3Config(
        vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, intermediate_size=128, max_position_embeddings=512, rms_norm_eps=1e-6,
        tie_word_embeddings=False, rope_theta=10000.0, initializer_range=0.2,
        eos_token_id=tokenizer.eos_id, bos_token_id=tokenizer.bos_id, pad_token_id=tokenizer.pad_id,
    )  # fmt: skip
    torch.manual_seed(seed)
    transformers.Qwen3ForCausalLM(cfg).save_pretrained(folder, safe_serialization=True)
    tokenizer.save(folder)
    return folder


def make_adapter(
    base_dir: Path,
    out_dir: Path,
    seed: int,
    rank: int = 4,
    alpha: float = 8.0,
    targets: Sequence[str] = ATTENTION + MLP,
    b_std: float = 0.4,
):
    import peft
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = peft.LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0, task_type="CAUSAL_LM"
    )
    torch.manual_seed(seed)
    wrapped = peft.get_peft_model(model, config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in wrapped.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * b_std)
    wrapped.save_pretrained(out_dir)
    return wrapped.eval()


@torch.no_grad()
def greedy(model, prompt: Sequence[int], n: int) -> list[int]:
    ids = torch.tensor([list(prompt)])
    out: list[int] = []
    for _ in range(n):
        nxt = int(model(input_ids=ids).logits[0, -1].argmax())
        out.append(nxt)
        ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    return out
