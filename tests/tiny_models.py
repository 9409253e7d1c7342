"""Tiny random Hugging Face Llama models for tests (torch + transformers, test-only)."""
from __future__ import annotations

import os

import numpy as np


def tiny_hf_config(num_q_heads=4, num_kv_heads=2, tie=False, rope_scaling=None, head_dim=16,
                   num_layers=2, vocab_size=128, hidden_size=96, intermediate_size=128):
    from transformers import LlamaConfig
    return LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_q_heads,
        num_key_value_heads=num_kv_heads, head_dim=head_dim, max_position_embeddings=256,
        rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=rope_scaling,
        tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2, torch_dtype="float32")


def make_tiny_hf_model(path: str, seed: int = 0, **config_kwargs):
    """Saves a random LlamaForCausalLM as safetensors under `path`; returns the torch model."""
    import torch
    from transformers import LlamaForCausalLM
    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_hf_config(**config_kwargs)).eval()
    with torch.no_grad():  # non-trivial norms so that a missing norm weight shows up
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    return model


def hf_logits(model, token_ids: np.ndarray) -> np.ndarray:
    """[batch, seq] int -> [batch, seq, vocab] float32 logits from transformers."""
    import torch
    with torch.no_grad():
        return model(torch.as_tensor(token_ids, dtype=torch.long)).logits.float().numpy()
