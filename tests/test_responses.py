"""The Responses API (POST /v1/responses) with the openai client's `responses.create` and
`responses.stream`: against the deterministic FakeEngine (shapes, events, input forms, usage,
refusals naming the field) and against the tiny random model with a Hermes-style template
(function calls and their round trip, `text.format` structured output). Every object the server
returns is also validated strictly by the openai package's own pydantic models."""
import json
from pathlib import Path

import jsonschema
import pydantic
import pytest
import requests
from openai.types.responses import Response, ResponseStreamEvent
from typing_extensions import Literal

from jaxserve.engine import Engine, EngineConfig
from serve.app import ServerConfig
from serve.prompts import prompt_token_ids
from serve.protocol import ProtocolError
from serve.responses import parse_responses_request
from tests.test_server import MODEL, FakeEngine, LiveServer, chat_prompt_ids, fake_text
from tests.test_server_engine import LiveServer as EngineServer
from tests.test_tools import HERMES_CALL, SCHEMAS, WEATHER, hermes_model_dir  # noqa: F401 (a fixture)

STREAM_EVENT = pydantic.TypeAdapter(ResponseStreamEvent)
FLAT_TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather forecast", "parameters": WEATHER,
               "strict": True},
              {"type": "function", "name": "convert", "parameters": SCHEMAS["convert"]}]


@pytest.fixture(scope="module")
def fake():
    """A FakeEngine server whose outputs end with EOS after 6 tokens (unless max_output_tokens is lower)."""
    server = LiveServer(FakeEngine(eos_after=6), ServerConfig(drain_timeout_s=2.0))
    yield server
    server.close()


@pytest.fixture
def make_server():
    """FakeEngine servers made with the given engine options, closed after the test."""
    servers = []

    def make(**engine_kwargs):
        servers.append(LiveServer(FakeEngine(**engine_kwargs), ServerConfig(drain_timeout_s=2.0)))
        return servers[-1]

    yield make
    for server in servers:
        server.close()


def post(server, body):
    return requests.post(f"http://127.0.0.1:{server.port}/v1/responses", json=body, timeout=30)


def raw_events(url, body):
    """The events of a streamed request, each checked against its `event:` line and validated strictly."""
    events = []
    with requests.post(url + "/v1/responses", json={**body, "stream": True}, stream=True, timeout=60) as r:
        assert r.status_code == 200 and r.headers["Content-Type"].startswith("text/event-stream")
        lines = [line.decode() for line in r.iter_lines()]  # split as SSE splits: at CR / LF only
    for event_line, data_line, blank in zip(lines[0::3], lines[1::3], lines[2::3]):
        assert event_line.startswith("event: ") and data_line.startswith("data: ") and blank == ""
        data = json.loads(data_line[len("data: "):])
        STREAM_EVENT.validate_python(data)
        assert data["type"] == event_line[len("event: "):]
        events.append(data)
    assert len(lines) == 3 * len(events)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


def test_create_with_text_input_and_instructions(fake):
    raw = fake.client().responses.with_raw_response.create(
        model=MODEL, input="Hello", instructions="Be brief", max_output_tokens=20, temperature=0.5,
        metadata={"run": "7"}, user="u-1", store=False, parallel_tool_calls=False)
    response = raw.parse()
    Response.model_validate(raw.http_response.json())  # strictly, as the openai types define it
    messages = [{"role": "system", "content": "Be brief"}, {"role": "user", "content": "Hello"}]
    prompt = chat_prompt_ids(messages)
    assert fake.engine.prompts[-1] == prompt
    assert fake.engine.params[-1].temperature == 0.5 and fake.engine.params[-1].max_tokens == 20
    assert response.object == "response" and response.id.startswith("resp_") and response.status == "completed"
    assert response.output_text == fake_text(prompt, 6) and len(response.output) == 1
    message = response.output[0]
    assert message.type == "message" and message.role == "assistant" and message.status == "completed"
    assert message.id.startswith("msg_")
    assert (response.usage.input_tokens, response.usage.output_tokens, response.usage.total_tokens) == \
        (len(prompt), 7, len(prompt) + 7)  # 6 letters and the EOS
    assert (response.instructions, response.max_output_tokens, response.metadata, response.user) == \
        ("Be brief", 20, {"run": "7"}, "u-1")
    assert response.temperature == 0.5 and response.parallel_tool_calls is False and response.tools == []
    assert response.text.format.type == "text" and response.tool_choice == "auto" and response.model == MODEL


def test_max_output_tokens_makes_an_incomplete_response(fake):
    response = fake.client().responses.create(model=MODEL, input="Hello", max_output_tokens=3)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.output[0].status == "incomplete"
    assert response.output_text == fake_text(chat_prompt_ids([{"role": "user", "content": "Hello"}]), 3)


def test_message_items_go_through_the_chat_template(fake):
    """Messages with string or input_text / output_text content, a function call and its output:
    the prompt is the chat template's for the same conversation in chat's form."""
    items = [{"role": "developer", "content": "Answer in letters"},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather "},
                                                              {"type": "input_text", "text": "in Paris?"}]},
             {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
              "content": [{"type": "output_text", "text": "Checking.", "annotations": []}]},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather",
              "arguments": '{"city": "Paris", "days": 1}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "Sunny"},
             {"role": "user", "content": "And tomorrow?"}]
    response = fake.client().responses.create(model=MODEL, input=items, max_output_tokens=4)
    assert response.status == "incomplete"
    expected = [{"role": "developer", "content": "Answer in letters"},
                {"role": "user", "content": "Weather in Paris?"}, {"role": "assistant", "content": "Checking."},
                {"role": "tool", "content": "Sunny"}, {"role": "user", "content": "And tomorrow?"}]
    assert fake.engine.prompts[-1] == chat_prompt_ids(expected)


def test_function_calls_become_the_assistant_turn_s_tool_calls():
    body = {"instructions": "Be brief", "input": [
        {"role": "user", "content": "Weather?"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Two cities."}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Rome", "days": 2}'},
        {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": '{"city": "Oslo", "days": 1}'},
        {"type": "function_call_output", "call_id": "c1", "output": "Rain"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "Snow"}]},
        {"type": "function_call", "call_id": "c3", "name": "convert", "arguments": '{"amount": 3, "to": "EUR"}'}]}
    request = parse_responses_request(body, MODEL)
    calls = [{"id": f"c{i}", "type": "function", "function": {"name": name, "arguments": arguments}}
             for i, name, arguments in [(1, "get_weather", {"city": "Rome", "days": 2}),
                                        (2, "get_weather", {"city": "Oslo", "days": 1}),
                                        (3, "convert", {"amount": 3, "to": "EUR"})]]
    assert request.messages == [
        {"role": "system", "content": "Be brief"}, {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Two cities.", "tool_calls": calls[:2]},
        {"role": "tool", "content": "Rain", "tool_call_id": "c1", "name": "get_weather"},
        {"role": "tool", "content": "Snow", "tool_call_id": "c2", "name": "get_weather"},
        {"role": "assistant", "content": "", "tool_calls": calls[2:]}]


def test_input_image_parts_become_chat_image_parts():
    """A message's input_image parts go to the chat parser as they are: the template gets an image
    part, the request its URL; in an instruction (system) message they are refused by name."""
    content = [{"type": "input_text", "text": "What is it?"}, {"type": "input_image", "image_url": "U", "detail": "low"}]
    request = parse_responses_request({"input": [{"role": "user", "content": content}]}, MODEL)
    assert request.messages == [{"role": "user", "content": [{"type": "text", "text": "What is it?"},
                                                             {"type": "image"}]}]
    assert [ref.url for ref in request.images] == ["U"]
    with pytest.raises(ProtocolError) as info:
        parse_responses_request({"input": [{"role": "developer", "content": content}]}, MODEL)
    assert info.value.param == "input" and "user messages only" in info.value.message


def test_stream_events_in_order_and_the_final_response(fake):
    body = {"model": MODEL, "input": "Hello", "max_output_tokens": 20, "metadata": {"a": "b"}}
    events = raw_events(f"http://127.0.0.1:{fake.port}", body)
    kinds = [e["type"] for e in events]
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added"] + ["response.output_text.delta"] * len(deltas) + \
        ["response.output_text.done", "response.content_part.done", "response.output_item.done",
         "response.completed"]
    text = fake_text(chat_prompt_ids([{"role": "user", "content": "Hello"}]), 6)
    assert "".join(e["delta"] for e in deltas) == text and len(deltas) == 6
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    item_id = events[2]["item"]["id"]
    assert {e["item_id"] for e in events[3:-2] if "item_id" in e} == {item_id}
    assert events[-4]["text"] == events[-3]["part"]["text"] == events[-2]["item"]["content"][0]["text"] == text
    final = events[-1]["response"]
    assert final["status"] == "completed" and final["output"] == [events[-2]["item"]]
    assert final["usage"]["output_tokens"] == 7 and final["metadata"] == {"a": "b"}
    assert len({e["response"]["id"] for e in events if "response" in e}) == 1

    with fake.client().responses.stream(model=MODEL, input="Hello", max_output_tokens=20) as stream:
        streamed = "".join(event.delta for event in stream if event.type == "response.output_text.delta")
    final = stream.get_final_response()
    assert streamed == final.output_text == text and final.status == "completed"


def test_a_stream_cut_by_max_output_tokens_ends_incomplete(fake):
    events = raw_events(f"http://127.0.0.1:{fake.port}", {"model": MODEL, "input": "Hello", "max_output_tokens": 2})
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert events[-2]["item"]["status"] == "incomplete" and events[-1]["response"]["usage"]["output_tokens"] == 2


def test_a_failed_generation(make_server):
    server = make_server(fail_after=2)
    events = raw_events(f"http://127.0.0.1:{server.port}", {"model": MODEL, "input": "Hello", "max_output_tokens": 9})
    assert events[-1]["type"] == "response.failed"
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and failed["error"]["code"] == "server_error"
    streamed = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert len(streamed) == 2 and failed["output"][0]["content"][0]["text"] == streamed
    r = post(server, {"model": MODEL, "input": "Hello", "max_output_tokens": 9})
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"


def test_neutral_values_of_unimplemented_fields_are_accepted(fake):
    r = post(fake, {"model": MODEL, "input": "Hello", "max_output_tokens": 2, "store": False, "include": [],
                    "truncation": "disabled", "reasoning": {"effort": None, "summary": None}, "top_logprobs": 0,
                    "service_tier": "auto", "text": {"format": {"type": "text"}}, "previous_response_id": None,
                    "background": False, "prompt_cache_key": "k", "safety_identifier": "s", "tool_choice": "none",
                    "tools": [], "max_tool_calls": None, "prompt": None})
    assert r.status_code == 200, r.text
    Response.model_validate(r.json())


LONE_SURROGATE = '{"model": "%s", "input": "a\\ud800"}' % MODEL


@pytest.mark.parametrize("body,param", [
    ({"store": True}, "store"),
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"background": True}, "background"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"truncation": "auto"}, "truncation"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"stream": True, "stream_options": {"include_obfuscation": True}}, "stream_options"),
    ({"input": None}, "input"),
    ({"input": []}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "file_1"}]}]}, "input[0].content[0]"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:,"}]}]}, "input"),  # text model
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c",
                 "output": [{"type": "input_image", "image_url": "data:,"}]}]}, "input[1].output[0]"),
    ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
    ({"input": [{"type": "function_call_output", "call_id": "call_9", "output": "x"}]}, "input[0].call_id"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "input[0].arguments"),
    ({"instructions": 5}, "instructions"),
    ({"tools": [{"type": "web_search"}]}, "tools[0]"),
    ({"tools": [{"type": "function", "name": "bad name!"}]}, "tools[0].name"),
    ({"tools": [{"type": "function", "name": "f", "parameters": "nope"}]}, "tools[0].parameters"),
    ({"tools": [{"type": "function", "name": "f", "strict": "yes"}]}, "tools[0].strict"),
    ({"tools": FLAT_TOOLS, "tool_choice": {"type": "function", "name": "missing"}}, "tool_choice"),
    ({"tools": FLAT_TOOLS, "tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": []}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"text": {"format": {"type": "json_schema", "schema": {"type": "object"}}}}, "text.format.name"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"text": {"format": {"type": "yaml"}}}, "text.format"),
    ({"text": {"verbosity": "low"}}, "text.verbosity"),
    ({"max_output_tokens": "many"}, "max_output_tokens"),
    ({"max_output_tokens": 10**6}, "max_output_tokens"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"text": {"format": {"type": "json_object"}}, "structured_outputs": {"regex": "a+"}}, "structured_outputs.regex"),
    ({"temperature": -1}, "temperature"),
    ({"metadata": {"k": 1}}, "metadata"),
    ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"input": "x" * 5000}, "input"),  # longer than the context could hold
    (LONE_SURROGATE, "input"),
])
def test_bad_fields_are_refused_naming_them(fake, body, param):
    if isinstance(body, str):
        r = requests.post(f"http://127.0.0.1:{fake.port}/v1/responses", data=body,
                          headers={"Content-Type": "application/json"}, timeout=30)
    else:
        r = post(fake, {"model": MODEL, "input": "Hello", "max_output_tokens": 4, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    assert not any(chat_name in error["message"] for chat_name in ("'messages", "max_tokens", "response_format",
                                                                   ".function.")), error


def test_an_unknown_model_is_a_404(fake):
    r = post(fake, {"model": "gpt-9", "input": "Hello"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


@pytest.mark.parametrize("method", ["GET", "DELETE"])
def test_no_response_is_stored_to_fetch(fake, method):
    created = fake.client().responses.create(model=MODEL, input="Hello", max_output_tokens=2)
    r = requests.request(method, f"http://127.0.0.1:{fake.port}/v1/responses/{created.id}", timeout=10)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    assert created.id in r.json()["error"]["message"]


def test_the_route_is_documented():
    text = (Path(__file__).parent.parent / "docs" / "api.md").read_text()
    assert "POST /v1/responses" in text and "previous_response_id" in text


# ---- the tiny random model: tools and structured output ------------------------------------------

@pytest.fixture(scope="module")
def engine_server(hermes_model_dir):  # noqa: F811 (the fixture imported above)
    engine = Engine.from_model(hermes_model_dir, EngineConfig(
        max_num_seqs=16, max_num_batched_tokens=256, page_size=8, num_pages=800, max_model_len=512, warmup=False))
    live = EngineServer(engine)
    live.model = engine.model_name
    live.tokenizer = engine.tokenizer
    yield live
    live.close()


def engine_client(server):
    import openai
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def assert_valid_calls(output, allowed):
    calls = [item for item in output if item.type == "function_call"]
    assert calls, output
    for call in calls:
        assert call.id.startswith("fc_") and call.call_id.startswith("call_") and call.status == "completed"
        assert call.name in allowed
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    return calls


def test_function_call_round_trip(engine_server):
    """"required" gives function calls whose arguments validate; sent back with their outputs,
    the calls and results reach the model through its template."""
    client = engine_client(engine_server)
    question = [{"role": "user", "content": "Weather in Paris for 3 days?"}]
    first = client.responses.create(model=engine_server.model, input=question, tools=FLAT_TOOLS,
                                    tool_choice="required", temperature=1.0, max_output_tokens=120,
                                    extra_body={"seed": 11})
    assert first.status == "completed"
    calls = assert_valid_calls(first.output, SCHEMAS)
    follow_up = question + [item.model_dump(exclude_none=True) for item in first.output] + [
        {"type": "function_call_output", "call_id": call.call_id, "output": f"Sunny {i}"}
        for i, call in enumerate(calls)]
    second = client.responses.create(model=engine_server.model, input=follow_up, tools=FLAT_TOOLS,
                                     tool_choice={"type": "function", "name": "convert"}, temperature=1.0,
                                     max_output_tokens=60, extra_body={"seed": 5})
    assert_valid_calls(second.output, {"convert"})
    request = parse_responses_request({"input": follow_up, "tools": FLAT_TOOLS}, engine_server.model)
    prompt = engine_server.tokenizer.decode(prompt_token_ids(engine_server.tokenizer, request))
    for i, call in enumerate(calls):
        assert json.dumps({"name": call.name, "arguments": json.loads(call.arguments)}) in prompt
        assert f"<tool_response>\nSunny {i}\n</tool_response>" in prompt
    assert '"name": "convert"' in prompt  # the tools, described by the template


def test_a_named_call_streams_its_arguments(engine_server):
    client = engine_client(engine_server)
    kwargs = dict(model=engine_server.model, input="Convert 3 euros", tools=FLAT_TOOLS, temperature=1.0,
                  tool_choice={"type": "function", "name": "convert"}, max_output_tokens=60)
    whole = client.responses.create(**kwargs, extra_body={"seed": 5})
    (call,) = assert_valid_calls(whole.output, {"convert"})
    events = raw_events(engine_server.url, {**kwargs, "seed": 5})
    deltas = [e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"]
    done = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    assert len(deltas) > 2 and "".join(deltas) == done[0]["arguments"] == call.arguments
    assert [e["type"] for e in events[-3:]] == ["response.function_call_arguments.done",
                                                "response.output_item.done", "response.completed"]
    assert events[-1]["response"]["output"][0]["arguments"] == call.arguments
    with client.responses.stream(**kwargs, extra_body={"seed": 5}) as stream:
        for _ in stream:
            pass
    assert stream.get_final_response().output[0].arguments == call.arguments


@pytest.mark.parametrize("stream", [False, True])
def test_auto_parses_a_hermes_call_after_text(engine_server, stream):
    """tool_choice "auto" on a Hermes template: the text before a `<tool_call>` (forced here with
    vLLM's structured_outputs regex) is a message, the call a function_call item after it."""
    body = {"model": engine_server.model, "input": "Weather in Paris?", "tools": FLAT_TOOLS, "temperature": 1.0,
            "seed": 3, "max_output_tokens": 80, "structured_outputs": {"regex": r"Sure\. " + HERMES_CALL}}
    if stream:
        events = raw_events(engine_server.url, body)
        added = [e["item"]["type"] for e in events if e["type"] == "response.output_item.added"]
        assert added == ["message", "function_call"]
        output = events[-1]["response"]["output"]
    else:
        r = requests.post(engine_server.url + "/v1/responses", json=body, timeout=120)
        assert r.status_code == 200, r.text
        output = Response.model_validate(r.json()).model_dump()["output"]
    assert [item["type"] for item in output] == ["message", "function_call"]
    assert output[0]["content"][0]["text"] == "Sure. " and output[1]["name"] == "get_weather"
    jsonschema.validate(json.loads(output[1]["arguments"]), WEATHER)


class Forecast(pydantic.BaseModel):
    city: Literal["Paris", "Rome", "Oslo"]
    days: int = pydantic.Field(ge=1, le=7)


def test_text_format_json_schema_output_validates(engine_server):
    client = engine_client(engine_server)
    text = {"format": {"type": "json_schema", "name": "forecast", "schema": WEATHER, "strict": True}}
    whole = client.responses.create(model=engine_server.model, input="Forecast?", text=text, temperature=1.0,
                                    max_output_tokens=60, extra_body={"seed": 2})
    assert whole.status == "completed" and whole.text.format.name == "forecast"
    jsonschema.validate(json.loads(whole.output_text), WEATHER)
    with client.responses.stream(model=engine_server.model, input="Forecast?", text=text, temperature=1.0,
                                 max_output_tokens=60, extra_body={"seed": 2}) as stream:
        streamed = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
    assert streamed == stream.get_final_response().output_text == whole.output_text
    parsed = client.responses.parse(model=engine_server.model, input="Forecast?", text_format=Forecast,
                                    temperature=1.0, max_output_tokens=60, extra_body={"seed": 4})
    assert isinstance(parsed.output_parsed, Forecast)


def test_text_formats_become_the_chat_constraints():
    as_object = parse_responses_request({"input": "x", "text": {"format": {"type": "json_object"}}}, MODEL)
    assert (as_object.structured_output.kind, as_object.structured_output.param) == ("json_object", "text.format")
    schema = parse_responses_request({"input": "x", "text": {"format": {
        "type": "json_schema", "name": "f", "schema": WEATHER}}}, MODEL).structured_output
    assert (schema.kind, schema.spec, schema.param) == ("json_schema", WEATHER, "text.format.schema")
    assert parse_responses_request({"input": "x", "text": {"format": {"type": "text"}}}, MODEL).structured_output \
        is None


def test_a_bad_schema_is_refused_naming_text_format(engine_server):
    r = requests.post(engine_server.url + "/v1/responses", timeout=60, json={
        "model": engine_server.model, "input": "x", "text": {"format": {
            "type": "json_schema", "name": "bad", "schema": {"type": "strin"}}}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "text.format.schema", r.text

