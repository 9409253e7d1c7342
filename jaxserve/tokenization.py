"""Prompt encoding shared by the server and the CLI (Hugging Face tokenizers, no jax)."""
from __future__ import annotations

from typing import Any


def encode_chat(tokenizer: Any, messages: list[dict]) -> list[int]:
    """Token ids of `messages` under the model's chat template, generation prompt added."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer.encode(text, add_special_tokens=False))


def encode_text(tokenizer: Any, text: str) -> list[int]:
    """Token ids of a plain prompt, with the tokenizer's own special tokens (e.g. BOS)."""
    return list(tokenizer.encode(text))


def max_token_chars(tokenizer: Any) -> int:
    """Characters of the vocabulary's longest token, as the tokenizer stores it.

    For byte-level BPE a stored character is one byte of text, and every character of text is at
    least one byte, so a text of N characters has at least N / max_token_chars tokens: a bound
    that refuses an oversized prompt without tokenizing it."""
    tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    return max(len(t) for t in tokens if t is not None)
