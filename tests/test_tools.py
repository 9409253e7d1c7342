"""Tool calling through a live server (tiny random model with SmolLM2's vocabulary): "required" and
named tool choices are enforced by structured output and their arguments validate against the
function's schema, streamed or not; "auto" parses Hermes-style calls on a template that defines
them; tool calls and tool results in the history go through the chat template; bad tools are 400s
naming the field."""
import json
import os
import re
import shutil

import jsonschema
import openai
import pytest
import requests

from serve.app import ServerConfig
from serve.prompts import encode_chat, prompt_token_ids
from serve.protocol import parse_chat_request
from serve.tool_parsers import HermesToolParser, ToolCallParser
from tests.chat_parsing import serve_with_template

HERMES_TEMPLATE = """{%- if tools %}<|im_start|>system
You may call functions. Their signatures, within <tools></tools> tags:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
For each call, return {"name": <function-name>, "arguments": <args-json-object>} within <tool_call></tool_call> tags.<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}<|im_start|>assistant
{{ message.content }}
{%- for call in message.tool_calls %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "days"],
           "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                          "days": {"type": "integer", "minimum": 1, "maximum": 7}}}
CONVERT = {"type": "object", "additionalProperties": False, "required": ["amount", "to"],
           "properties": {"amount": {"type": "integer", "minimum": 0, "maximum": 1000},
                          "to": {"enum": ["EUR", "USD"]}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather forecast",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "convert", "parameters": CONVERT}}]
SCHEMAS = {"get_weather": WEATHER, "convert": CONVERT}
MESSAGES = [{"role": "user", "content": "Weather in Paris for 3 days?"}]


@pytest.fixture(scope="module")
def hermes_model_dir(tiny_chat_model_dir, tmp_path_factory):
    """The tiny chat model with a Hermes-style tool-calling chat template (as Qwen's)."""
    path = str(tmp_path_factory.mktemp("hermes") / "model")
    shutil.copytree(tiny_chat_model_dir, path)
    with open(os.path.join(path, "chat_template.jinja"), "w") as f:
        f.write(HERMES_TEMPLATE)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["max_position_embeddings"] = 1024  # room for the tools' description (a random model: any length works)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return path


@pytest.fixture(scope="module")
def server(tiny_chat_engine):
    """The shared tiny engine, served with the Hermes template."""
    with serve_with_template(tiny_chat_engine, HERMES_TEMPLATE, ServerConfig(drain_timeout_s=2.0)) as live:
        live.model = tiny_chat_engine.model_name
        yield live


def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def assert_valid_calls(calls, allowed):
    assert calls, "no tool call"
    for call in calls:
        assert call.type == "function" and re.fullmatch("chatcmpl-tool-[0-9a-f]{32}", call.id)  # vLLM's ids
        assert call.function.name in allowed
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_required_tool_choice_produces_valid_calls(server):
    response = client(server).chat.completions.create(
        model=server.model, messages=MESSAGES, tools=TOOLS, tool_choice="required", n=6, temperature=1.0,
        seed=11, max_tokens=120)
    names = set()
    for choice in response.choices:
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.content is None
        assert_valid_calls(choice.message.tool_calls, SCHEMAS)
        names |= {call.function.name for call in choice.message.tool_calls}
    assert len({json.dumps([c.function.model_dump() for c in ch.message.tool_calls]) for ch in response.choices}) > 1


def test_required_with_parallel_calls_off_makes_one_call(server):
    response = client(server).chat.completions.create(
        model=server.model, messages=MESSAGES, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
        n=4, temperature=1.0, seed=12, max_tokens=120)
    for choice in response.choices:
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
        assert_valid_calls(choice.message.tool_calls, SCHEMAS)


def test_required_streamed_sends_the_calls_when_the_choice_ends(server):
    c = client(server)
    kwargs = dict(model=server.model, messages=MESSAGES, tools=TOOLS, tool_choice="required", n=2, temperature=1.0,
                  seed=13, max_tokens=120)
    whole = c.chat.completions.create(**kwargs)
    calls, finish = {0: [], 1: []}, {}
    for chunk in c.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            assert not choice.delta.content
            calls[choice.index] += choice.delta.tool_calls or []
            finish[choice.index] = choice.finish_reason
    for index, choice in enumerate(whole.choices):
        assert finish[index] == choice.finish_reason == "tool_calls"
        assert [(d.function.name, d.function.arguments) for d in calls[index]] == [
            (t.function.name, t.function.arguments) for t in choice.message.tool_calls]
        assert [d.index for d in calls[index]] == list(range(len(calls[index])))
        assert_valid_calls(calls[index], SCHEMAS)


def test_named_tool_choice_streamed_and_not(server):
    """A named function: one call of it whose arguments validate; streamed, the arguments arrive
    as deltas of one call and add up to the same call as the seeded non-streamed answer."""
    c = client(server)
    named = {"type": "function", "function": {"name": "convert"}}
    whole = c.chat.completions.create(model=server.model, messages=MESSAGES, tools=TOOLS, tool_choice=named,
                                      temperature=1.0, seed=5, max_tokens=60)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    assert_valid_calls(choice.message.tool_calls, {"convert"})
    chunks = list(c.chat.completions.create(model=server.model, messages=MESSAGES, tools=TOOLS, tool_choice=named,
                                            temperature=1.0, seed=5, max_tokens=60, stream=True))
    deltas = [call for ch in chunks if ch.choices for call in (ch.choices[0].delta.tool_calls or [])]
    assert len(deltas) > 2 and deltas[0].id and deltas[0].function.name == "convert"
    assert {d.index for d in deltas} == {0} and all(d.id is None for d in deltas[1:])
    assert "".join(d.function.arguments or "" for d in deltas) == choice.message.tool_calls[0].function.arguments
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "tool_calls"
    assert not any(ch.choices[0].delta.content for ch in chunks if ch.choices)


def test_a_named_call_cut_by_max_tokens_has_the_same_shape_streamed_or_not(server):
    """Cut off by max_tokens, a named call is still a tool call (its arguments incomplete JSON,
    finish_reason "length"), whole or streamed, as vLLM returns it; never plain content."""
    c = client(server)
    kwargs = dict(model=server.model, messages=MESSAGES, tools=TOOLS, temperature=1.0, seed=5, max_tokens=4,
                  tool_choice={"type": "function", "function": {"name": "convert"}})
    choice = c.chat.completions.create(**kwargs).choices[0]
    assert choice.finish_reason == "length" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "convert" and call.function.arguments
    chunks = [ch for ch in c.chat.completions.create(stream=True, **kwargs) if ch.choices]
    deltas = [d for ch in chunks for d in (ch.choices[0].delta.tool_calls or [])]
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments
    assert chunks[-1].choices[0].finish_reason == "length"
    assert not any(ch.choices[0].delta.content for ch in chunks)


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_forced_call_takes_over_response_format(server, tool_choice):
    """A forced call with a `response_format` (OpenAI accepts both; the Agents SDK sends both for
    an agent with an output_type): the call's grammar writes the output, as vLLM's does."""
    response_format = {"type": "json_schema", "json_schema": {"name": "convert", "schema": CONVERT}}
    choice = client(server).chat.completions.create(
        model=server.model, messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice, parallel_tool_calls=False,
        response_format=response_format, temperature=0, max_tokens=60).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert len(choice.message.tool_calls) == 1
    assert_valid_calls(choice.message.tool_calls, SCHEMAS if tool_choice == "required" else {"get_weather"})


HERMES_CALL = (r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)", "days": [1-7]\}\}'
               r'\n</tool_call>')


@pytest.mark.parametrize("stream", [False, True])
def test_auto_parses_hermes_calls(server, stream):
    """tool_choice "auto" on a Hermes template: a `<tool_call>` in the output (forced here with a
    regex, since the random model would not write one) comes back as tool_calls, never as content."""
    c = client(server)
    kwargs = dict(model=server.model, messages=MESSAGES, tools=TOOLS, tool_choice="auto", temperature=1.0, seed=3,
                  max_tokens=80, extra_body={"guided_regex": r"Sure\. " + HERMES_CALL})
    if not stream:
        choice = c.chat.completions.create(**kwargs).choices[0]
        calls, content, finish_reason = choice.message.tool_calls, choice.message.content, choice.finish_reason
    else:
        chunks = [ch for ch in c.chat.completions.create(stream=True, **kwargs) if ch.choices]
        content = "".join(ch.choices[0].delta.content or "" for ch in chunks)
        calls = [call for ch in chunks for call in (ch.choices[0].delta.tool_calls or [])]
        finish_reason = chunks[-1].choices[0].finish_reason
    assert finish_reason == "tool_calls"
    assert content == "Sure. "
    assert len(calls) == 1 and calls[0].function.name == "get_weather"
    assert_valid_calls(calls, {"get_weather"})


def test_auto_without_a_call_is_plain_content(server):
    choice = client(server).chat.completions.create(
        model=server.model, messages=MESSAGES, tools=TOOLS, temperature=1.0, seed=4, max_tokens=8,
        extra_body={"guided_regex": "No call: [a-z]{3}"}).choices[0]
    assert choice.message.tool_calls is None and choice.message.content.startswith("No call: ")
    assert choice.finish_reason == "stop"


def test_history_with_tool_calls_and_results_goes_through_the_template(hermes_model_dir, server):
    """An assistant turn that called a tool and the tool's result reach the prompt as the template
    writes them (arguments given as JSON text become objects for the template)."""
    from checkpoints import load
    tokenizer = load.load_tokenizer(hermes_model_dir)
    body = {"messages": MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 24 C"},
    ], "tools": TOOLS}
    text = tokenizer.decode(prompt_token_ids(tokenizer, parse_chat_request(body, "tiny")))
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>' in text
    assert "<tool_response>\nSunny, 24 C\n</tool_response>" in text
    assert '"name": "convert"' in text  # the tools, described by the template
    none = parse_chat_request({**body, "tool_choice": "none"}, "tiny")
    assert "<tools>" not in tokenizer.decode(prompt_token_ids(tokenizer, none))
    assert encode_chat(tokenizer, MESSAGES, tools=TOOLS) != encode_chat(tokenizer, MESSAGES)
    r = requests.post(server.url + "/v1/chat/completions", json={**body, "max_tokens": 4}, timeout=120)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("body,param", [
    ({"tool_choice": "required"}, "tool_choice"),  # no tools
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "missing"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "code_interpreter"}]}, "tools[0]"),
    ({"tools": TOOLS + TOOLS[:1]}, "tools[2].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "strin"}}}],
      "tool_choice": "required"}, "tools"),
    ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "[a-z]+"}, "tool_choice"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"messages": MESSAGES + [{"role": "assistant", "tool_calls": "nope"}]}, "messages[1].tool_calls"),
])
def test_bad_tools_are_refused_naming_the_field(server, body, param):
    r = requests.post(server.url + "/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 4, **body},
                      timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_hermes_parser():
    parse = HermesToolParser().parse
    content, calls = parse('Let me check.\n<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n'
                           '<tool_call>{"name": "b", "arguments": {}}</tool_call>')
    assert content == "Let me check.\n"
    assert [(name, json.loads(arguments)) for name, arguments in calls] == [("a", {"x": 1}), ("b", {})]
    assert parse("<tool_call>{not json}</tool_call>") == ("<tool_call>{not json}</tool_call>", [])
    assert parse("plain") == ("plain", [])
    assert parse('<tool_call>{"name": "a", "arguments": {}}') == (None, [("a", "{}")])  # no closing tag: to the end


def test_hermes_stream_holds_back_what_may_be_a_tag():
    parser = ToolCallParser("auto", format=HermesToolParser())
    sent = [parser.stream(piece, False, None)[0].get("content", "") for piece in ["Hi <tool", "s> and <t"]]
    assert sent == ["Hi ", "<tools> and "]
    delta, finish_reason = parser.stream("ool_call>{\"name\": \"f\", \"arguments\": {}}</tool_call>", True, "stop")
    assert finish_reason == "tool_calls" and "content" not in delta
    assert delta["tool_calls"][0]["function"] == {"name": "f", "arguments": "{}"}
    plain = ToolCallParser("auto", format=HermesToolParser())
    assert plain.stream("a <tool", False, None)[0] == {"content": "a "}
    assert plain.stream("", True, "length") == ({"content": "<tool"}, "length")
