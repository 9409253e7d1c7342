"""Tool calling on the Llama 3.1 Instruct and Mistral v0.3 Instruct chat templates (tests/data, as
the models publish them), through a live server with a tiny random model: the tools reach the
prompt as each template writes them, "auto" parses each family's calls (the output forced by a
regex, since a random model would not write one), streamed or not, and the history with those
calls and their results goes back through the template (Mistral's wants its 9-character ids)."""
import json
import re
import types

import pytest
import requests

from serve.app import ServerConfig, ServerState
from serve.prompts import prompt_token_ids
from serve.protocol import parse_chat_request
from tests.chat_parsing import chat_template, serve_with_template
from tests.test_tools import MESSAGES, TOOLS

pytestmark = pytest.mark.slow  # servers: out of `make test-quick`


def _regex(text: str) -> str:
    return re.escape(text).replace(r"\ ", " ")


# What each family's model writes for a call, and the server config it runs under (Llama's format
# detected from its template, Mistral's given by the flags).
FAMILIES = {
    "llama3_json": {
        "config": {},
        "output": '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome", "days": 2}}',
        "two_calls": '{"name": "get_weather", "parameters": {"city": "Rome", "days": 2}}; '
                     '{"name": "convert", "parameters": {"amount": 5, "to": "EUR"}}',
        "content": None,
        "in_prompt": ['"name": "get_weather"', "\n    \"type\": \"function\",", 'Respond in the format {"name": '
                      'function name, "parameters": dictionary of argument name and its value}.'],
        "history": '<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "get_weather", "parameters": '
                   '{"city": "Rome", "days": 2}}<|eot_id|><|start_header_id|>ipython<|end_header_id|>\n\n'
                   '"Sunny, 24 C"<|eot_id|>',
        "id": "chatcmpl-tool-[0-9a-f]{32}",
    },
    "mistral": {
        "config": {"tool_call_parser": "mistral", "enable_auto_tool_choice": True},
        "output": 'Checking. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}]',
        "two_calls": '[TOOL_CALLS]get_weather[ARGS]{"city": "Rome", "days": 2}'
                     '[TOOL_CALLS]convert[ARGS]{"amount": 5, "to": "EUR"}',
        "content": "Checking. ",
        "in_prompt": ['[AVAILABLE_TOOLS] [{"type": "function", "function": {"name": "get_weather", "description": '
                      '"Weather forecast", "parameters": {'],
        "history": '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}, "id": "{id}"}]'
                   '<|im_end|>[TOOL_RESULTS] {"content": Sunny, 24 C, "call_id": "{id}"}[/TOOL_RESULTS]',
        "id": "[A-Za-z0-9]{9}",
    },
}
ROME = ("get_weather", {"city": "Rome", "days": 2})
CONVERT = ("convert", {"amount": 5, "to": "EUR"})


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tiny_chat_engine):
    """(name, its FAMILIES entry, the server's tokenizer (with the family's template), live server)."""
    name = request.param
    config = ServerConfig(drain_timeout_s=2.0, **FAMILIES[name]["config"])
    with serve_with_template(tiny_chat_engine, chat_template(name), config) as live:
        yield name, FAMILIES[name], tiny_chat_engine.tokenizer, live


def chat(server, stream=False, **body):
    """(content, [(name, arguments object, id)], finish_reason) of one choice, streamed or not."""
    body = {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 80, "temperature": 1.0, "seed": 3,
            "stream": stream, **body}
    r = requests.post(server.url + "/v1/chat/completions", json=body, timeout=120, stream=stream)
    assert r.status_code == 200, r.text
    if not stream:
        choice = r.json()["choices"][0]
        calls = choice["message"].get("tool_calls") or []
        return choice["message"]["content"], [(c["function"]["name"], json.loads(c["function"]["arguments"]),
                                                c["id"]) for c in calls], choice["finish_reason"]
    choices = [json.loads(line[len(b"data: "):])["choices"][0] for line in r.iter_lines()
               if line and line != b"data: [DONE]"]
    calls = [c for choice in choices for c in choice["delta"].get("tool_calls") or []]
    content = "".join(choice["delta"].get("content") or "" for choice in choices)
    return content or None, [(c["function"]["name"], json.loads(c["function"]["arguments"]), c["id"])
                             for c in calls], choices[-1]["finish_reason"]


def test_the_tools_reach_the_prompt_as_the_template_writes_them(family):
    name, spec, tokenizer, _ = family
    text = tokenizer.decode(prompt_token_ids(tokenizer, parse_chat_request({"messages": MESSAGES, "tools": TOOLS},
                                                                           "m")))
    for expected in spec["in_prompt"]:
        assert expected in text
    none = parse_chat_request({"messages": MESSAGES, "tools": TOOLS, "tool_choice": "none"}, "m")
    assert "get_weather" not in tokenizer.decode(prompt_token_ids(tokenizer, none))


@pytest.mark.parametrize("stream", [False, True])
def test_auto_parses_the_familys_calls(family, stream):
    name, spec, _, server = family
    content, calls, finish_reason = chat(server, stream, guided_regex=_regex(spec["output"]))
    assert content == spec["content"] and finish_reason == "tool_calls"
    assert [(n, a) for n, a, _ in calls] == [ROME] and re.fullmatch(spec["id"], calls[0][2])
    content, calls, finish_reason = chat(server, stream, guided_regex=_regex(spec["two_calls"]))
    assert content is None and [(n, a) for n, a, _ in calls] == [ROME, CONVERT]
    assert len({i for _, _, i in calls}) == 2


def test_text_that_is_no_call_stays_content(family):
    _, _, _, server = family
    content, calls, finish_reason = chat(server, guided_regex="No call: [a-z]{4}")
    assert content.startswith("No call: ") and not calls and finish_reason == "stop"


def test_the_calls_and_their_results_go_back_through_the_template(family):
    """The answer's tool calls, given back as the history with the tool's result, render as the
    template writes them, and the server answers the next turn."""
    name, spec, tokenizer, server = family
    _, calls, _ = chat(server, guided_regex=_regex(spec["output"]))
    ((function, arguments, call_id),) = calls
    messages = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": function, "arguments": json.dumps(arguments)}}]},
        {"role": "tool", "tool_call_id": call_id, "content": "Sunny, 24 C"}]
    text = tokenizer.decode(prompt_token_ids(tokenizer, parse_chat_request({"messages": messages, "tools": TOOLS},
                                                                           "m")))
    assert spec["history"].replace("{id}", call_id) in text
    r = requests.post(server.url + "/v1/chat/completions", json={"messages": messages, "tools": TOOLS,
                                                                  "max_tokens": 4}, timeout=120)
    assert r.status_code == 200, r.text


def test_mistrals_template_refuses_other_ids_and_llamas_several_calls(family):
    """The real templates' own refusals come back as 400s naming the messages."""
    name, _, _, server = family
    calls = [{"id": "chatcmpl-tool-0123456789abcdef", "type": "function",
              "function": {"name": "get_weather", "arguments": '{"city": "Rome", "days": 2}'}}]
    if name == "llama3_json":
        calls = calls * 2  # Llama 3.1: "This model only supports single tool-calls at once!"
    messages = MESSAGES + [{"role": "assistant", "content": None, "tool_calls": calls},
                           {"role": "tool", "tool_call_id": calls[0]["id"], "content": "Sunny"}]
    r = requests.post(server.url + "/v1/chat/completions", json={"messages": messages, "max_tokens": 4}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text


def test_mistral_calls_keep_special_tokens_in_the_text(family):
    """[TOOL_CALLS] is a special token of Mistral's tokenizer: under "auto" the server keeps special
    tokens in the text (vLLM does the same) unless the request says otherwise."""
    name, _, _, server = family
    engine = server.async_engine  # its prepare step only, on the server's tokenizer
    stub = types.SimpleNamespace(tokenizer=engine.tokenizer, model_name="m", stats=engine.stats,
                                 max_model_len=engine.max_model_len, add_step_listener=lambda listener: None,
                                 lora_enabled=False, lora_modules=lambda: [], image_service=None)
    state = ServerState(stub, ServerConfig(**FAMILIES[name]["config"]))
    try:
        def params(**body):
            raw = json.dumps({"messages": MESSAGES, "tools": TOOLS, "max_tokens": 4, **body}).encode()
            return state.prepare(raw, is_chat=True)[1][0][1]
        assert params().skip_special_tokens is (name != "mistral")
        assert params(skip_special_tokens=True).skip_special_tokens is True
        assert params(tool_choice="none").skip_special_tokens is True
    finally:
        state.prepare_pool.shutdown()


def test_chat_template_kwargs_reach_the_template_and_its_refusal_names_them(family):
    """Llama 3.1's template reads `date_string` (a string: "Today Date: " + it); Mistral's reads no
    such variable, so it changes nothing there."""
    name, _, tokenizer, server = family
    request = parse_chat_request({"messages": MESSAGES, "chat_template_kwargs": {"date_string": "01 Jan 2030"}}, "m")
    assert ("Today Date: 01 Jan 2030\n" in tokenizer.decode(prompt_token_ids(tokenizer, request))) is (
        name == "llama3_json")
    r = requests.post(server.url + "/v1/chat/completions", json={
        "messages": MESSAGES, "max_tokens": 2, "chat_template_kwargs": {"date_string": 5}}, timeout=60)
    if name == "llama3_json":
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs", r.text
    else:
        assert r.status_code == 200, r.text


def test_an_empty_tool_calls_list_is_a_turn_without_calls(family):
    """Clients send `tool_calls: []` on plain assistant turns; both templates test for the key
    (Llama's would refuse the turn, Mistral's open a call list), so it is left out."""
    _, _, tokenizer, _ = family

    def prompt(**extra):
        messages = MESSAGES + [{"role": "assistant", "content": "Earlier answer", **extra},
                               {"role": "user", "content": "And Rome?"}]
        return tokenizer.decode(prompt_token_ids(tokenizer, parse_chat_request({"messages": messages}, "m")))
    assert prompt(tool_calls=[]) == prompt() and "Earlier answer" in prompt()
