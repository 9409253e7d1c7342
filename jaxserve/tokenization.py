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
