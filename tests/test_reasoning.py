"""Reasoning parsers (--reasoning_parser=qwen3|deepseek_r1) and chat_template_kwargs: the
`<think>` part comes back as `reasoning` (and `reasoning_content`) apart from `content`, whole and
streamed split anywhere, tools parsed from the content part only; through a live server with a
tiny random model and a Qwen3-style template (enable_thinking), outputs forced by a regex."""
import json

import pytest
import requests

from serve.app import ServerConfig
from serve.chat_output import ChoiceOutput, choice_output_factory
from serve.prompts import prompt_token_ids
from serve.protocol import ProtocolError, parse_chat_request, parse_tokenize_request
from serve.reasoning import REASONING_PARSERS, DeepSeekR1ReasoningParser, Qwen3ReasoningParser
from serve.tool_parsers import HermesToolParser, ToolCallParser
from tests.chat_parsing import chat_template, parsed_streamed, parsed_whole, serve_with_template, splits
from tests.test_tools import TOOLS

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'
WEATHER_CALL = ("get_weather", '{"city": "Paris", "days": 3}')

# (model output, needs_end, (reasoning, content)): deepseek_r1's and qwen3's split (thinking on)
SPLITS = [
    ("<think>\nplan\n</think>\n\nAnswer", False, ("\nplan\n", "\n\nAnswer")),
    ("plan</think>Answer", False, ("plan", "Answer")),  # <think> opened by the template, in the prompt
    ("  <think>plan</think>", False, ("plan", None)),
    ("thinking, cut short by max_tokens", False, ("thinking, cut short by max_tokens", None)),
    ("<thi", False, ("<thi", None)),
    ("a < b </th", False, ("a < b </th", None)),
    ("", False, (None, None)),
    ("<think>plan</think>{\"a\": 1}", True, ("plan", '{"a": 1}')),  # a grammar that writes a think block
    ('{"a": 1}', True, (None, '{"a": 1}')),  # a grammar's output without one: content
    ("<think>unclosed", True, (None, "<think>unclosed")),
]


@pytest.mark.parametrize("text, needs_end, expected", SPLITS)
@pytest.mark.parametrize("parser", [DeepSeekR1ReasoningParser, Qwen3ReasoningParser])
def test_split_whole_and_streamed_split_anywhere(parser, text, needs_end, expected):
    assert parser().split(text, needs_end) == expected

    def make():
        return ChoiceOutput(None, parser(), needs_end=needs_end, reasoning_fields=True)
    whole = parsed_whole(make, text)
    assert whole == (*expected, [], "stop")
    for pieces in splits(text):
        assert parsed_streamed(make, pieces) == whole, pieces


@pytest.mark.parametrize("text, expected", [
    ("<think>\nweather?\n</think>\n\n" + CALL, ("\nweather?\n", None, [WEATHER_CALL], "tool_calls")),
    ("<think>x</think>\nSure. " + CALL, ("x", "\nSure. ", [WEATHER_CALL], "tool_calls")),
    (CALL + "</think>late", (CALL, "late", [], "stop")),  # a "call" inside the reasoning is reasoning
    ("<think>only thinking " + CALL, ("only thinking " + CALL, None, [], "stop")),
])
def test_tools_are_parsed_from_the_content_part_only(text, expected):
    def make():
        return ChoiceOutput(ToolCallParser("auto", format=HermesToolParser()), Qwen3ReasoningParser(),
                            reasoning_fields=True)
    assert parsed_whole(make, text) == expected
    for pieces in splits(text):
        assert parsed_streamed(make, pieces) == expected, pieces


def test_include_reasoning_false_drops_it_and_keeps_the_content():
    output = ChoiceOutput(None, Qwen3ReasoningParser(), include_reasoning=False, reasoning_fields=True)
    assert output.parse("<think>x</think>y", "stop") == (
        {"content": "y", "reasoning": None, "reasoning_content": None}, "stop")
    streamed = ChoiceOutput(None, Qwen3ReasoningParser(), include_reasoning=False)
    assert [streamed.stream(piece, False, None)[0] for piece in ("<think>x", "</think>y")] == [{}, {"content": "y"}]


def _factory(body, reasoning="qwen3"):
    request = parse_chat_request({"messages": [{"role": "user", "content": "hi"}], **body}, "m")
    make = choice_output_factory(request, tool_format=HermesToolParser(), new_call_id=lambda: "id",
                                 reasoning=REASONING_PARSERS[reasoning]() if reasoning else None)
    return make()


def test_which_requests_split_reasoning():
    assert _factory({}).reasoning is not None and _factory({}).tools is None
    assert _factory({"chat_template_kwargs": {"enable_thinking": False}}).reasoning is None  # qwen3: all content
    assert _factory({"chat_template_kwargs": {"enable_thinking": False}}, "deepseek_r1").reasoning is not None
    for grammar in ({"response_format": {"type": "json_object"}}, {"guided_json": {"type": "object"}},
                    {"tools": TOOLS, "tool_choice": "required"}):  # JSON from the first token: no think block
        assert _factory(grammar).reasoning is None
    regex = _factory({"guided_regex": "<think>[a-z]+</think>[a-z]+", "tools": TOOLS})
    assert regex.reasoning is not None and regex.needs_end and regex.tools.mode == "auto"
    assert _factory({}, reasoning=None) is None  # neither tools nor a reasoning parser: plain content


@pytest.mark.parametrize("value, param", [
    ([1], "chat_template_kwargs"), ("x", "chat_template_kwargs"),
    ({"tools": []}, "chat_template_kwargs.tools"), ({"add_generation_prompt": False},
                                                    "chat_template_kwargs.add_generation_prompt"),
    ({"a": json.loads("[" * 70 + "]" * 70)}, "chat_template_kwargs"),
])
def test_bad_chat_template_kwargs_are_refused_naming_them(value, param):
    for parse, body in ((parse_chat_request, {"messages": [{"role": "user", "content": "hi"}]}),
                        (parse_tokenize_request, {"messages": [{"role": "user", "content": "hi"}]})):
        with pytest.raises(ProtocolError) as refused:
            parse({**body, "chat_template_kwargs": value}, "m")
        assert (refused.value.status, refused.value.param) == (400, param)


def test_reasoning_in_the_history_reaches_the_template_and_is_checked():
    request = parse_chat_request({"messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "yes", "reasoning_content": "think"}]},
        "m")
    assert request.messages[1] == {"role": "assistant", "content": "yes", "reasoning": "think",
                                   "reasoning_content": "think"}
    with pytest.raises(ProtocolError) as refused:
        parse_chat_request({"messages": [{"role": "assistant", "content": "", "reasoning": 3}]}, "m")
    assert refused.value.param == "messages[0].reasoning"


# ---- through a live server: a tiny random model with a Qwen3-style template ---------------------

MESSAGES = [{"role": "user", "content": "Weather in Paris for 3 days?"}]


@pytest.fixture(scope="module")
def server(tiny_chat_engine):
    config = ServerConfig(drain_timeout_s=2.0, reasoning_parser="qwen3")
    with serve_with_template(tiny_chat_engine, chat_template("qwen3"), config) as live:
        yield live


def chat(server, stream=False, **body):
    """(reasoning, content, [(name, arguments)], finish_reason) of one choice, streamed or not."""
    body = {"messages": MESSAGES, "max_tokens": 60, "temperature": 1.0, "seed": 3, "stream": stream, **body}
    r = requests.post(server.url + "/v1/chat/completions", json=body, timeout=120, stream=stream)
    assert r.status_code == 200, r.text
    if not stream:
        choice = r.json()["choices"][0]
        message = choice["message"]
        assert message["reasoning"] == message["reasoning_content"]
        calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls") or []]
        return message["reasoning"], message["content"], calls, choice["finish_reason"]
    events = [json.loads(line[len(b"data: "):]) for line in r.iter_lines() if line and line != b"data: [DONE]"]
    choices = [event["choices"][0] for event in events]
    deltas = [choice["delta"] for choice in choices]
    assert all(d.get("reasoning") == d.get("reasoning_content") for d in deltas)
    reasoning = "".join(d.get("reasoning") or "" for d in deltas)
    calls = [(t["function"]["name"], t["function"]["arguments"]) for d in deltas for t in d.get("tool_calls") or []]
    return reasoning or None, "".join(d.get("content") or "" for d in deltas) or None, calls, \
        choices[-1]["finish_reason"]


@pytest.mark.parametrize("stream", [False, True])
def test_forced_thinking_is_split_from_the_answer(server, stream):
    reasoning, content, calls, finish_reason = chat(
        server, stream, guided_regex=r"<think>\nplan [a-z]{3}\n</think>\n\nAnswer: [a-z]{3}")
    assert reasoning.startswith("\nplan ") and reasoning.endswith("\n") and len(reasoning) == 10
    assert content.startswith("\n\nAnswer: ") and len(content) == 13 and not calls and finish_reason == "stop"


@pytest.mark.parametrize("stream", [False, True])
def test_thinking_then_a_tool_call(server, stream):
    regex = r"<think>\n[a-z]{4}\n</think>\n\n" + CALL.replace("{", r"\{").replace("}", r"\}")
    reasoning, content, calls, finish_reason = chat(server, stream, tools=TOOLS, guided_regex=regex)
    assert len(reasoning) == 6 and content is None and calls == [WEATHER_CALL] and finish_reason == "tool_calls"


def test_enable_thinking_false_reaches_the_template_and_makes_it_all_content(server):
    tokenize = requests.post(server.url + "/tokenize", json={
        "messages": MESSAGES, "chat_template_kwargs": {"enable_thinking": False}}, timeout=60).json()
    tokenizer = server.async_engine.tokenizer
    assert tokenizer.decode(tokenize["tokens"]).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    plain = requests.post(server.url + "/tokenize", json={"messages": MESSAGES}, timeout=60).json()
    assert tokenizer.decode(plain["tokens"]).endswith("<|im_start|>assistant\n")
    off = chat(server, max_tokens=12, chat_template_kwargs={"enable_thinking": False})
    assert off[0] is None and off[1] and off[3] == "length"  # the whole output is content
    on = chat(server, max_tokens=12)  # thinking on and no </think>: all of it reasoning (cut by max_tokens)
    assert on[0] and on[1] is None and on[3] == "length"


@pytest.mark.parametrize("stream", [False, True])
def test_include_reasoning_false(server, stream):
    regex = r"<think>[a-z]{3}</think>[a-z]{3}"
    with_it = chat(server, stream, guided_regex=regex)
    without = chat(server, stream, guided_regex=regex, include_reasoning=False)
    assert with_it[0] and without[0] is None and without[1] == with_it[1]


def test_a_turn_with_reasoning_and_a_call_goes_back_through_the_template(server):
    """The answer's reasoning and tool call, given back with the tool's result, render as the
    Qwen3-style template writes them (it shows the reasoning of the last assistant turn only)."""
    regex = r"<think>\n[a-z]{4}\n</think>\n\n" + CALL.replace("{", r"\{").replace("}", r"\}")
    r = requests.post(server.url + "/v1/chat/completions", json={
        "messages": MESSAGES, "tools": TOOLS, "max_tokens": 60, "guided_regex": regex}, timeout=120)
    message = r.json()["choices"][0]["message"]
    turn = {key: message[key] for key in ("role", "content", "tool_calls", "reasoning")}
    tokenizer = server.async_engine.tokenizer

    def prompt(messages, **body):
        request = parse_chat_request({"messages": messages, "tools": TOOLS, **body}, "m")
        return tokenizer.decode(prompt_token_ids(tokenizer, request))
    ended = prompt(MESSAGES + [turn], add_generation_prompt=False)
    assert ended.endswith(f"<|im_start|>assistant\n<think>\n{message['reasoning'].strip()}\n</think>\n\n" + CALL +
                          "<|im_end|>\n")
    answered = prompt(MESSAGES + [turn, {"role": "tool", "tool_call_id": turn["tool_calls"][0]["id"],
                                         "content": "Sunny, 24 C"}])
    assert "<|im_start|>assistant\n" + CALL in answered and "<tool_response>\nSunny, 24 C\n</tool_response>" in answered
    assert "<think>" not in answered.split("<|im_start|>user")[-2]  # an earlier turn's reasoning is left out
