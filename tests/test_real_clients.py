"""Clients built for vLLM and OpenAI, unchanged, against a live server on the tiny random model
with a Hermes-style template (tests/test_tools.py's): langchain-openai's ChatOpenAI (chat and the
Responses API), litellm's `openai/` provider and the openai Agents SDK. Each does what its users
do: a plain chat (the text equals the server's own answer to the same greedy request), a streamed
one, tool calls forced by "required" or a named function (the parsed call names a tool and its
arguments validate against the schema) and structured output (the parsed object validates).
Every test also fails if a client reached for the network (only loopback is allowed), and a
client that is not installed skips its tests."""
import asyncio
import contextlib
import ipaddress
import json
import socket
from typing import Annotated, Literal

import jsonschema
import pydantic
import pytest
import requests

from tests.test_tools import MESSAGES, SCHEMAS, TOOLS, WEATHER, server  # noqa: F401 (a fixture)

pytestmark = pytest.mark.slow  # clients against a server: out of `make test-quick`

PROMPT = MESSAGES[0]["content"]


class Forecast(pydantic.BaseModel):
    """The structured output asked for: its JSON schema is sent, its validation is the check."""
    city: Literal["Paris", "Rome", "Oslo"]
    days: int = pydantic.Field(ge=1, le=7)


def _is_loopback(host) -> bool:
    host = host.decode() if isinstance(host, bytes) else host
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@contextlib.contextmanager
def loopback_only():
    """Refuse (and record) every DNS lookup or connection to a host that is not loopback: the
    clients must work offline, where a fetch at import or call would fail or hang."""
    attempts = []
    connect, getaddrinfo = socket.socket.connect, socket.getaddrinfo

    def guarded_connect(sock, address):
        if sock.family in (socket.AF_INET, socket.AF_INET6) and not _is_loopback(address[0]):
            attempts.append(address)
            raise OSError(f"test_real_clients: network access to {address} refused")
        return connect(sock, address)

    def guarded_getaddrinfo(host, *args, **kwargs):
        if host is not None and not _is_loopback(host):
            attempts.append(host)
            raise socket.gaierror(f"test_real_clients: DNS lookup of {host} refused")
        return getaddrinfo(host, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(socket.socket, "connect", guarded_connect)
        patch.setattr(socket, "getaddrinfo", guarded_getaddrinfo)
        yield attempts


@pytest.fixture(autouse=True)
def offline():
    with loopback_only() as attempts:
        yield
    assert not attempts, f"a client reached for the network: {attempts}"


def import_offline(name: str):
    """`pytest.importorskip(name)` with the network refused (some clients fetch data at import)."""
    with loopback_only() as attempts:
        module = pytest.importorskip(name)
    assert not attempts, f"importing {name} reached for the network: {attempts}"
    return module


def server_chat(server, **body):
    """The server's own answer (plain requests) to a greedy chat request."""
    r = requests.post(server.url + "/v1/chat/completions", timeout=60,
                      json={"model": server.model, "messages": MESSAGES, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def server_response(server, **body):
    """The server's own answer to a greedy Responses request."""
    r = requests.post(server.url + "/v1/responses", timeout=60,
                      json={"model": server.model, "input": PROMPT, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def assert_valid_call(name, arguments, allowed):
    assert name in allowed
    jsonschema.validate(arguments, SCHEMAS[name])


# ---- langchain-openai -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def chat_openai(server):  # noqa: F811 (the fixture imported above)
    """ChatOpenAI on the server, greedy; `chat_openai(use_responses_api=True)` for the Responses API."""
    langchain_openai = import_offline("langchain_openai")

    def make(**kwargs):
        return langchain_openai.ChatOpenAI(model=server.model, base_url=server.url + "/v1", api_key="unused",
                                           temperature=0, max_retries=0, timeout=60, **kwargs)
    return make


@pytest.mark.parametrize("responses_api", [False, True])
def test_langchain_invoke_and_stream(server, chat_openai, responses_api):  # noqa: F811
    llm = chat_openai(max_tokens=8, use_responses_api=responses_api)
    message = llm.invoke(PROMPT)
    if responses_api:
        expected = server_response(server, max_output_tokens=8)
        text, usage = expected["output"][0]["content"][0]["text"], expected["usage"]
        assert message.response_metadata["status"] == "incomplete"
        assert (message.usage_metadata["input_tokens"], message.usage_metadata["output_tokens"]) == \
            (usage["input_tokens"], usage["output_tokens"])
    else:
        expected = server_chat(server, max_tokens=8)
        text, usage = expected["choices"][0]["message"]["content"], expected["usage"]
        assert message.response_metadata["finish_reason"] == "length"
        assert (message.usage_metadata["input_tokens"], message.usage_metadata["output_tokens"]) == \
            (usage["prompt_tokens"], usage["completion_tokens"])
    assert text and message.text == text
    chunks = list(llm.stream(PROMPT))
    assert len(chunks) > 2 and "".join(chunk.text for chunk in chunks) == text


@pytest.mark.parametrize("responses_api", [False, True])
@pytest.mark.parametrize("tool_choice", ["required", "convert"])
def test_langchain_bind_tools_and_send_the_result_back(chat_openai, responses_api, tool_choice):
    """A forced call parsed into AIMessage.tool_calls; then the call and a ToolMessage with its
    result go back in the history (chat: an assistant turn's tool_calls and a tool message; the
    Responses API: function_call and function_call_output items) and reach the prompt."""
    from langchain_core.messages import HumanMessage, ToolMessage

    llm = chat_openai(max_tokens=60, use_responses_api=responses_api)
    # one call: greedy, the random model repeats a call until max_tokens cuts the array
    message = llm.bind_tools(TOOLS, tool_choice=tool_choice, parallel_tool_calls=False).invoke(PROMPT)
    assert len(message.tool_calls) == 1 and not message.invalid_tool_calls
    (call,) = message.tool_calls
    assert call["id"]
    assert_valid_call(call["name"], call["args"], SCHEMAS if tool_choice == "required" else {tool_choice})
    history = [HumanMessage(PROMPT), message, ToolMessage("Sunny, 24 C", tool_call_id=call["id"])]
    answer = chat_openai(max_tokens=4, use_responses_api=responses_api).bind_tools(TOOLS).invoke(history)
    assert answer.text and not answer.tool_calls
    assert answer.usage_metadata["input_tokens"] > message.usage_metadata["input_tokens"] + \
        message.usage_metadata["output_tokens"]  # the prompt, the call, and the result


@pytest.mark.parametrize("responses_api", [False, True])
def test_langchain_structured_output(chat_openai, responses_api):
    llm = chat_openai(max_tokens=30, use_responses_api=responses_api)
    forecast = llm.with_structured_output(Forecast, method="json_schema").invoke(PROMPT)
    assert isinstance(forecast, Forecast)


# ---- litellm --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def litellm():
    """litellm with its model cost map read from the package (it fetches it from GitHub otherwise)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")
        yield import_offline("litellm")


def litellm_kwargs(server, **kwargs):
    return dict(model="openai/" + server.model, api_base=server.url + "/v1", api_key="unused", messages=MESSAGES,
                temperature=0, num_retries=0, timeout=60, **kwargs)


def test_litellm_completion_streamed_and_async(server, litellm):  # noqa: F811
    expected = server_chat(server, max_tokens=8)
    text = expected["choices"][0]["message"]["content"]
    response = litellm.completion(**litellm_kwargs(server, max_tokens=8))
    assert text and response.choices[0].message.content == text
    assert response.choices[0].finish_reason == "length"
    assert response.usage.completion_tokens == expected["usage"]["completion_tokens"]
    chunks = list(litellm.completion(**litellm_kwargs(server, max_tokens=8, stream=True)))
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks) == text
    response = asyncio.run(litellm.acompletion(**litellm_kwargs(server, max_tokens=8)))
    assert response.choices[0].message.content == text


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_litellm_tools_streamed_and_not(server, litellm, tool_choice):  # noqa: F811
    kwargs = litellm_kwargs(server, max_tokens=60, tools=TOOLS, tool_choice=tool_choice, parallel_tool_calls=False)
    choice = litellm.completion(**kwargs).choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    (call,) = choice.message.tool_calls
    assert_valid_call(call.function.name, json.loads(call.function.arguments),
                      SCHEMAS if tool_choice == "required" else {"get_weather"})
    chunks = list(litellm.completion(stream=True, **kwargs))
    streamed = litellm.stream_chunk_builder(chunks).choices[0]  # the chunks put together as litellm's users do
    assert streamed.finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls] == \
        [(call.function.name, call.function.arguments)]


def test_litellm_structured_output(server, litellm):  # noqa: F811
    response = litellm.completion(**litellm_kwargs(server, max_tokens=30, response_format=Forecast))
    Forecast.model_validate_json(response.choices[0].message.content)


# ---- the openai Agents SDK ------------------------------------------------------------------------

def test_agents_sdk_runs_a_function_tool(server):  # noqa: F811
    """An Agent with one function tool and an output_type, whose first turn must call the tool (a
    named tool_choice, sent with the output's text.format): the SDK runs the tool, sends the call
    and its output back as input items and, the choice reset to "auto", the structured answer
    (the text.format's grammar) is the final output."""
    agents = import_offline("agents")
    import openai
    agents.set_tracing_disabled(True)
    calls = []

    @agents.function_tool
    def get_weather(city: Literal["Paris", "Rome", "Oslo"], days: Annotated[int, pydantic.Field(ge=1, le=7)]) -> str:
        """Weather forecast."""
        calls.append((city, days))
        return f"Sunny in {city} for {days} days"

    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    agent = agents.Agent(name="forecaster", instructions="Answer with the forecast.", tools=[get_weather],
                         output_type=Forecast, model=agents.OpenAIResponsesModel(model=server.model,
                                                                                 openai_client=client),
                         model_settings=agents.ModelSettings(tool_choice="get_weather", temperature=0, max_tokens=40))
    result = asyncio.run(agents.Runner.run(agent, PROMPT, max_turns=3))
    assert len(calls) == 1
    jsonschema.validate(dict(zip(("city", "days"), calls[0])), WEATHER)
    assert [item.type for item in result.new_items] == ["tool_call_item", "tool_call_output_item",
                                                        "message_output_item"]
    assert result.new_items[1].output == "Sunny in {} for {} days".format(*calls[0])
    assert isinstance(result.final_output, Forecast) and len(result.raw_responses) == 2
