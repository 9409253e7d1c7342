"""Shared fixtures."""

import pytest

from jaxserve import platforms
from tests.tiny_models import copy_smollm2_tokenizer, make_tiny_hf_model

platforms.default_to_cpu_without_gpu()  # before any test imports jax; inherited by subprocesses


@pytest.fixture(scope="session")
def tiny_chat_model_dir(tmp_path_factory) -> str:
    """A converted tiny random Llama with SmolLM2's vocabulary, tokenizer and chat template."""
    from checkpoints.convert import convert_checkpoint

    hf_dir = str(tmp_path_factory.mktemp("tiny_chat_hf"))
    make_tiny_hf_model(hf_dir, vocab_size=49152, hidden_size=64, intermediate_size=128, head_dim=16)
    copy_smollm2_tokenizer(hf_dir)
    out_dir = str(tmp_path_factory.mktemp("tiny_chat") / "model")
    convert_checkpoint(hf_dir, out_dir)
    return out_dir
