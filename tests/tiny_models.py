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


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


def copy_smollm2_tokenizer(folder: str) -> None:
    """Copies SmolLM2's tokenizer files (and chat template) into a model folder."""
    import shutil

    from checkpoints.default_model import resolve_model
    smollm2 = resolve_model("smollm2")
    for name in TOKENIZER_FILES:
        if os.path.exists(os.path.join(smollm2, name)):
            shutil.copy(os.path.join(smollm2, name), folder)


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


def prefill_batch(lengths, page_size, max_pages, vocab, rng):
    """Whole prompts of several sequences in one prefill batch; pages handed out in random order."""
    num_tokens = sum(lengths)
    pages = rng.permutation(np.arange(1, 1 + len(lengths) * max_pages))
    token_ids, positions, slots = [], [], []
    block_table = np.zeros((len(lengths), max_pages), np.int32)
    qsl = [0]
    for i, n in enumerate(lengths):
        own = pages[i * max_pages:(i + 1) * max_pages]
        block_table[i] = own
        pos = np.arange(n)
        positions.append(pos)
        slots.append(own[pos // page_size] * page_size + pos % page_size)
        token_ids.append(rng.integers(0, vocab, n))
        qsl.append(qsl[-1] + n)
    batch = dict(
        token_ids=np.concatenate(token_ids).astype(np.int32),
        positions=np.concatenate(positions).astype(np.int32),
        slot_mapping=np.concatenate(slots).astype(np.int32),
        decode_block_table=np.zeros((0, max_pages), np.int32),
        decode_seq_lens=np.zeros(0, np.int32),
        prefill_block_table=block_table,
        prefill_seq_lens=np.asarray(lengths, np.int32),
        prefill_query_start_loc=np.asarray(qsl, np.int32),
        logits_indices=np.arange(num_tokens, dtype=np.int32))
    return batch, token_ids, 1 + len(lengths) * max_pages
