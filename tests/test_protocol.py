"""Request validation and response shaping of the OpenAI server (pure python, no server, no jax)."""
from __future__ import annotations

import math

import pytest

from jaxserve.outputs import RequestOutput, TokenLogprob
from jaxserve.request import InvalidRequestError, RequestLimits, check_request
from serve.protocol import (DEFAULT_COMPLETION_MAX_TOKENS, ChoiceState, ProtocolError, ResponseShaper, admission_error,
                            build_sampling_params, check_prompt_chars, completion_logprobs, parse_chat_request,
                            parse_completion_request, prompt_token_ids)

MODEL = "tiny"


def completion(**fields):
    return parse_completion_request({"model": MODEL, "prompt": "hi", **fields}, MODEL)


def chat(**fields):
    return parse_chat_request({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **fields}, MODEL)


LIMITS = RequestLimits(vocab_size=256, max_seq_len=100, max_model_len=100)


def admit(parse, body, tokenizer=None, limits=LIMITS):
    """What the server and the engine do with a body: parse, tokenize, the engine's admission check."""
    request = parse(body, MODEL)
    check_prompt_chars(request, limits.max_seq_len, max_token_chars=1)
    ids = prompt_token_ids(tokenizer or ListTokenizer(), request)
    params = build_sampling_params(request, len(ids), limits.max_seq_len)
    try:
        check_request(ids, params, limits)
    except InvalidRequestError as e:
        raise admission_error(e, request) from None
    return request, ids, params


def refusal(parse, body, **kwargs) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        admit(parse, body, **kwargs)
    return info.value


BAD_COMMON_FIELDS = [
    ({"model": 3}, "model"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -5}, "max_tokens"),
    ({"max_tokens": "10"}, "max_tokens"),
    ({"max_tokens": 2.5}, "max_tokens"),
    ({"max_tokens": True}, "max_tokens"),
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": 2.5}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"temperature": math.nan}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.01}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"top_k": 1.5}, "top_k"),
    ({"top_k": 2**31}, "top_k"),  # would overflow the step's int32 array
    ({"repetition_penalty": 1e-300}, "repetition_penalty"),  # 0 in float32
    ({"repetition_penalty": 1e308}, "repetition_penalty"),  # inf in float32
    ({"stop_token_ids": [256]}, "stop_token_ids"),
    ({"stop_token_ids": [1] * 257}, "stop_token_ids"),
    ({"stop": ["\ud800"]}, "stop"),
    ({"stop": ["x" * 1025]}, "stop"),
    ({"min_p": 1.5}, "min_p"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"presence_penalty": 2.1}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"seed": -1}, "seed"),
    ({"seed": 2**63}, "seed"),
    ({"seed": "42"}, "seed"),
    ({"n": 0}, "n"),
    ({"n": 17}, "n"),
    ({"stop": 5}, "stop"),
    ({"stop": ["ok", 3]}, "stop"),
    ({"stop": [""]}, "stop"),
    ({"stop": ["x"] * 17}, "stop"),
    ({"stop_token_ids": [1, -1]}, "stop_token_ids"),
    ({"stop_token_ids": "1"}, "stop_token_ids"),
    ({"stream": "yes"}, "stream"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"stream": True, "stream_options": [1]}, "stream_options"),
    ({"stream": True, "stream_options": {"include_usage": 1}}, "include_usage"),
    ({"ignore_eos": "no"}, "ignore_eos"),
    ({"best_of": 2}, "best_of"),
    ({"logit_bias": {"5": 1}}, "logit_bias"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
]


@pytest.mark.parametrize("fields, param", BAD_COMMON_FIELDS)
@pytest.mark.parametrize("parse, base", [
    (parse_completion_request, {"prompt": "hi"}),
    (parse_chat_request, {"messages": [{"role": "user", "content": "hi"}]}),
])
def test_bad_common_fields_are_400_naming_the_field(parse, base, fields, param):
    error = refusal(parse, {**base, **fields})
    assert error.status == 400
    assert error.param == param
    body = error.body()["error"]
    assert set(body) == {"message", "type", "param", "code"}
    assert body["type"] == "invalid_request_error" and body["message"]


@pytest.mark.parametrize("body", [None, [], "text", 3])
def test_body_must_be_an_object(body):
    assert refusal(parse_completion_request, body).status == 400


def test_unknown_model_is_404_model_not_found():
    error = refusal(parse_completion_request, {"model": "gpt-9", "prompt": "hi"})
    assert (error.status, error.code, error.param) == (404, "model_not_found", "model")
    assert "gpt-9" in error.message


@pytest.mark.parametrize("prompt, message_part", [
    (None, "required"),
    (12, "string or a list"),
    ({"text": "hi"}, "string or a list"),
    ([], "must not be empty"),
    ([1, -1], "[0, 256)"),
    ([1, 256], "[0, 256)"),
    ("\ud800", "lone surrogate"),
    ([1, "a"], "token ids"),
    ([1, 2.0], "token ids"),
    (["a", "b"], "batched"),
    ([[1, 2], [3]], "batched"),
])
def test_bad_prompts(prompt, message_part):
    body = {"model": MODEL} if prompt is None else {"model": MODEL, "prompt": prompt}
    error = refusal(parse_completion_request, body)
    assert error.status == 400 and error.param == "prompt"
    assert message_part in error.message


@pytest.mark.parametrize("prompt, expected", [("hello", "hello"), ([5, 6], [5, 6]), (["hello"], "hello"),
                                              ([[5, 6]], [5, 6])])
def test_prompt_forms(prompt, expected):
    assert parse_completion_request({"prompt": prompt}, MODEL).prompt == expected


@pytest.mark.parametrize("fields, param", [
    ({"echo": True}, "echo"),
    ({"suffix": "x"}, "suffix"),
    ({"logprobs": 21}, "logprobs"),
    ({"logprobs": True}, "logprobs"),
    ({"prompt": "x" * 101}, "prompt"),  # longer than the context even at one token per character
])
def test_bad_completion_only_fields(fields, param):
    assert refusal(parse_completion_request, {"prompt": "hi", **fields}).param == param


@pytest.mark.parametrize("messages, param", [
    (None, "messages"),
    ("hi", "messages"),
    ({"role": "user", "content": "hi"}, "messages"),
    ([], "messages"),
    (["hi"], "messages[0]"),
    ([{"content": "hi"}], "messages[0].role"),
    ([{"role": "wizard", "content": "hi"}], "messages[0].role"),
    ([{"role": "user", "content": "a"}, {"role": "user", "content": 5}], "messages[1].content"),
    ([{"role": "user"}], "messages[0].content"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "messages[0].content"),
    ([{"role": "user", "content": "\udfff"}], "messages[0].content"),
    ([{"role": "user", "content": [{"type": "text", "text": "a\ud800"}]}], "messages[0].content"),
    ([{"role": "user", "content": "x" * 60}, {"role": "user", "content": "y" * 41}], "messages"),
])
def test_bad_messages(messages, param):
    body = {} if messages is None else {"messages": messages}
    error = refusal(parse_chat_request, body)
    assert error.status == 400 and error.param == param


@pytest.mark.parametrize("fields, param", [
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"logprobs": 3}, "logprobs"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"tools": [{"type": "function"}]}, "tools"),
])
def test_bad_chat_only_fields(fields, param):
    body = {"messages": [{"role": "user", "content": "hi"}], **fields}
    assert refusal(parse_chat_request, body).param == param


def test_chat_messages_are_normalised_to_text():
    req = parse_chat_request({"messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None},
    ]}, MODEL)
    assert req.messages == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "ab"},
                            {"role": "assistant", "content": ""}]


def test_valid_request_keeps_only_fields_the_client_set():
    req = completion(temperature=0, top_k=5, stop="END", seed=7, n=2, logprobs=3, stream=True,
                     stream_options={"include_usage": True}, ignore_eos=True, user="someone")
    assert req.sampling == {"temperature": 0.0, "top_k": 5, "stop": ["END"], "seed": 7, "ignore_eos": True}
    assert (req.n, req.stream, req.include_usage, req.logprobs, req.max_tokens) == (2, True, True, 3, None)
    assert completion().sampling == {"ignore_eos": False}


def test_chat_logprobs_and_max_completion_tokens():
    assert chat().logprobs is None
    assert chat(logprobs=True).logprobs == 0
    assert chat(logprobs=True, top_logprobs=4).logprobs == 4
    assert chat(max_tokens=9).max_tokens == 9
    assert chat(max_tokens=9, max_completion_tokens=5).max_tokens == 5


def test_default_max_tokens_follow_vllm():
    assert build_sampling_params(completion(), 10, 100).max_tokens == DEFAULT_COMPLETION_MAX_TOKENS
    assert build_sampling_params(completion(), 90, 100).max_tokens == 10
    assert build_sampling_params(chat(), 10, 100).max_tokens == 90


def test_sampling_params_carry_the_request():
    params = build_sampling_params(completion(max_tokens=5, temperature=0.5, top_p=0.9, stop=["a", "b"], seed=3,
                                              logprobs=2, presence_penalty=1, ignore_eos=True), 4, 100)
    assert (params.max_tokens, params.temperature, params.top_p, params.stop, params.seed, params.logprobs,
            params.presence_penalty, params.ignore_eos) == (5, 0.5, 0.9, ["a", "b"], 3, 2, 1.0, True)


@pytest.mark.parametrize("parse, body, param", [
    (parse_completion_request, {"prompt": [1] * 100}, "prompt"),
    (parse_completion_request, {"prompt": [1] * 150}, "prompt"),
    (parse_chat_request, {"messages": [{"role": "user", "content": "x" * 95}]}, "messages"),
    (parse_completion_request, {"prompt": [1] * 90, "max_tokens": 11}, "max_tokens"),
    (parse_chat_request, {"messages": [{"role": "user", "content": "x" * 75}], "max_completion_tokens": 11},
     "max_completion_tokens"),
])
def test_context_length_is_enforced(parse, body, param):
    error = refusal(parse, body)
    assert (error.status, error.code, error.param) == (400, "context_length_exceeded", param)
    assert "100" in error.message


def test_the_refusal_names_the_kv_cache_when_it_is_the_limit():
    small_pool = RequestLimits(vocab_size=256, max_seq_len=40, max_model_len=100)
    error = refusal(parse_completion_request, {"prompt": [1] * 30, "max_tokens": 11}, limits=small_pool)
    assert error.param == "max_tokens" and error.code == "context_length_exceeded"
    assert "maximum context length is 40 tokens (the KV cache holds 40 tokens; max_model_len is 100)" in error.message
    _, _, params = admit(parse_completion_request, {"prompt": [1] * 30, "max_tokens": 10}, limits=small_pool)
    assert params.max_tokens == 10


class ListTokenizer:
    """One token per character: id = code point, plus a tiny chat template."""

    def __init__(self, vocab_size: int = 256, has_template: bool = True, bos: bool = True) -> None:
        self.vocab_size = vocab_size
        self.has_template = has_template
        self.bos = bos

    def __len__(self) -> int:
        return self.vocab_size

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return ([1] if add_special_tokens and self.bos else []) + [ord(c) for c in text]

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        assert tokenize is False and add_generation_prompt is True
        if not self.has_template:
            raise ValueError("no chat template")
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"


def test_prompt_token_ids():
    tokenizer = ListTokenizer()
    assert prompt_token_ids(tokenizer, completion(prompt="ab")) == [1, 97, 98]
    assert prompt_token_ids(tokenizer, completion(prompt="")) == [1]
    assert prompt_token_ids(tokenizer, completion(prompt=[7, 8])) == [7, 8]
    assert prompt_token_ids(tokenizer, chat()) == [ord(c) for c in "<user>hi<assistant>"]


@pytest.mark.parametrize("tokenizer, body, message_part", [
    (ListTokenizer(), {"prompt": [3, 256]}, "[0, 256)"),
    (ListTokenizer(bos=False), {"prompt": ""}, "empty"),
])
def test_prompt_token_id_refusals(tokenizer, body, message_part):
    error = refusal(parse_completion_request, body, tokenizer=tokenizer)
    assert error.status == 400 and error.param == "prompt" and message_part in error.message


def test_a_chat_template_failure_is_400():
    with pytest.raises(ProtocolError) as info:
        prompt_token_ids(ListTokenizer(has_template=False), chat())
    assert info.value.status == 400 and "chat template" in info.value.message


def _output(text: str, token_ids: list[int], finished: bool = False, total: int = 0, logprobs=None) -> RequestOutput:
    return RequestOutput("r", token_ids, text, finished, "length" if finished else None, num_prompt_tokens=3,
                         num_output_tokens=total, new_logprobs=logprobs)


def test_completion_logprobs_offsets():
    entries = [TokenLogprob(97, -0.5, [(97, -0.5), (98, -1.0)]), TokenLogprob(99, -0.25, [(99, -0.25)])]
    shaped = completion_logprobs(entries, lambda t: chr(t) * 2, text_offset=4)
    assert shaped == {"tokens": ["aa", "cc"], "token_logprobs": [-0.5, -0.25],
                      "top_logprobs": [{"aa": -0.5, "bb": -1.0}, {"cc": -0.25}], "text_offset": [4, 6]}


def test_full_responses_and_usage():
    choices = [ChoiceState(), ChoiceState()]
    choices[0].add(_output("ab", [97, 98], finished=True, total=2))
    choices[1].add(_output("c", [99], total=1))
    choices[1].add(_output("d", [100], finished=True, total=2))
    shaper = ResponseShaper(is_chat=True, model=MODEL, token_text=chr, want_logprobs=False)
    response = shaper.full_response(choices)
    assert response["object"] == "chat.completion" and response["id"].startswith("chatcmpl-")
    assert [c["message"]["content"] for c in response["choices"]] == ["ab", "cd"]
    assert [c["index"] for c in response["choices"]] == [0, 1]
    assert response["usage"]["prompt_tokens"] == 3 and response["usage"]["completion_tokens"] == 4
    assert response["usage"]["total_tokens"] == 7


def test_stream_chunks():
    shaper = ResponseShaper(is_chat=False, model=MODEL, token_text=chr, want_logprobs=True, include_usage=True)
    lp = [TokenLogprob(120, -1.0, [(120, -1.0)])]
    first = shaper.delta_chunk(0, _output("x", [120], total=1, logprobs=lp))
    second = shaper.delta_chunk(0, _output("x", [120], finished=True, total=2, logprobs=lp))
    assert first["object"] == "text_completion" and first["usage"] is None
    assert first["choices"][0]["finish_reason"] is None and second["choices"][0]["finish_reason"] == "length"
    assert second["choices"][0]["logprobs"]["text_offset"] == [1]
    chat_shaper = ResponseShaper(is_chat=True, model=MODEL, token_text=chr, want_logprobs=False)
    assert chat_shaper.role_chunk(1)["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    last = chat_shaper.delta_chunk(1, _output("", [], finished=True, total=2))
    assert last["choices"][0]["delta"] == {} and last["choices"][0]["finish_reason"] == "length"
    assert "usage" not in last
