"""No grammar or tool call can crash, poison or stall the server: the operator's reproductions
against a live `jaxserve serve` on the tiny model (its own process: a crash ends only that process),
while streams run beside them. Each checks the status and the field named, that the streams finish
with every token, that the server's memory stays bounded and that its log has no traceback."""
from __future__ import annotations

import json

import psutil
import pytest
import requests

from jaxserve.core.structured_output import reference_loop
from tests.test_hostile_requests import AUTH, ServeProcess, Streams, post

pytestmark = pytest.mark.slow  # servers: out of `make test-quick`

CHAIN_3000 = ("start: r0\n" + "".join(f'r{i}: "t{i} " r{i + 1}\n' for i in range(3000)) + 'r3000: "end"\n')
CHAIN_4000 = ("start: a0\n" + "".join(f"a{i}: a{i + 1}\n" for i in range(4000)) + 'a4000: "x"\n')


@pytest.fixture(scope="module")
def server(tiny_chat_model_dir):
    live = ServeProcess([f"--model={tiny_chat_model_dir}", "--port=0", "--api_key=hostile-test-key",
                         "--served_model_name=tiny", "--max_num_seqs=8", "--max_num_batched_tokens=64",
                         "--drain_timeout_s=2"], 1024)
    yield live
    live.close()


@pytest.fixture(scope="module")
def solo_texts(server):
    """The Streams' texts with nothing else running (greedy): what they must be beside an attack."""
    streams = Streams(server)
    streams.check()
    return streams.texts


def check_streams(streams: Streams, solo_texts) -> None:
    streams.check()
    assert streams.texts == solo_texts


@pytest.fixture
def clean_log(server):
    mark = len(server.lines)
    yield
    log = server.log_since(mark)
    assert "Traceback" not in log and " ERROR " not in log, log


def completion(server, extra: dict, max_tokens: int = 8) -> requests.Response:
    return post(server, "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": max_tokens,
                                            "temperature": 0.0, **extra}, timeout=120)


def chat(server, messages, extra=None) -> requests.Response:
    return post(server, "/v1/chat/completions", {"model": "tiny", "messages": messages, "max_tokens": 4,
                                                 "temperature": 0.0, **(extra or {})}, timeout=120)


def test_rule_chains_that_overflowed_the_stack_compile_and_streams_finish(server, clean_log, solo_texts):
    streams = Streams(server)
    for grammar in (CHAIN_3000, CHAIN_4000):
        assert len(grammar) < 65536
        r = completion(server, {"guided_grammar": grammar}, max_tokens=6)
        assert r.status_code == 200, r.text
        text = r.json()["choices"][0]["text"]
        assert "t0 t1 t2".startswith(text) or text.startswith("t0 ") or set(text) <= {"x"}, text
    check_streams(streams, solo_texts)
    assert server.process.poll() is None


RUNAWAY_REGEXES = [f"({c}{{1000}}){{1000}}" for c in "fghijk"]


def test_runaway_regexes_are_400_every_time_and_memory_stays_bounded(server, clean_log, solo_texts):
    process = psutil.Process(server.process.pid)
    completion(server, {"guided_regex": "[a-z]+"})  # the grammar machinery's own memory, once
    before = process.memory_info().rss
    streams = Streams(server)
    for regex in RUNAWAY_REGEXES * 2:  # the second time too: a failure is never cached as a success
        r = completion(server, {"guided_regex": regex})
        assert r.status_code == 400, (regex, r.status_code, r.text)
        error = r.json()["error"]
        assert error["param"] == "guided_regex" and "MiB" in error["message"], error
    check_streams(streams, solo_texts)
    grown = process.memory_info().rss - before
    assert grown < 100 << 20, f"the server's RSS grew by {grown >> 20} MiB"


CLIENT_ERRORS = [  # (route, body, param): each was a 500 with a traceback
    ("completions", {"guided_json": {"type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"]}},
     "guided_json"),
    ("completions", {"guided_grammar": 'start: "a" start'}, "guided_grammar"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"]}}}],
              "tool_choice": "required"}, "tools"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f"}}],
              "tool_choice": {"type": "function", "function": {"name": ["f"]}}}, "tool_choice"),
]


def test_client_errors_of_grammars_and_tools_are_400_naming_the_field(server, clean_log, solo_texts):
    streams = Streams(server)
    for route, extra, param in CLIENT_ERRORS * 2:
        if route == "chat":
            r = chat(server, [{"role": "user", "content": "hi"}], extra)
        else:
            r = completion(server, extra)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"].startswith(param), r.json()
    check_streams(streams, solo_texts)


@pytest.mark.parametrize("arguments, status", [
    ("[" * 5000 + "]" * 5000, 200),  # past Python's JSON nesting limit: given to the template as the text it is
    ('{"a":' * 900 + "1" + "}" * 900, 400),  # decodes, but no template could render it: refused, named
])
def test_deeply_nested_tool_call_arguments_are_never_a_500(server, clean_log, arguments, status):
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "ok"}]
    r = chat(server, messages)
    assert r.status_code == status, r.text
    if status == 400:
        assert r.json()["error"]["param"] == "messages[1].tool_calls[0].function.arguments", r.json()


def test_a_deeply_nested_body_is_400(server, clean_log):
    r = post(server, "/v1/completions", '{"model": "tiny", "prompt": "x", "metadata": ' + "[" * 100_000
             + "]" * 100_000 + "}")
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_echo_of_a_prompt_that_fills_the_context_with_max_tokens_0(server, clean_log):
    context = requests.get(server.url + "/v1/models", headers=AUTH, timeout=10).json()["data"][0]["max_model_len"]
    prompt = [(17 * i) % 40000 + 100 for i in range(context)]
    r = post(server, "/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 0, "echo": True,
                                         "logprobs": 1})
    assert r.status_code == 200, r.text
    body = r.json()
    assert (body["usage"]["prompt_tokens"], body["usage"]["completion_tokens"]) == (context, 0)
    assert len(body["choices"][0]["logprobs"]["tokens"]) == context  # echoed, with its logprobs
    r = post(server, "/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text


@pytest.mark.parametrize("field, value", [("user", 123), ("prompt_cache_key", ["k"]), ("safety_identifier", 1.5),
                                          ("metadata", "x")])
def test_hints_of_the_wrong_type_are_400(server, clean_log, field, value):
    r = completion(server, {field: value})
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


def test_a_401_says_how_to_authenticate(server, clean_log):
    r = requests.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "x"}, timeout=10)
    assert r.status_code == 401 and r.headers["WWW-Authenticate"].startswith("Bearer"), r.headers


def test_a_grammar_that_fails_while_generating_is_the_clients_400_and_refused_at_once_next_time(server, clean_log):
    """`start: "a" start` passes its first mask and meets the parser's item limit some tokens later:
    the request ends as a 400 naming the field, counted as invalid_request (not a server error),
    and the same grammar is refused before generating from then on."""
    grammar = 'start: "b" start'  # not used by another test: the first time generates
    before = server.metric("jaxserve_requests_finished_total", '{finish_reason="error"}')
    invalid = server.metric("jaxserve_requests_finished_total", '{finish_reason="invalid_request"}')
    first = completion(server, {"guided_grammar": grammar}, max_tokens=64)
    assert first.status_code == 400 and first.json()["error"]["param"] == "guided_grammar", first.text
    again = completion(server, {"guided_grammar": grammar}, max_tokens=64)
    assert again.status_code == 400 and "cannot be used" in again.json()["error"]["message"], again.text
    assert server.metric("jaxserve_requests_finished_total", '{finish_reason="error"}') == before
    assert server.metric("jaxserve_requests_finished_total", '{finish_reason="invalid_request"}') == invalid + 1


def test_tool_choice_auto_on_a_template_that_ignores_tools_is_refused_never_ignored(server, clean_log):
    """SmolLM2's chat template does not render tools: "auto" (the default with tools) would answer as
    if none were given. Refused, naming why; "required" (a grammar) still works."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}}]
    for extra in ({"tools": tools}, {"tools": tools, "tool_choice": "auto"}):
        r = chat(server, [{"role": "user", "content": "hi"}], extra)
        assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice", r.text
        assert "does not" in r.json()["error"]["message"]
    r = chat(server, [{"role": "user", "content": "hi"}], {"tools": tools, "tool_choice": "required",
                                                         "max_tokens": 40})
    assert r.status_code == 200, r.text


SELF_REFERENCE = {"$ref": "#"}  # a schema whose whole meaning is itself: no value can match it


@pytest.mark.parametrize("schema, loop_at", [
    (SELF_REFERENCE, "#"),
    ({"allOf": [{"$ref": "#"}], "type": "object"}, "#"),
    ({"anyOf": [{"$ref": "#"}, {"$ref": "#/anyOf/0"}]}, "#"),
    ({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}, "#"),
    ({"type": "object", "properties": {"a": {"$ref": "#/properties/a"}}}, "#/properties/a"),
    ({"$defs": {"a/b": {"$ref": "#/$defs/a~1b"}}, "type": "object"}, "#/$defs/a~1b"),
    ({"type": "array", "items": {"properties": {"arguments": {"$id": "urn:t", "$ref": "#"}}}},
     "#/items/properties/arguments"),
])
def test_a_schema_that_only_refers_to_itself_is_named(schema, loop_at):
    loop = reference_loop(schema)
    assert loop is not None and f"the schema at '{loop_at}' refers back to itself" in loop, loop


@pytest.mark.parametrize("schema", [
    {"anyOf": [{"$ref": "#"}, {"type": "integer"}]},  # a branch that ends: recursion with a base case
    {"type": "object", "properties": {"next": {"$ref": "#"}}},  # a value nests, then may stop
    {"$defs": {"x": {"type": "integer"}}, "properties": {"a": {"$ref": "#/$defs/x"}}},
    {"const": {"$ref": "#"}},  # data, not a schema
    {"$ref": "#/$defs/missing"}, {"$ref": "https://example.com/schema"},  # left to the grammar compiler
    {"type": "array", "items": {"properties": {"arguments": {"$id": "urn:t", "$defs": {"x": {"type": "integer"}},
                                                             "$ref": "#/$defs/x"}}}},
])
def test_schemas_whose_references_end_are_left_alone(schema):
    assert reference_loop(schema) is None


SELF_REFERENCING_TOOL = [{"type": "function", "function": {"name": "f", "parameters": SELF_REFERENCE}}]


@pytest.mark.parametrize("extra, param", [
    ({"tools": SELF_REFERENCING_TOOL, "tool_choice": "required"}, "tools[0].function.parameters"),
    ({"tools": SELF_REFERENCING_TOOL, "tool_choice": {"type": "function", "function": {"name": "f"}}},
     "tools[0].function.parameters"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": SELF_REFERENCE}}},
     "response_format.json_schema.schema"),
    ({"guided_json": {"allOf": [SELF_REFERENCE]}}, "guided_json"),
])
def test_a_self_referencing_schema_is_refused_at_admission_in_words(server, clean_log, extra, param):
    """It used to pass admission as a tool under "required" and fail after one token (the stream
    already begun); in response_format it was refused with llguidance's "NoExtensionBias"."""
    r = chat(server, [{"role": "user", "content": "hi"}], {**extra, "stream": True})
    assert r.status_code == 400 and r.headers["Content-Type"].startswith("application/json"), r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    assert "refers back to itself" in error["message"] and "NoExtension" not in error["message"], error


def test_a_tools_references_mean_its_own_parameters_under_required(server, clean_log):
    """"#/$defs/..." in a tool's parameters names its own definitions, also inside the "required"
    grammar that wraps every tool's parameters (it was refused: the pointer resolved in the wrapper)."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "$defs": {"count": {"type": "integer"}}, "type": "object", "properties": {"n": {"$ref": "#/$defs/count"}},
        "required": ["n"], "additionalProperties": False}}}]
    r = chat(server, [{"role": "user", "content": "hi"}], {"tools": tools, "tool_choice": "required", "max_tokens": 40})
    assert r.status_code == 200, r.text
