"""Test helper: a tiny random Qwen3 Hugging Face folder like a downloaded chat model, built locally (never a hub).

`make_hf_folder(folder)` writes transformers' `save_pretrained` output in 3+ safetensors shards with the index, a
`tokenizer.json` (a byte-level BPE trained here, plus added special tokens `<|endoftext|>`, `<|im_start|>`,
`<|im_end|>`) and a Qwen-style `tokenizer_config.json` holding a `chat_template`; returns the model's state dict.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import AddedToken

from shared_model.tokenizer import Tokenizer

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TEXTS = ["def add(a, b):\n    return a + b\n" * 4, "the quick brown fox jumps over the lazy dog. " * 8]


def make_hf_folder(folder: Path, vocab_size: int = 320) -> dict[str, torch.Tensor]:
    import transformers

    folder.mkdir(parents=True, exist_ok=True)
    tk = Tokenizer.train(TEXTS, 300)._tk  # the library object, to add tokens as a Hugging Face tokenizer has them
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    tk.save(str(folder / "tokenizer.json"))
    decoder = {
        str(tk.token_to_id(t)): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                 "single_word": False, "special": True}
        for t in SPECIALS
    }  # fmt: skip
    config = {
        "added_tokens_decoder": decoder,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 131072,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    torch.manual_seed(0)
    hf_config = transformers.Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    hf = transformers.Qwen3ForCausalLM(hf_config)
    with torch.no_grad():  # norms are ones by default: make them tell apart from a fresh init
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.add_(torch.randn(p.shape) * 0.1)
    hf.save_pretrained(folder, max_shard_size="200KB")
    return {k: v.detach().clone() for k, v in hf.state_dict().items()}
