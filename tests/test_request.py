import pytest

from jaxserve.core.request import (MAX_LOGPROBS, InvalidRequestError, Request, RequestLimits, RequestStatus,
                              SamplingParams, check_request, check_sampling_defaults)

LIMITS = RequestLimits(vocab_size=100, max_seq_len=50, max_model_len=50)


def test_defaults_are_valid():
    check_request([1], SamplingParams(), LIMITS)
    check_request([1, 99], SamplingParams(temperature=0.0, top_k=-1, seed=0, stop="###", logprobs=MAX_LOGPROBS,
                                          stop_token_ids=[99], max_tokens=48), LIMITS)
    check_request([1], SamplingParams(top_k=2**31 - 1, repetition_penalty=100.0), LIMITS)


def test_stop_string_becomes_list():
    assert SamplingParams(stop="END").stop == ["END"]


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_tokens=0), "max_tokens must be >= 1, got 0"),
    (dict(max_tokens=2.5), "max_tokens must be an integer"),
    (dict(max_tokens=True), "max_tokens must be an integer"),
    (dict(temperature=-0.1), "temperature must be in [0, 2], got -0.1"),
    (dict(temperature=2.5), "temperature must be in [0, 2], got 2.5"),
    (dict(temperature="hot"), "temperature must be a finite number"),
    (dict(temperature=float("nan")), "temperature must be a finite number"),
    (dict(top_p=0.0), "top_p must be in (0, 1], got 0"),
    (dict(top_p=1.5), "top_p must be in (0, 1]"),
    (dict(top_k=-2), "top_k must be in [-1, 2147483647] (0 or -1 disables top-k; 100 or more keeps every "
                     "token), got -2"),
    (dict(top_k=2**31), "top_k must be in [-1, 2147483647]"),
    (dict(top_k=3.0), "top_k must be an integer"),
    (dict(min_p=1.1), "min_p must be in [0, 1], got 1.1"),
    (dict(min_p=-0.1), "min_p must be in [0, 1]"),
    (dict(repetition_penalty=0.0), "repetition_penalty must be in [0.01, 100], got 0"),
    (dict(repetition_penalty=1e-300), "repetition_penalty must be in [0.01, 100]"),
    (dict(repetition_penalty=1e308), "repetition_penalty must be in [0.01, 100]"),
    (dict(presence_penalty=2.5), "presence_penalty must be in [-2, 2], got 2.5"),
    (dict(frequency_penalty=-3), "frequency_penalty must be in [-2, 2], got -3"),
    (dict(seed=-1), "seed must be in [0, 9223372036854775807], got -1"),
    (dict(seed=2**63), "seed must be in [0, 9223372036854775807]"),
    (dict(seed="7"), "seed must be an integer"),
    (dict(stop=[1, 2]), "stop must be a string or a list of strings"),
    (dict(stop=[""]), "stop strings must have 1 to 1024 characters, got 0"),
    (dict(stop=["x"] * 17), "stop allows at most 16 strings, got 17"),
    (dict(stop=["\ud800"]), "stop strings must be valid Unicode"),
    (dict(stop_token_ids=[-1]), "stop_token_ids must be a list of token ids in [0, 100)"),
    (dict(stop_token_ids=[100]), "stop_token_ids must be a list of token ids in [0, 100)"),
    (dict(stop_token_ids=5), "stop_token_ids must be a list of token ids"),
    (dict(stop_token_ids=[1] * 257), "stop_token_ids allows at most 256 ids, got 257"),
    (dict(ignore_eos=1), "ignore_eos must be a boolean"),
    (dict(logprobs=21), "logprobs must be in [0, 20], got 21"),
    (dict(logprobs=-1), "logprobs must be in [0, 20], got -1"),
    (dict(logit_bias=[1]), "logit_bias must map token ids to biases"),
    (dict(logit_bias={100: 1.0}), "logit_bias token id 100 is not a token id in [0, 100)"),
    (dict(logit_bias={-1: 1.0}), "logit_bias token id -1 is not"),
    (dict(logit_bias={"5": 1.0}), "logit_bias token id '5' is not"),
    (dict(logit_bias={5: 100.01}), "logit_bias of token 5 must be a number in [-100, 100], got 100.01"),
    (dict(logit_bias={5: float("nan")}), "logit_bias of token 5 must be a number in [-100, 100]"),
    (dict(logit_bias={5: True}), "logit_bias of token 5 must be a number"),
    (dict(logit_bias={i: 1.0 for i in range(301)}), "logit_bias allows at most 300 tokens, got 301"),
    (dict(min_tokens=-1), "min_tokens must be in [0, 16] (at most max_tokens), got -1"),
    (dict(min_tokens=17), "min_tokens must be in [0, 16] (at most max_tokens), got 17"),
    (dict(min_tokens=1.0), "min_tokens must be an integer"),
    (dict(include_stop_str_in_output=1), "include_stop_str_in_output must be a boolean"),
    (dict(skip_special_tokens=None), "skip_special_tokens must be a boolean"),
])
def test_sampling_refusals_name_the_field(kwargs, message):
    with pytest.raises(InvalidRequestError) as info:
        check_request([1, 2], SamplingParams(**kwargs), LIMITS)
    assert message in str(info.value)
    assert info.value.param == next(iter(kwargs))


@pytest.mark.parametrize("prompt, message", [
    ([], "the prompt is empty"),
    ("12", "must be a list of token ids"),
    ([1, 100], "prompt token id 100 is not an integer in [0, 100)"),
    ([1, -1], "prompt token id -1 is not"),
    ([1, 2.0], "prompt token id 2.0 is not"),
    ([1] * 50, "maximum context length is 50 tokens; the prompt has 50 tokens, leaving no room"),
])
def test_prompt_refusals(prompt, message):
    with pytest.raises(InvalidRequestError) as info:
        check_request(prompt, SamplingParams(max_tokens=1), LIMITS)
    assert message in str(info.value) and info.value.param == "prompt"


def test_max_tokens_must_fit_the_context_left_by_the_prompt():
    check_request([1] * 10, SamplingParams(max_tokens=40), LIMITS)
    with pytest.raises(InvalidRequestError, match="you requested 51 tokens") as info:
        check_request([1] * 10, SamplingParams(max_tokens=41), LIMITS)
    assert (info.value.param, info.value.code) == ("max_tokens", "context_length_exceeded")
    pool_bound = RequestLimits(vocab_size=100, max_seq_len=50, max_model_len=2048)
    with pytest.raises(InvalidRequestError, match=r"is 50 tokens \(the KV cache holds 50 tokens; max_model_len "
                                                  r"is 2048\)"):
        check_request([1] * 10, SamplingParams(max_tokens=1500), pool_bound)


def test_logit_bias_and_min_tokens_within_bounds_pass():
    check_request([1], SamplingParams(logit_bias={0: -100, 99: 100.0, 5: 0.5}, min_tokens=16), LIMITS)
    check_request([1], SamplingParams(logit_bias={i: 1.0 for i in range(100)}, min_tokens=0), LIMITS)


def test_sampling_defaults_are_checked_like_a_request():
    assert check_sampling_defaults({"temperature": 0.2, "top_p": 0.9, "max_tokens": 64}) == {
        "temperature": 0.2, "top_p": 0.9, "max_tokens": 64}
    assert check_sampling_defaults({}) == {}
    with pytest.raises(InvalidRequestError, match="'seed' cannot be a sampling default") as info:
        check_sampling_defaults({"seed": 1})
    assert info.value.param == "seed"
    with pytest.raises(InvalidRequestError, match="temperature must be in") as info:
        check_sampling_defaults({"temperature": 7})
    assert info.value.param == "temperature"
    with pytest.raises(InvalidRequestError, match="JSON object"):
        check_sampling_defaults([("temperature", 1)])


def test_logprobs_bound_is_the_engines():
    limits = RequestLimits(vocab_size=100, max_seq_len=50, max_model_len=50, max_logprobs=5)
    check_request([1], SamplingParams(logprobs=5), limits)
    with pytest.raises(InvalidRequestError, match=r"logprobs must be in \[0, 5\], got 6"):
        check_request([1], SamplingParams(logprobs=6), limits)


def test_status_finish_reasons():
    assert not RequestStatus.WAITING.is_finished and RequestStatus.RUNNING.finish_reason is None
    assert not RequestStatus.PREEMPTED.is_finished
    reasons = {RequestStatus.FINISHED_STOPPED: "stop", RequestStatus.FINISHED_LENGTH: "length",
               RequestStatus.FINISHED_ABORTED: "abort", RequestStatus.FINISHED_ERROR: "error"}
    for status, reason in reasons.items():
        assert status.is_finished and status.finish_reason == reason


def test_request_token_views():
    request = Request("r", [1, 2, 3], SamplingParams(seed=42))
    request.output_token_ids += [7, 8]
    assert request.all_token_ids == [1, 2, 3, 7, 8]
    assert (request.num_tokens, request.num_prompt_tokens, request.num_output_tokens) == (5, 3, 2)
    assert [request.token_id_at(i) for i in range(5)] == request.all_token_ids
    assert request.seed == 42 and request.status == RequestStatus.WAITING and request.num_computed_tokens == 0


def test_random_seed_drawn_per_request():
    seeds = {Request(str(i), [1]).seed for i in range(8)}
    assert len(seeds) == 8 and all(0 <= s < 2**63 for s in seeds)
    assert Request("zero", [1], SamplingParams(seed=0)).seed == 0
