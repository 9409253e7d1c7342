"""Helpers for the tool-call and reasoning parser tests: the family chat templates of tests/data,
tiny model folders that carry one, and a chat output parsed streamed (split anywhere) or whole."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path

from serve.chat_output import ChoiceOutput

DATA = Path(__file__).parent / "data"
TEMPLATES = {"llama3_json": "llama3.1_instruct_chat_template.jinja",
             "mistral": "mistral_v0.3_instruct_chat_template.jinja",
             "qwen3": "qwen3_style_chat_template.jinja"}


def chat_template(family: str) -> str:
    return (DATA / TEMPLATES[family]).read_text()


def model_with_template(source_dir: str, dest_dir: str, template: str | None = None,
                        max_position_embeddings: int = 1024) -> str:
    """A copy of a converted model folder with `max_position_embeddings` (room for the tools'
    descriptions: a random model works at any length) and, given one, `template` as its chat template."""
    shutil.copytree(source_dir, dest_dir)
    if template is not None:
        with open(os.path.join(dest_dir, "chat_template.jinja"), "w") as f:
            f.write(template)
    with open(os.path.join(dest_dir, "config.json")) as f:
        config = json.load(f)
    config["max_position_embeddings"] = max_position_embeddings
    with open(os.path.join(dest_dir, "config.json"), "w") as f:
        json.dump(config, f)
    return dest_dir


@contextlib.contextmanager
def serve_with_template(engine, template: str, config):
    """A live server (tests/test_server_engine.py's) on `engine` whose tokenizer has `template` as
    its chat template while it runs (servers on one engine run one after another)."""
    from tests.test_server_engine import LiveServer
    saved = engine.tokenizer.chat_template
    engine.tokenizer.chat_template = template
    live = LiveServer(engine, config)
    try:
        yield live
    finally:
        live.close()
        engine.tokenizer.chat_template = saved


def _normal(message: dict) -> tuple:
    """(reasoning, content, [(name, arguments)], finish_reason) with "" and None alike."""
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls") or []]
    return (message.get("reasoning") or None, message.get("content") or None, calls, message.get("finish_reason"))


def parsed_whole(make_output, text: str, finish_reason: str = "stop") -> tuple:
    message, finish_reason = make_output().parse(text, finish_reason)
    return _normal({**message, "finish_reason": finish_reason})


def parsed_streamed(make_output, pieces: list[str], finish_reason: str = "stop") -> tuple:
    """The deltas of `pieces` (the last one finishing the choice) assembled as a client would."""
    output: ChoiceOutput = make_output()
    reasoning, content, calls, finish = "", "", {}, None
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        delta, finish = output.stream(piece, last, finish_reason if last else None)
        assert delta.get("reasoning") == delta.get("reasoning_content")
        reasoning += delta.get("reasoning") or ""
        content += delta.get("content") or ""
        for call in delta.get("tool_calls") or []:
            entry = calls.setdefault(call["index"], ["", ""])
            entry[0] += call["function"].get("name") or ""
            entry[1] += call["function"].get("arguments") or ""
    message = {"reasoning": reasoning, "content": content,
               "tool_calls": [{"function": {"name": n, "arguments": a}} for n, a in calls.values()]}
    return _normal({**message, "finish_reason": finish})


def splits(text: str) -> list[list[str]]:
    """`text` in two pieces at every position, and one character a piece."""
    return [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text) or [""]]
