"""Shared fixtures."""
import os
import shutil

import pytest

from jaxserve import platforms
from tests.tiny_models import make_tiny_hf_model

platforms.default_to_cpu_without_gpu()  # before any test imports jax; inherited by subprocesses

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


@pytest.fixture(scope="session")
def tiny_chat_model_dir(tmp_path_factory) -> str:
    """A converted tiny random Llama with SmolLM2's vocabulary, tokenizer and chat template."""
    from checkpoints.convert import convert_checkpoint
    from checkpoints.default_model import resolve_model

    hf_dir = str(tmp_path_factory.mktemp("tiny_chat_hf"))
    make_tiny_hf_model(hf_dir, vocab_size=49152, hidden_size=64, intermediate_size=128, head_dim=16)
    smollm2 = resolve_model("smollm2")
    for name in TOKENIZER_FILES:
        if os.path.exists(os.path.join(smollm2, name)):
            shutil.copy(os.path.join(smollm2, name), hf_dir)
    out_dir = str(tmp_path_factory.mktemp("tiny_chat") / "model")
    convert_checkpoint(hf_dir, out_dir)
    return out_dir
