"""Shared fixtures, and the `slow` mark of the tests `make test-quick` leaves out."""

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

# `make test-quick` runs `pytest -m "not slow"`: the host-side and unit tests, no engine, no model
# server, no subprocess but a bare `python -c`. A test is slow when it uses, directly or through
# another fixture, a fixture whose name says it starts a server or builds an engine, or one of the
# fixtures below; a module that is slow for other reasons (engines built in the tests,
# subprocesses, long compiles) says so itself: `pytestmark = pytest.mark.slow` (tests/test_layout.py
# checks that every module is marked or listed as quick).
SLOW_FIXTURE_WORDS = ("server", "engine")
SLOW_FIXTURES = {"tiny_chat_model_dir"}  # a tiny model converted: what servers and engines load


def is_slow_fixture(name: str) -> bool:
    return name in SLOW_FIXTURES or any(word in name for word in SLOW_FIXTURE_WORDS)


def pytest_collection_modifyitems(items):
    for item in items:
        if any(map(is_slow_fixture, getattr(item, "fixturenames", ()))):
            item.add_marker(pytest.mark.slow)


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
