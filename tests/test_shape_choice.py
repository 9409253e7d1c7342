"""shape_choice: which compiled shape serves a step whose own is still compiling (host side, no
device): the cheapest compiled bucket that holds it, a mixed step as its two halves, the halves'
outputs merged in the step's row order, the prompt-logprob rows' shape."""
import numpy as np

from jaxserve.core.step import Bucket, ScheduledBatch, ScheduledRow, StepOutput
from jaxserve.executor import shape_choice


class FakeCache:
    """ExecutableCache's readiness: `ready` compiled, `promised` what a warm-up will compile."""

    def __init__(self, ready=(), promised=()):
        self._ready, self._promised = set(ready), set(promised) | set(ready)

    def ready(self, kind, key):
        return (kind, key) in self._ready

    def will_compile(self, kind, key):
        return (kind, key) in self._promised


BUCKETS = [Bucket(d, p, n) for d in (0, 8, 16) for p in (0, 32, 64) for n in (4, 16) if d or p]


def sampler_key(bucket):
    return ("rows", bucket.num_decode + 2 * bool(bucket.num_prefill_tokens))


def cache_with(ready_buckets):
    ready = [("forward", b) for b in ready_buckets] + [("sample", sampler_key(b)) for b in ready_buckets]
    promised = [("forward", b) for b in BUCKETS] + [("sample", sampler_key(b)) for b in BUCKETS]
    return FakeCache(ready, promised)


def test_a_step_runs_in_its_own_bucket_once_compiled_or_when_no_warmup_will_compile_it():
    needed = Bucket(8, 32, 4)
    assert shape_choice.compiled_bucket_holding(needed, BUCKETS, cache_with(BUCKETS), sampler_key) == needed
    assert shape_choice.compiled_bucket_holding(needed, BUCKETS, FakeCache(), sampler_key) == needed


def test_else_the_cheapest_compiled_bucket_that_holds_it():
    needed = Bucket(8, 32, 4)
    ready = [Bucket(16, 64, 16), Bucket(8, 64, 16), Bucket(16, 32, 4), Bucket(0, 64, 4), Bucket(8, 0, 4)]
    chosen = shape_choice.compiled_bucket_holding(needed, BUCKETS, cache_with(ready), sampler_key)
    assert chosen == Bucket(16, 32, 4)  # 48 tokens, against 72 and 80; the others cannot hold 8 + 32
    # A holder whose sampler is not compiled does not count.
    forward_only = FakeCache([("forward", Bucket(16, 32, 4))], [("forward", needed)])
    assert shape_choice.compiled_bucket_holding(needed, BUCKETS, forward_only, sampler_key) == needed
    # None holds it: the step waits for its own.
    assert shape_choice.compiled_bucket_holding(needed, BUCKETS, cache_with([Bucket(8, 0, 16)]), sampler_key) == needed


def row(request_id, tokens, start=0):
    return ScheduledRow(request_id, tuple(tokens), start, (1, 2), None)


def test_a_mixed_step_splits_only_when_it_cannot_run_and_both_halves_can():
    batch = ScheduledBatch(decode=(row("a", [5], 9), row("b", [6], 3)), prefill=(row("c", [1, 2, 3]),))

    def bucket_of(step):  # a stand-in for the runner's: decode rows, prefill tokens
        return Bucket(len(step.decode), step.num_prefill_tokens, 4)

    def split(runs_now, step=batch):
        return shape_choice.split(step, bucket_of(step), bucket_of, lambda step, bucket: runs_now(step))

    halves = split(lambda b: not (b.decode and b.prefill))
    assert halves == [(ScheduledBatch(decode=batch.decode), Bucket(2, 0, 4)),
                      (ScheduledBatch(prefill=batch.prefill), Bucket(0, 3, 4))]
    assert split(lambda b: True) is None  # its own shape is ready
    assert split(lambda b: bool(b.decode) and not b.prefill) is None  # the prefill half is not
    assert split(lambda b: False, ScheduledBatch(decode=batch.decode)) is None  # nothing to split


def output(token_ids, bucket, logprobs=None, prompt=None, seconds=1.0):
    top = None if logprobs is None else np.tile(np.asarray(logprobs, np.float32)[:, None], (1, 3))
    return StepOutput(token_ids=np.asarray(token_ids, np.int32), logprobs=None if logprobs is None else
                      np.asarray(logprobs, np.float32), top_ids=None if top is None else top.astype(np.int32),
                      top_logprobs=top, bucket=bucket, device_seconds=seconds, host_seconds=seconds / 10,
                      prompt_logprobs=prompt)


def test_the_halves_outputs_merge_in_the_steps_row_order():
    decode = output([7, 8], Bucket(2, 0, 4), logprobs=[-0.5, -1.5])
    prompt = {"logprobs": np.zeros(2, np.float32)}
    prefill = output([9], Bucket(0, 32, 16), prompt=[prompt], seconds=2.0)
    merged = shape_choice.merge_outputs([decode, prefill])
    assert merged.token_ids.tolist() == [7, 8, 9]
    assert merged.logprobs.tolist() == [-0.5, -1.5, 0.0]  # a row that asked for none: zeros
    assert merged.top_ids.shape == (3, 3) and merged.top_logprobs[:2, 0].tolist() == [-0.5, -1.5]
    assert merged.prompt_logprobs == [None, None, prompt]
    assert merged.bucket == Bucket(2, 32, 16)
    assert (merged.device_seconds, merged.host_seconds) == (3.0, 0.30000000000000004)
    plain = shape_choice.merge_outputs([output([1], Bucket(1, 0, 4)), output([2], Bucket(0, 32, 4))])
    assert plain.logprobs is None and plain.top_ids is None and plain.prompt_logprobs is None


def test_prompt_logprob_rows_take_the_smallest_compiled_shape_that_holds_them():
    sizes = (8, 16, 32)
    none_ready = FakeCache()
    assert shape_choice.prompt_logprob_rows(sizes, 5, none_ready) == 8  # the one it needs (waited for)
    assert shape_choice.prompt_logprob_rows(sizes, 33, none_ready) is None
    larger = FakeCache([("prompt_logprobs", 32)])
    assert shape_choice.prompt_logprob_rows(sizes, 5, larger) == 32
    assert shape_choice.prompt_logprob_rows(sizes, 5, FakeCache([("prompt_logprobs", 16), ("prompt_logprobs", 8)])) == 8
