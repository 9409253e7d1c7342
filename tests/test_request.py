import pytest

from jaxserve.request import MAX_LOGPROBS, Request, RequestStatus, SamplingParams


def test_defaults_are_valid():
    SamplingParams().validate()
    SamplingParams(temperature=0.0, top_k=-1, seed=0, stop="###", logprobs=MAX_LOGPROBS).validate()


def test_stop_string_becomes_list():
    assert SamplingParams(stop="END").stop == ["END"]


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_tokens=0), "max_tokens must be >= 1, got 0"),
    (dict(max_tokens=2.5), "max_tokens must be an integer"),
    (dict(max_tokens=True), "max_tokens must be an integer"),
    (dict(temperature=-0.1), "temperature must be >= 0, got -0.1"),
    (dict(temperature="hot"), "temperature must be a finite number"),
    (dict(temperature=float("nan")), "temperature must be a finite number"),
    (dict(top_p=0.0), "top_p must be in (0, 1], got 0.0"),
    (dict(top_p=1.5), "top_p must be in (0, 1]"),
    (dict(top_k=-2), "top_k must be >= -1 (0 or -1 disables top-k), got -2"),
    (dict(top_k=3.0), "top_k must be an integer"),
    (dict(min_p=1.1), "min_p must be in [0, 1], got 1.1"),
    (dict(min_p=-0.1), "min_p must be in [0, 1]"),
    (dict(repetition_penalty=0.0), "repetition_penalty must be > 0, got 0.0"),
    (dict(presence_penalty=2.5), "presence_penalty must be in [-2, 2], got 2.5"),
    (dict(frequency_penalty=-3), "frequency_penalty must be in [-2, 2], got -3"),
    (dict(seed=-1), "seed must be in [0, 9223372036854775807], got -1"),
    (dict(seed="7"), "seed must be an integer"),
    (dict(stop=[1, 2]), "stop must be a string or a list of strings"),
    (dict(stop=[""]), "stop strings must not be empty"),
    (dict(stop_token_ids=[-1]), "stop_token_ids must be a list of non-negative integers"),
    (dict(stop_token_ids=5), "stop_token_ids must be a list of non-negative integers"),
    (dict(ignore_eos=1), "ignore_eos must be a boolean"),
    (dict(logprobs=21), "logprobs must be in [0, 20], got 21"),
    (dict(logprobs=-1), "logprobs must be in [0, 20], got -1"),
])
def test_validate_messages(kwargs, message):
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs).validate()
    assert message in str(info.value)


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


def test_host_modules_do_not_import_jax():
    import subprocess
    import sys
    code = ("import sys, jaxserve.request, jaxserve.page_allocator, jaxserve.scheduler, jaxserve.detokenizer; "
            "assert 'jax' not in sys.modules, 'jax imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
