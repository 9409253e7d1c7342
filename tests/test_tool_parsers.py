"""The tool-call parsers on fixed model outputs (hermes, llama3_json, mistral: both of Mistral's
forms), streamed split at every position against whole; vLLM-style call ids; the format a chat
template asks for; what --tool_call_parser / --enable_auto_tool_choice make of a template."""
import json
import re
import sys

import pytest

from jaxserve.commands import cli
from serve.chat_output import ChoiceOutput
from serve.structured import ToolConfigError, resolve_auto_tool_choice
from serve.tool_parsers import (TOOL_PARSERS, HermesToolParser, Llama3JsonToolParser, MistralToolParser,
                                ToolCallParser, detect_tool_format, mistral_call_id, vllm_call_id)
from tests.chat_parsing import chat_template, parsed_streamed, parsed_whole, splits
from tests.test_tools import HERMES_TEMPLATE

A = ("a", '{"x": 1}')
B = ("b", "{}")

# (parser, model output, (content, calls)) -- content None: nothing but whitespace before the calls
CASES = [
    (HermesToolParser, 'Let me check.\n<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n'
                       '<tool_call>{"name": "b", "arguments": {}}</tool_call>', ("Let me check.\n", [A, B])),
    (HermesToolParser, '\n<tool_call>{"name": "b"}</tool_call>', (None, [B])),  # no arguments: {}
    (HermesToolParser, "a <tool_call>{not json}</tool_call>", ("a <tool_call>{not json}</tool_call>", [])),
    (HermesToolParser, "no call, <tool but not", ("no call, <tool but not", [])),
    (Llama3JsonToolParser, '{"name": "a", "parameters": {"x": 1}}', (None, [A])),
    (Llama3JsonToolParser, ' <|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "arguments": {}}',
     (None, [A, B])),
    (Llama3JsonToolParser, '{"name": "a", "parameters": {"x": 1}};\n', (None, [A])),
    (Llama3JsonToolParser, '  {"answer": 42}', ('  {"answer": 42}', [])),  # JSON, not a call
    (Llama3JsonToolParser, '{"name": "a", "parameters": {}} and more', ('{"name": "a", "parameters": {}} and more',
                                                                        [])),
    (Llama3JsonToolParser, 'It is {"name": "a", "parameters": {}}', ('It is {"name": "a", "parameters": {}}', [])),
    (Llama3JsonToolParser, '<|python', ("<|python", [])),
    (MistralToolParser, '[TOOL_CALLS] [{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}]',
     (None, [A, B])),
    (MistralToolParser, 'Sure. [TOOL_CALLS][{"name": "a", "arguments": {"x": 1}}]', ("Sure. ", [A])),
    (MistralToolParser, '[TOOL_CALLS]a[ARGS]{"x": 1}[TOOL_CALLS]b[ARGS]{}', (None, [A, B])),  # the newer form
    (MistralToolParser, "[TOOL_CALLS] not json", ("[TOOL_CALLS] not json", [])),
    (MistralToolParser, '[TOOL_CALLS]bad name![ARGS]{}', ('[TOOL_CALLS]bad name![ARGS]{}', [])),
    (MistralToolParser, "plain [TOOL", ("plain [TOOL", [])),
]


@pytest.mark.parametrize("parser, text, expected", CASES)
def test_parse(parser, text, expected):
    content, calls = parser().parse(text)
    assert (content, [(name, json.loads(arguments)) for name, arguments in calls]) == (
        expected[0], [(name, json.loads(arguments)) for name, arguments in expected[1]])


@pytest.mark.parametrize("parser, text, expected", CASES)
def test_streamed_split_anywhere_is_the_whole(parser, text, expected):
    """Content streams as it comes but never past where a call may start; the calls arrive whole
    at the end: a client assembling the deltas gets the non-streamed message, wherever the
    output is split."""
    def make():
        return ChoiceOutput(ToolCallParser("auto", format=parser()), None)
    whole = parsed_whole(make, text)
    assert whole == (None, expected[0], expected[1], "tool_calls" if expected[1] else "stop")
    for pieces in splits(text):
        assert parsed_streamed(make, pieces) == whole, pieces


def test_a_stream_sends_content_before_the_call_ends():
    parser = ToolCallParser("auto", format=MistralToolParser())
    assert parser.stream("Sure, [TOOL", False, None)[0] == {"content": "Sure, "}
    assert parser.stream('_CALLS][{"name": "a", ', False, None)[0] == {}
    delta, finish_reason = parser.stream('"arguments": {}}]', True, "stop")
    assert finish_reason == "tool_calls" and "content" not in delta
    llama = ToolCallParser("auto", format=Llama3JsonToolParser())
    assert llama.stream("  ", False, None)[0] == {}  # may still open a call
    assert llama.stream("Paris is sunny", False, None)[0] == {"content": "  Paris is sunny"}


def test_call_ids_are_vllms():
    assert re.fullmatch("chatcmpl-tool-[0-9a-f]{32}", vllm_call_id())
    ids = {mistral_call_id() for _ in range(50)}
    assert len(ids) == 50 and all(re.fullmatch("[A-Za-z0-9]{9}", i) for i in ids)
    parser = ToolCallParser("auto", format=MistralToolParser(), new_id=mistral_call_id)
    _, calls, _ = parser.parse('[TOOL_CALLS][{"name": "a", "arguments": {}}]', "stop")
    assert re.fullmatch("[A-Za-z0-9]{9}", calls[0]["id"])


def test_the_format_a_template_asks_for():
    assert detect_tool_format(HERMES_TEMPLATE) == detect_tool_format(chat_template("qwen3")) == "hermes"
    assert detect_tool_format(chat_template("llama3_json")) == "llama3_json"
    assert detect_tool_format(chat_template("mistral")) == "mistral"
    assert detect_tool_format({"default": "x", "tool_use": chat_template("mistral")}) == "mistral"
    assert detect_tool_format("{{ messages }}") is detect_tool_format(None) is None
    assert set(TOOL_PARSERS) == {"hermes", "llama3_json", "mistral"}


@pytest.fixture(scope="module")
def tokenizer():
    from checkpoints import load
    from checkpoints.default_model import resolve_model
    return load.load_tokenizer(resolve_model("smollm2"))


def with_template(tokenizer, template):
    tokenizer.chat_template = template
    return tokenizer


PLAIN_TOOLS_TEMPLATE = ("{% if tools %}Tools: {{ tools | tojson }}\n{% endif %}{% for m in messages %}"
                        "{{ m.role }}: {{ m.content }}\n{% endfor %}")


def test_auto_tool_choice_from_the_template_and_the_flags(tokenizer):
    from tests.test_server import byte_tokenizer
    detected = resolve_auto_tool_choice(with_template(tokenizer, chat_template("llama3_json")))
    assert (detected.format, detected.refusal, detected.source) == ("llama3_json", None, "the chat template")
    chosen = resolve_auto_tool_choice(tokenizer, "hermes", True)  # the flag overrides the template
    assert (chosen.format, chosen.refusal, chosen.source) == ("hermes", None, "--tool_call_parser")
    off = resolve_auto_tool_choice(tokenizer, None, False)
    assert off.format == "llama3_json" and "--noenable_auto_tool_choice" in off.refusal
    plain = resolve_auto_tool_choice(with_template(tokenizer, PLAIN_TOOLS_TEMPLATE))
    assert (plain.format, plain.refusal) == (None, None)  # tools shown, no call format: plain content
    with pytest.raises(ToolConfigError, match="needs --tool_call_parser"):
        resolve_auto_tool_choice(tokenizer, None, True)
    silent = resolve_auto_tool_choice(byte_tokenizer())  # a template that never shows tools
    assert silent.format is None and "does not" in silent.refusal
    for flags in (("hermes", None), (None, True)):
        with pytest.raises(ToolConfigError, match="does not show the model its tools"):
            resolve_auto_tool_choice(byte_tokenizer(), *flags)


@pytest.mark.parametrize("args, message", [
    (["--tool_call_parser=bogus"], "value should be one of <hermes|llama3_json|mistral>"),
    (["--reasoning_parser=bogus"], "value should be one of <deepseek_r1|qwen3>"),
    (["--tool_call_parser=hermes"], "--tool_call_parser=hermes: the model's chat template does not show"),
    (["--enable_auto_tool_choice"], "--enable_auto_tool_choice: the model's chat template does not show"),
])
def test_tool_flags_a_template_cannot_serve_exit_2(monkeypatch, capsys, args, message):
    from tests.test_server import MODEL, _fake_engine_module
    monkeypatch.setitem(sys.modules, "jaxserve.async_engine", _fake_engine_module([]))
    assert cli.main(["jaxserve", "serve", f"--model={MODEL}", "--generation_config=none", *args]) == 2
    assert message in capsys.readouterr().err
