"""Request validation and response shaping of the OpenAI server (pure python, no server, no jax)."""
from __future__ import annotations

import math

import pytest

from jaxserve.core.outputs import RequestOutput, TokenLogprob
from jaxserve.core.request import InvalidRequestError, RequestLimits, check_request
from serve.prompts import check_prompt_chars, prompt_token_ids
from serve.protocol import (DEFAULT_COMPLETION_MAX_TOKENS, UNSUPPORTED_CHAT_FIELDS, UNSUPPORTED_COMPLETION_FIELDS,
                            ProtocolError, admission_error, build_sampling_params, parse_chat_request,
                            parse_completion_request, parse_detokenize_request, parse_tokenize_request)
from serve.shaping import ChoiceState, ResponseShaper, completion_logprobs, select_best, total_usage

MODEL = "tiny"


def completion(**fields):
    return parse_completion_request({"model": MODEL, "prompt": "hi", **fields}, MODEL)


def chat(**fields):
    return parse_chat_request({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **fields}, MODEL)


LIMITS = RequestLimits(vocab_size=256, max_seq_len=100, max_model_len=100)


def admit(parse, body, tokenizer=None, limits=LIMITS, defaults=None):
    """What the server and the engine do with a body: parse, tokenize, the engine's admission check
    of every prompt. Returns the request and the first prompt's ids and parameters."""
    request = parse(body, MODEL)
    check_prompt_chars(request, limits.max_seq_len, max_token_chars=1)
    admitted = []
    for index in range(request.num_prompts):
        ids = prompt_token_ids(tokenizer or ListTokenizer(), request, index)
        params = build_sampling_params(request, len(ids), limits.max_seq_len, defaults)
        try:
            check_request(ids, params, limits)
        except InvalidRequestError as e:
            raise admission_error(e, request) from None
        admitted.append((ids, params))
    return request, *admitted[0]


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
    ({"best_of": 0}, "best_of"),
    ({"best_of": 17}, "best_of"),
    ({"n": 3, "best_of": 2}, "best_of"),
    ({"best_of": 2, "stream": True}, "best_of"),
    ({"best_of": 1.5}, "best_of"),
    ({"logit_bias": [1]}, "logit_bias"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"-1": 1}}, "logit_bias"),
    ({"logit_bias": {"256": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 100.5}}, "logit_bias"),
    ({"logit_bias": {"5": "1"}}, "logit_bias"),
    ({"logit_bias": {"5": math.inf}}, "logit_bias"),
    ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 1.5}, "min_tokens"),
    ({"max_tokens": 5, "min_tokens": 6}, "min_tokens"),
    ({"include_stop_str_in_output": "yes"}, "include_stop_str_in_output"),
    ({"skip_special_tokens": 0}, "skip_special_tokens"),
    ({"add_special_tokens": "no"}, "add_special_tokens"),
    ({"stream": True, "stream_options": {"continuous_usage_stats": "yes"}}, "continuous_usage_stats"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"guided_choice": ["a"], "guided_regex": "a"}, "guided_choice"),
    ({"guided_choice": []}, "guided_choice"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt_logprobs": -1}, "prompt_logprobs"),
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
    (12, "a string, a list of token ids, or a list of either"),
    ({"text": "hi"}, "a string, a list"),
    ([], "must not be empty"),
    ([1, -1], "[0, 256)"),
    ([1, 256], "[0, 256)"),
    ("\ud800", "lone surrogate"),
    ([1, "a"], "token ids"),
    ([1, 2.0], "token ids"),
    (["a", 3], "token ids"),
    (["a", "\ud800"], "prompt 1: 'prompt' is not valid Unicode"),
    ([[1, 2], []], "prompt 1: 'prompt' must not be empty"),
    ([[1, 2], [3, 1.5]], "prompt 1: 'prompt' must be a list of integer token ids"),
    ([[1, 2], [3, 256]], "[0, 256)"),  # the engine's admission check, on the second prompt
    (["a"] * 257, "at most 256 prompts"),
])
def test_bad_prompts(prompt, message_part):
    body = {"model": MODEL} if prompt is None else {"model": MODEL, "prompt": prompt}
    error = refusal(parse_completion_request, body)
    assert error.status == 400 and error.param == "prompt"
    assert message_part in error.message


@pytest.mark.parametrize("prompt, expected", [("hello", ["hello"]), ([5, 6], [[5, 6]]), (["hello"], ["hello"]),
                                              ([[5, 6]], [[5, 6]]), (["a", "bc"], ["a", "bc"]),
                                              ([[1], [2, 3], [4]], [[1], [2, 3], [4]]), (["a", [7]], ["a", [7]])])
def test_prompt_forms(prompt, expected):
    request = parse_completion_request({"prompt": prompt}, MODEL)
    assert request.prompts == expected and request.num_prompts == len(expected)


def test_a_batch_is_bounded_in_sequences_not_only_prompts():
    assert parse_completion_request({"prompt": ["a"] * 16, "n": 16}, MODEL).num_prompts == 16
    error = refusal(parse_completion_request, {"prompt": ["a"] * 20, "n": 2, "best_of": 16})
    assert error.param == "best_of" and "256" in error.message
    assert refusal(parse_completion_request, {"prompt": ["a"] * 20, "n": 16}).param == "n"


@pytest.mark.parametrize("fields, param", [
    ({"echo": "yes"}, "echo"),
    ({"max_tokens": 0}, "max_tokens"),  # only with echo or prompt_logprobs
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
    ([{"role": "system", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}], "messages[0].content"),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": [{"type": "input_image", "image_url": "u"}]}],
     "messages[1].content"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"detail": "low"}}]}], "messages[0].content"),
    ([{"role": "user", "content": [{"type": "image_url"}]}], "messages[0].content"),
    ([{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]}],
     "messages[0].content"),
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
    ({"tools": [{"type": "function"}]}, "tools[0]"),
    ({"echo": True}, "echo"),
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


def test_image_parts_become_template_parts_and_image_refs_in_prompt_order():
    """vLLM's image parts (the URL in an object or, as vLLM also takes, a string; the Responses
    API's input_image) in user messages, earlier turns too: the template gets parts with
    {"type": "image"} for them, the request the URLs in prompt order; a message without an image
    stays a string."""
    req = parse_chat_request({"messages": [
        {"role": "system", "content": [{"type": "text", "text": "be brief"}]},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "U1"}},
                                     {"type": "image_url", "image_url": "U2"}]},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": [{"type": "input_image", "image_url": "U3", "detail": "auto"}]},
    ]}, MODEL)
    assert req.messages == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image"}, {"type": "image"}]},
        {"role": "assistant", "content": "ok"}, {"role": "user", "content": [{"type": "image"}]}]
    assert [(ref.url, ref.index, ref.label) for ref in req.images] == [
        ("U1", 0, "image 1 of message 2"), ("U2", 1, "image 2 of message 2"), ("U3", 2, "image 1 of message 4")]
    assert parse_chat_request({"messages": [{"role": "user", "content": "hi"}]}, MODEL).images == []
    request, _ = parse_tokenize_request({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "U"}}]}]}, MODEL)
    assert [ref.url for ref in request.images] == ["U"]


def test_an_image_outside_a_user_message_is_refused_by_name():
    error = refusal(parse_chat_request, {"messages": [
        {"role": "user", "content": "hi"},
        {"role": "system", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}]})
    assert error.param == "messages[1].content" and "user messages only" in error.message


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

    def apply_chat_template(self, messages, tokenize, add_generation_prompt, tools=None):
        assert tokenize is False and add_generation_prompt is True and tools is None
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


# ---- the rest of the OpenAI / vLLM surface --------------------------------------------------------

# A value other than the neutral one for every field jaxserve knows but does not implement.
NOT_NEUTRAL = {
    "use_beam_search": True, "length_penalty": 0.5, "spaces_between_special_tokens": False,
    "truncate_prompt_tokens": 5, "allowed_token_ids": [1], "bad_words": ["x"], "priority": 1,
    "logits_processors": ["x"], "return_tokens_as_token_ids": True,
    "prompt_embeds": "AAAA", "cache_salt": "salt", "kv_transfer_params": {}, "vllm_xargs": {"a": 1},
    "mm_processor_kwargs": {"a": 1}, "request_id": "mine", "service_tier": "flex", "function_call": "auto",
    "audio": {"voice": "alloy"}, "modalities": ["text", "audio"], "prediction": {"type": "content"},
    "reasoning_effort": "low", "web_search_options": {}, "verbosity": "low", "store": True,
    "continue_final_message": True, "documents": [{"text": "x"}], "chat_template": "{{ 1 }}",
}
NEUTRAL = {"use_beam_search": False, "length_penalty": 1.0, "spaces_between_special_tokens": True, "bad_words": [],
           "priority": 0, "logits_processors": [], "return_token_ids": False, "service_tier": "auto",
           "modalities": ["text"], "store": False, "function_call": "none", "continue_final_message": False,
           "request_id": None, "user": "u-1", "metadata": {"a": "b"},
           "prompt_cache_key": "k", "safety_identifier": "s"}


def test_every_unsupported_field_is_listed_with_a_test_value():
    assert set(UNSUPPORTED_CHAT_FIELDS) == set(NOT_NEUTRAL)
    assert set(UNSUPPORTED_COMPLETION_FIELDS) < set(UNSUPPORTED_CHAT_FIELDS)


@pytest.mark.parametrize("name", sorted(NOT_NEUTRAL))
def test_an_unsupported_field_is_a_400_naming_it(name):
    for parse, base, table in ((parse_chat_request, {"messages": [{"role": "user", "content": "hi"}]},
                                UNSUPPORTED_CHAT_FIELDS),
                               (parse_completion_request, {"prompt": "hi"}, UNSUPPORTED_COMPLETION_FIELDS)):
        if name not in table:
            continue
        error = refusal(parse, {**base, name: NOT_NEUTRAL[name]})
        assert (error.status, error.param, error.code) == (400, name, "unsupported_field")
        assert f"'{name}' is not supported" in error.message


def test_neutral_values_of_unsupported_fields_and_hints_are_accepted():
    admit(parse_chat_request, {"messages": [{"role": "user", "content": "hi"}], **NEUTRAL})
    completion_neutral = {k: v for k, v in NEUTRAL.items() if k in UNSUPPORTED_COMPLETION_FIELDS or
                          k in ("user", "metadata", "prompt_cache_key", "safety_identifier")}
    admit(parse_completion_request, {"prompt": "hi", **completion_neutral})


def test_unknown_fields_are_ignored_with_one_warning(caplog):
    with caplog.at_level("WARNING", logger="serve.protocol"):
        request = completion(temperature=0.5, frobnicate=1, **{f"x{i}": i for i in range(7)})
    assert request.sampling["temperature"] == 0.5
    assert len(caplog.records) == 1
    assert "'frobnicate'" in caplog.text and "and 3 more" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="serve.protocol"):
        chat(temperature=0.5, top_logprobs=None, max_completion_tokens=3, add_generation_prompt=True)
    assert caplog.records == []  # every field it knows


def test_logit_bias_min_tokens_and_output_options_reach_the_sampling_params():
    _, _, params = admit(parse_completion_request, {"prompt": "hi", "logit_bias": {"5": 10, "7": -100.0},
                                                    "min_tokens": 3, "max_tokens": 8, "include_stop_str_in_output": True,
                                                    "skip_special_tokens": False})
    assert params.logit_bias == {5: 10, 7: -100.0}
    assert (params.min_tokens, params.include_stop_str_in_output, params.skip_special_tokens) == (3, True, False)
    _, _, plain = admit(parse_completion_request, {"prompt": "hi", "logit_bias": {}})
    assert (plain.logit_bias, plain.min_tokens, plain.include_stop_str_in_output, plain.skip_special_tokens) == (
        None, 0, False, True)


def test_add_special_tokens_and_add_generation_prompt():
    tokenizer = ListTokenizer()
    assert prompt_token_ids(tokenizer, completion(prompt="ab", add_special_tokens=False)) == [97, 98]
    assert prompt_token_ids(tokenizer, chat(add_special_tokens=True))[0] == 1  # BOS before the template's text
    assert not chat().add_special_tokens and chat().add_generation_prompt
    assert not chat(add_generation_prompt=False).add_generation_prompt


@pytest.mark.parametrize("parse, base", [(parse_completion_request, {"prompt": "hi"}),
                                         (parse_chat_request, {"messages": [{"role": "user", "content": "hi"}]})])
def test_server_defaults_fill_what_the_request_omits(parse, base):
    defaults = {"temperature": 0.2, "top_p": 0.9, "top_k": 40, "max_tokens": 12}
    _, _, params = admit(parse, base, defaults=defaults)
    assert (params.temperature, params.top_p, params.top_k, params.max_tokens) == (0.2, 0.9, 40, 12)
    _, _, given = admit(parse, {**base, "temperature": 0, "top_p": 1, "max_tokens": 30}, defaults=defaults)
    assert (given.temperature, given.top_p, given.top_k, given.max_tokens) == (0, 1, 40, 30)
    _, _, capped = admit(parse, base, defaults={"max_tokens": 1000})  # never past the context
    assert capped.max_tokens == (100 - len(prompt_token_ids(ListTokenizer(), parse(base, MODEL)))
                                 if parse is parse_chat_request else DEFAULT_COMPLETION_MAX_TOKENS)
    _, _, none = admit(parse, base)
    assert (none.temperature, none.top_p, none.top_k) == (1.0, 1.0, 0)


def test_best_of_picks_each_prompts_highest_cumulative_logprob():
    def candidate(*logprobs):
        state = ChoiceState()
        state.add(_output("t", [1] * len(logprobs), finished=True, total=len(logprobs),
                          logprobs=[TokenLogprob(1, lp, []) for lp in logprobs]))
        return state

    prompt0 = [candidate(-1.0, -1.0), candidate(-0.5), candidate(-0.1, -0.1), candidate(-3.0)]
    prompt1 = [candidate(-2.0), candidate(-0.2), candidate(-0.3), candidate(-0.2, -0.01)]
    chosen = select_best(prompt0 + prompt1, best_of=4, n=2)
    assert chosen == [prompt0[2], prompt0[1], prompt1[1], prompt1[3]]
    assert select_best(prompt0, best_of=4, n=1) == [prompt0[2]]
    assert completion(best_of=4, n=2).best_of == 4 and completion(n=3).best_of == 3


def test_usage_of_a_batch_counts_each_prompt_once_and_every_choice():
    choices = []
    for prompt_tokens, outputs in ((3, (2, 5)), (7, (1, 4))):  # two prompts, n = 2
        for total in outputs:
            state = ChoiceState()
            state.add(RequestOutput("r", [1], "x", True, "length", num_prompt_tokens=prompt_tokens,
                                    num_output_tokens=total, num_cached_tokens=1))
            choices.append(state)
    assert total_usage(choices, 2) == {"prompt_tokens": 10, "completion_tokens": 12, "total_tokens": 22,
                                       "prompt_tokens_details": {"cached_tokens": 2}}
    shaped = ResponseShaper(is_chat=False, model=MODEL, token_text=chr, want_logprobs=False).full_response(
        choices, total_usage(choices, 2))
    assert [c["index"] for c in shaped["choices"]] == [0, 1, 2, 3] and shaped["usage"]["prompt_tokens"] == 10


def test_completion_top_logprobs_hold_the_sampled_token_too():
    entries = [TokenLogprob(99, -2.0, [(97, -0.5), (98, -1.0)]), TokenLogprob(97, -0.5, [(97, -0.5)])]
    shaped = completion_logprobs(entries, chr, text_offset=0)
    assert shaped["top_logprobs"] == [{"c": -2.0, "a": -0.5, "b": -1.0}, {"a": -0.5}]  # up to k + 1 entries
    assert shaped["tokens"] == ["c", "a"] and shaped["token_logprobs"] == [-2.0, -0.5]
    zero = completion_logprobs([TokenLogprob(99, -2.0, [])], chr, 0)  # logprobs=0: the sampled token alone
    assert zero["top_logprobs"] == [{"c": -2.0}]


@pytest.mark.parametrize("is_chat", [False, True])
def test_choices_name_their_stop_reason(is_chat):
    shaper = ResponseShaper(is_chat=is_chat, model=MODEL, token_text=chr, want_logprobs=False)
    stopped = ChoiceState()
    stopped.add(RequestOutput("r", [1], "x", True, "stop", 3, 1, stop_reason="END"))
    by_token = ChoiceState()
    by_token.add(RequestOutput("r", [9], "", True, "stop", 3, 1, stop_reason=9))
    eos = ChoiceState()
    eos.add(RequestOutput("r", [2], "", True, "stop", 3, 1))
    response = shaper.full_response([stopped, by_token, eos])
    assert [c["stop_reason"] for c in response["choices"]] == ["END", 9, None]
    running = shaper.delta_chunk(0, RequestOutput("r", [1], "x", False, None, 3, 1, stop_reason="ignored"))
    assert running["choices"][0]["stop_reason"] is None
    last = shaper.delta_chunk(0, RequestOutput("r", [1], "x", True, "stop", 3, 2, stop_reason="END"))
    assert last["choices"][0]["stop_reason"] == "END" and last["choices"][0]["finish_reason"] == "stop"


def test_tokenize_and_detokenize_bodies():
    request, strs = parse_tokenize_request({"model": MODEL, "prompt": "ab"}, MODEL)
    assert (request.prompts, request.add_special_tokens, strs) == (["ab"], True, False)
    assert prompt_token_ids(ListTokenizer(), request) == [1, 97, 98]
    request, strs = parse_tokenize_request({"messages": [{"role": "user", "content": "hi"}],
                                            "return_token_strs": True}, MODEL)
    assert request.is_chat and not request.add_special_tokens and request.add_generation_prompt and strs
    assert parse_detokenize_request({"tokens": [1, 2]}, MODEL, 10) == [1, 2]
    assert parse_detokenize_request({"model": MODEL, "tokens": []}, MODEL, 10) == []


@pytest.mark.parametrize("body, param", [
    ({}, "prompt"),
    ({"prompt": "a", "messages": [{"role": "user", "content": "hi"}]}, "prompt"),
    ({"prompt": [1, 2]}, "prompt"),
    ({"messages": []}, "messages"),
    ({"prompt": "a", "add_special_tokens": 1}, "add_special_tokens"),
    ({"prompt": "a", "chat_template": "x"}, "chat_template"),
    ({"prompt": "a", "model": "other"}, "model"),
])
def test_bad_tokenize_bodies(body, param):
    with pytest.raises(ProtocolError) as info:
        parse_tokenize_request(body, MODEL)
    assert info.value.param == param


@pytest.mark.parametrize("body", [{}, {"tokens": "1"}, {"tokens": [1, 10]}, {"tokens": [-1]}, {"tokens": [True]}])
def test_bad_detokenize_bodies(body):
    with pytest.raises(ProtocolError) as info:
        parse_detokenize_request(body, MODEL, 10)
    assert info.value.param == "tokens" and info.value.status == 400
