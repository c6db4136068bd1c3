"""Tiny random-weight models of each supported family, built locally (no hub). Numbers from them are for
exactness and timing only: the weights are random."""
from __future__ import annotations

from pathlib import Path

import torch

FAMILIES = ("llama", "llama3", "mistral", "qwen2", "qwen3")


def tiny_config(family: str, vocab_size: int = 49152, **overrides):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
                  tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    common.update(overrides)
    rope = {"llama": {"rope_type": "default", "rope_theta": 10000.0},
            "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                       "high_freq_factor": 4.0, "original_max_position_embeddings": 512}}.get(
        family, {"rope_type": "default", "rope_theta": 1e6})
    common = {"rope_parameters": rope, **common}  # an override's rope_parameters wins
    if family in ("llama", "llama3"):
        return LlamaConfig(**common)
    if family == "mistral":
        return MistralConfig(sliding_window=None, **common)
    if family == "qwen2":
        return Qwen2Config(use_sliding_window=False, **common)
    if family == "qwen3":
        return Qwen3Config(use_sliding_window=False, **common)
    raise ValueError(family)


def tiny_model(family: str, seed: int = 0, dtype=torch.float32, **overrides):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, **overrides), dtype=dtype)
    # Random init with std 0.02 makes attention nearly uniform; larger weights give a sharper, harder test.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
    return model.eval()


def save_tiny_model(family: str, folder: Path, tokenizer_from: Path | None = None, seed: int = 0,
                    dtype=torch.float32, **overrides) -> Path:
    """A tiny model folder vLLM can load; the tokenizer is copied from a real model folder."""
    from transformers import AutoTokenizer

    model = tiny_model(family, seed=seed, dtype=dtype, **overrides)
    model.save_pretrained(folder)
    if tokenizer_from is not None:
        AutoTokenizer.from_pretrained(tokenizer_from).save_pretrained(folder)
    return Path(folder)
