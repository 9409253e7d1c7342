"""Shared fixtures."""

import os

import pytest

from jaxserve import platforms
from tests.tiny_models import copy_smollm2_tokenizer, make_tiny_hf_model

platforms.default_to_cpu_without_gpu()  # before any test imports jax; inherited by subprocesses
# No automatic executable store (inherited by every server, CLI and benchmark subprocess too): its
# folders are keyed by the source, so each commit's run would compile every warm-up afresh (with
# the compilation cache off, see executables.persistent_cache_off) and keep only the last 8 of the
# suite's many engines; the compilation cache serves warm-ups across commits instead.
# tests/test_executables.py switches the store back on; tests/test_fresh_machine.py runs without it.
os.environ.setdefault("JAXSERVE_EXECUTABLES_CACHE", "0")


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


@pytest.fixture(scope="session")
def tiny_chat_engine(tiny_chat_model_dir, tmp_path_factory):
    """One Engine on the tiny chat model (1024 positions: room for tools' descriptions; a random
    model works at any length), shared by servers that differ only in their chat template
    (tests/chat_parsing.py's serve_with_template), so that each costs no engine build."""
    from jaxserve.engine import Engine, EngineConfig
    from tests.chat_parsing import model_with_template

    folder = model_with_template(tiny_chat_model_dir, str(tmp_path_factory.mktemp("tiny_chat_1024") / "model"))
    return Engine.from_model(folder, EngineConfig(max_num_seqs=8, max_num_batched_tokens=256, page_size=8,
                                                  num_pages=800, max_model_len=768, warmup=False))
