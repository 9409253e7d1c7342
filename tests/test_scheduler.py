import dataclasses
import random

import pytest

from jaxserve.config import EngineConfig
from jaxserve.core.page_allocator import NULL_PAGE, PageAllocator
from jaxserve.core.request import Request, RequestStatus, SamplingParams
from jaxserve.core.scheduler import Scheduler, StepPlan
from jaxserve.core.step import MAX_PROMPT_LOGPROB_ROWS, RowParams, ScheduledBatch, ScheduledRow


def next_token(context):
    """A fake deterministic model: the next token depends on every token of the context."""
    return sum((i + 1) * t for i, t in enumerate(context)) * 2654435761 % 997 + 3


def reference_output(prompt, max_tokens):
    context = list(prompt)
    for _ in range(max_tokens):
        context.append(next_token(context))
    return context[len(prompt):]


class FakeDevice:
    """Writes each computed token into its KV slot and samples from what it reads back through
    the page table, so wrong page bookkeeping or a stale shared page changes the output. Like the
    runner, it sees only the plan's plain data (`StepPlan.to_batch()`), never a Request."""

    def __init__(self, allocator):
        self.allocator = allocator
        self.page_size = allocator.page_size
        self.slots = [None] * (allocator.num_pages * allocator.page_size)
        self.num_computed_tokens = 0

    def slot(self, row, position):
        return row.page_ids[position // self.page_size] * self.page_size + position % self.page_size

    def run(self, plan):
        sampled = []
        for row in plan.to_batch().rows:
            assert NULL_PAGE not in row.page_ids
            assert len(row.page_ids) >= self.allocator.num_pages_for_tokens(row.end)
            for position, token_id in zip(range(row.start, row.end), row.token_ids):
                page = row.page_ids[position // self.page_size]
                assert self.allocator.refcount(page) == 1, "a step writes into a shared page"
                self.slots[self.slot(row, position)] = token_id
            sampled.append(next_token([self.slots[self.slot(row, p)] for p in range(row.end)]))
            self.num_computed_tokens += len(row.token_ids)
        return sampled


def check_plan(scheduler, plan, decoding_before):
    assert plan.num_tokens <= scheduler.max_num_batched_tokens
    assert plan.num_seqs <= scheduler.max_num_seqs and len(plan.prefill) <= scheduler.max_num_prefill_seqs
    scheduled = plan.decode + [r for r, _ in plan.prefill]
    assert len({r.request_id for r in scheduled}) == len(scheduled)
    assert all(r.status == RequestStatus.RUNNING for r in scheduled)
    assert all(r.num_tokens - r.num_computed_tokens == 1 for r in plan.decode)
    assert all(0 < n <= r.num_tokens - r.num_computed_tokens for r, n in plan.prefill)
    for request in decoding_before:  # decode comes first: only preemption can skip it
        assert request in plan.decode or request in plan.preempted
    for request in plan.preempted:
        assert request.status == RequestStatus.PREEMPTED and request.page_ids == []
    allocator = scheduler.allocator
    held = [p for r in scheduler.running for p in r.page_ids]
    assert sum(allocator.refcount(p) for p in range(allocator.num_pages)) == len(held)
    assert allocator.num_used_pages == len(set(held))


def run_engine_loop(scheduler, device, requests, add_at=None, max_steps=5000):
    """Drives schedule/run/update like the engine; `add_at` maps step -> requests to add then."""
    add_at = dict(add_at or {})
    for request in requests:
        scheduler.add_request(request)
    step = 0
    while scheduler.has_unfinished() or add_at:
        for request in add_at.pop(step, []):
            scheduler.add_request(request)
        decoding_before = [r for r in scheduler.running if r.num_tokens - r.num_computed_tokens == 1]
        plan = scheduler.schedule()
        check_plan(scheduler, plan, decoding_before)
        assert not plan.is_empty or not scheduler.has_unfinished()
        scheduler.update(plan, device.run(plan))
        step += 1
        assert step < max_steps, "no progress"
    return step


def make_scheduler(num_pages, page_size=4, prefix=True, max_num_seqs=4, budget=16, max_prefill=4, max_len=512,
                   cut_sizes=(), min_saved=1):
    allocator = PageAllocator(num_pages, page_size, enable_prefix_caching=prefix)
    config = EngineConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_num_prefill_seqs=max_prefill)
    return Scheduler(allocator, config, max_model_len=max_len, prefill_cut_sizes=cut_sizes,
                     prefill_cut_min_saved=min_saved)


def greedy(max_tokens):
    return SamplingParams(max_tokens=max_tokens, temperature=0.0)


@pytest.mark.parametrize("prefix", [False, True])
def test_random_load_finishes_with_batch_independent_output(prefix):
    rng = random.Random(0)
    scheduler = make_scheduler(num_pages=13, page_size=4, prefix=prefix, max_num_seqs=5, budget=12, max_prefill=2)
    shared = [rng.randrange(3, 1000) for _ in range(8)]
    requests = []
    for i in range(24):
        prompt = (shared if i % 2 else []) + [rng.randrange(3, 1000) for _ in range(rng.randint(1, 14))]
        requests.append(Request(f"r{i}", prompt, greedy(rng.randint(1, 20))))
    late = {3: requests[16:20], 11: requests[20:]}
    run_engine_loop(scheduler, FakeDevice(scheduler.allocator), requests[:16], add_at=late)
    for request in requests:
        assert request.status == RequestStatus.FINISHED_LENGTH
        assert request.output_token_ids == reference_output(request.prompt_token_ids, request.params.max_tokens)
    assert scheduler.num_preemptions > 0  # the pool is too small for 5 long sequences
    assert scheduler.allocator.num_used_pages == 0 and scheduler.allocator.num_free_pages == 12
    assert scheduler.num_running == scheduler.num_waiting == 0
    assert (scheduler.allocator.num_prefix_hit_tokens > 0) == prefix


@pytest.mark.parametrize("prefix", [False, True])
def test_random_load_with_prefill_cut_to_buckets_keeps_pages_and_outputs(prefix):
    seed = 1
    rng = random.Random(seed)
    scheduler = make_scheduler(num_pages=17, page_size=4, prefix=prefix, max_num_seqs=5, budget=16, max_prefill=3,
                               cut_sizes=(2, 4, 8, 16))
    shared = [rng.randrange(3, 1000) for _ in range(8)]
    requests = [Request(f"r{i}", (shared if i % 2 else []) + [rng.randrange(3, 1000) for _ in range(rng.randint(1, 30))],
                        greedy(rng.randint(1, 12))) for i in range(24)]
    cut = []
    real_fit = scheduler.fit_prefill_to_bucket

    def fit_and_count(plan):
        before = sum(n for _, n in plan.prefill)
        real_fit(plan)
        cut.append(before - sum(n for _, n in plan.prefill))
    scheduler.fit_prefill_to_bucket = fit_and_count
    run_engine_loop(scheduler, FakeDevice(scheduler.allocator), requests[:16], add_at={5: requests[16:]})
    for request in requests:  # check_plan checked every step's pages
        assert request.output_token_ids == reference_output(request.prompt_token_ids, request.params.max_tokens), \
            f"seed {seed}"
    assert sum(1 for n in cut if n) >= 3, f"seed {seed}"
    assert scheduler.allocator.num_used_pages == 0, f"seed {seed}"


def test_prefill_tokens_are_cut_to_the_smaller_bucket_when_their_own_would_be_mostly_padding():
    scheduler = make_scheduler(num_pages=20, page_size=4, budget=16, cut_sizes=(4, 8, 16), min_saved=4)
    scheduler.add_request(Request("a", list(range(3, 13)), greedy(2)))  # 10 tokens: 8 + 4 saves 4 of 16
    plan = scheduler.schedule()
    assert [n for _, n in plan.prefill] == [8]
    request = plan.prefill[0][0]
    assert len(request.page_ids) == 2 and scheduler.allocator.num_used_pages == 2  # the third page given back
    device = FakeDevice(scheduler.allocator)
    scheduler.update(plan, device.run(plan))
    plan = scheduler.schedule()
    assert [n for _, n in plan.prefill] == [2] and len(request.page_ids) == 3  # 2 tokens: no smaller bucket
    scheduler.update(plan, device.run(plan))
    run_engine_loop(scheduler, device, [])
    assert request.output_token_ids == reference_output(request.prompt_token_ids, 2)


@pytest.mark.parametrize("prompts, min_saved, expected", [
    ([10], 4, [8]),  # 8 + 4 (in the 4-token bucket) saves 4 of 16
    ([10], 5, [10]),  # ... which is not enough here
    ([13], 1, [13]),  # 8 + 5 (in the 8-token bucket) saves nothing
    ([8, 2], 1, [8, 2]),  # the last chunk would keep no token
    ([6, 4], 1, [6, 2]),  # the last chunk is cut
    ([3], 1, [3]),  # no smaller bucket
])
def test_prefill_cut_only_where_it_saves_enough_padding(prompts, min_saved, expected):
    scheduler = make_scheduler(num_pages=20, page_size=4, budget=16, cut_sizes=(4, 8, 16), min_saved=min_saved)
    for i, length in enumerate(prompts):
        scheduler.add_request(Request(f"r{i}", list(range(3, 3 + length)), greedy(1)))
    assert [n for _, n in scheduler.schedule().prefill] == expected


def test_the_default_cut_saves_a_steps_worth_of_tokens():
    sizes = (32, 64, 128, 256, 512)  # the CPU's default prefill buckets
    cuts = {}
    for length in (44, 100, 150, 170, 300, 360, 400):
        scheduler = Scheduler(PageAllocator(200, 16), EngineConfig(), max_model_len=1024, prefill_cut_sizes=sizes)
        scheduler.add_request(Request("a", list(range(3, 3 + length)), greedy(1)))
        cuts[length] = scheduler.schedule().prefill[0][1]
    # 150 = 128 + 22: 128 + 32 tokens of buckets for 256; 300 = 256 + 44: 256 + 64 for 512; 170 and
    # 400 would save 64 and 0, 44 nothing (32 + 32 for 64), 100 has no room to save in its 128.
    assert cuts == {44: 44, 100: 100, 150: 128, 170: 170, 300: 256, 360: 256, 400: 400}


def test_prefill_is_not_cut_without_cut_sizes():
    scheduler = make_scheduler(num_pages=20, page_size=4, budget=16)
    scheduler.add_request(Request("a", list(range(3, 13)), greedy(1)))
    assert [n for _, n in scheduler.schedule().prefill] == [10]


def test_decode_first_then_prefill_with_remaining_budget():
    scheduler = make_scheduler(num_pages=40, budget=10, max_num_seqs=8)
    device = FakeDevice(scheduler.allocator)
    short = [Request(f"s{i}", [5 + i, 6, 7], greedy(10)) for i in range(3)]
    for request in short:
        scheduler.add_request(request)
    plan = scheduler.schedule()
    assert [n for _, n in plan.prefill] == [3, 3, 3] and plan.decode == []
    scheduler.update(plan, device.run(plan))
    long = Request("long", list(range(10, 40)), greedy(1))
    scheduler.add_request(long)
    plan = scheduler.schedule()
    assert plan.decode == short and plan.prefill == [(long, 7)] and plan.num_tokens == 10
    scheduler.update(plan, device.run(plan))
    plan = scheduler.schedule()  # the long prompt continues: running mid-prefill before new requests
    assert plan.decode == short and plan.prefill == [(long, 7)]


def test_a_pooling_engine_schedules_a_prompts_last_token_as_a_prefill_chunk():
    """--runner=pooling samples nothing: a prompt cut one token short of its end finishes in a
    prefill chunk (the pooling step pools chunks), never in a decode row; a generating engine
    decodes that token."""
    for runner, decoded in (("pooling", False), ("generate", True)):
        config = EngineConfig(max_num_seqs=4, max_num_batched_tokens=8, max_num_prefill_seqs=4, runner=runner)
        scheduler = Scheduler(PageAllocator(20, 4, enable_prefix_caching=False), config, max_model_len=64)
        device = FakeDevice(scheduler.allocator)
        request = Request("r", list(range(3, 12)), SamplingParams(max_tokens=0))  # 9 tokens: 8, then 1
        scheduler.add_request(request)
        plan = scheduler.schedule()
        assert plan.prefill == [(request, 8)] and plan.decode == []
        scheduler.update(plan, device.run(plan))
        plan = scheduler.schedule()
        assert (plan.decode == [request]) == decoded, runner
        assert (plan.prefill == [(request, 1)]) != decoded, runner


def test_chunked_prefill_only_last_chunk_samples():
    scheduler = make_scheduler(num_pages=20, budget=8)
    request = Request("r", list(range(3, 23)), greedy(3))
    scheduler.add_request(request)
    chunks = []
    for _ in range(3):
        plan = scheduler.schedule()
        chunks.append(plan.prefill[0][1])
        appended = scheduler.update(plan, [777])
        assert request.num_output_tokens == (1 if len(chunks) == 3 else 0)
        assert appended == ([request] if len(chunks) == 3 else [])
    assert chunks == [8, 8, 4] and request.output_token_ids == [777]
    assert request.num_computed_tokens == 20 and len(request.page_ids) == 5
    plan = scheduler.schedule()
    assert plan.decode == [request] and plan.prefill == []
    assert scheduler.update(plan, [778]) == [request] and len(request.page_ids) == 6


def test_max_num_seqs_and_max_num_prefill_seqs():
    scheduler = make_scheduler(num_pages=40, budget=32, max_num_seqs=3, max_prefill=2)
    requests = [Request(f"r{i}", [3, 4, 5], greedy(2)) for i in range(5)]
    for request in requests:
        scheduler.add_request(request)
    plan = scheduler.schedule()
    assert [r for r, _ in plan.prefill] == requests[:2]
    scheduler.update(plan, [9, 9])
    plan = scheduler.schedule()
    assert plan.decode == requests[:2] and [r for r, _ in plan.prefill] == requests[2:3]
    assert scheduler.num_running == 3 and scheduler.num_waiting == 2


def test_preempts_most_recent_and_recomputes_it():
    scheduler = make_scheduler(num_pages=5, page_size=2, budget=8, max_num_seqs=2)  # 4 usable pages
    device = FakeDevice(scheduler.allocator)
    old, new = Request("old", [3, 4, 5], greedy(4)), Request("new", [6, 7, 8], greedy(4))
    queued = Request("queued", [9], greedy(2))
    for request in (old, new, queued):
        scheduler.add_request(request)
    for _ in range(2):  # prefill both (2 pages each), then decode to 4 tokens each
        plan = scheduler.schedule()
        scheduler.update(plan, device.run(plan))
    assert scheduler.allocator.num_free_pages == 0 and old.num_tokens == new.num_tokens == 5
    first_scheduled = new.first_scheduled_time
    assert first_scheduled is not None and queued.first_scheduled_time is None
    plan = scheduler.schedule()  # both need a third page
    assert plan.preempted == [new] and plan.decode == [old] and plan.prefill == []
    assert new.status == RequestStatus.PREEMPTED and new.num_computed_tokens == 0 and new.page_ids == []
    assert new.output_token_ids == reference_output(new.prompt_token_ids, 2)  # output is kept
    assert list(scheduler.waiting) == [new, queued] and scheduler.num_preemptions == 1
    scheduler.update(plan, device.run(plan))
    run_engine_loop(scheduler, device, [])
    for request in (old, new, queued):
        assert request.output_token_ids == reference_output(request.prompt_token_ids, request.params.max_tokens)
    assert scheduler.allocator.num_used_pages == 0
    assert new.first_scheduled_time == first_scheduled  # the first scheduling, not the one after preemption
    assert queued.first_scheduled_time > first_scheduled


def test_shared_system_prompt_is_computed_once():
    scheduler = make_scheduler(num_pages=64, page_size=4, budget=64, max_num_seqs=8)
    device = FakeDevice(scheduler.allocator)
    system = list(range(100, 132))  # 8 full pages
    first = Request("first", system + [1, 2], greedy(3))
    others = [Request(f"o{i}", system + [10 + i] * (i + 1), greedy(3)) for i in range(4)]
    run_engine_loop(scheduler, device, [first], add_at={1: others})
    assert first.num_cached_tokens == 0 and all(r.num_cached_tokens == len(system) for r in others)
    assert scheduler.allocator.num_prefix_hit_tokens == 4 * len(system)
    num_prompt_tokens = sum(r.num_prompt_tokens for r in [first] + others)
    num_decode_tokens = sum(r.num_output_tokens - 1 for r in [first] + others)
    assert device.num_computed_tokens == num_prompt_tokens - 4 * len(system) + num_decode_tokens
    for request in [first] + others:
        assert request.output_token_ids == reference_output(request.prompt_token_ids, 3)


def test_fully_cached_prompt_still_computes_its_last_token():
    scheduler = make_scheduler(num_pages=16, page_size=4)
    device = FakeDevice(scheduler.allocator)
    prompt = list(range(50, 58))  # exactly two pages
    run_engine_loop(scheduler, device, [Request("a", prompt, greedy(2))])
    again = Request("b", prompt, greedy(2))
    scheduler.add_request(again)
    plan = scheduler.schedule()
    assert again.num_cached_tokens == 4 and plan.prefill == [(again, 4)]  # the last page is recomputed
    scheduler.update(plan, device.run(plan))
    run_engine_loop(scheduler, device, [])
    assert again.output_token_ids == reference_output(prompt, 2)


def test_abort_frees_pages_at_once():
    scheduler = make_scheduler(num_pages=20, budget=8, max_num_seqs=1)
    running, waiting = Request("run", list(range(3, 13)), greedy(5)), Request("wait", [3, 4], greedy(5))
    scheduler.add_request(running)
    scheduler.add_request(waiting)
    plan = scheduler.schedule()
    assert plan.prefill == [(running, 8)] and scheduler.allocator.num_used_pages == 2
    assert scheduler.abort("run") is running  # while its step is in flight
    assert running.status == RequestStatus.FINISHED_ABORTED and scheduler.allocator.num_used_pages == 0
    assert scheduler.update(plan, [42]) == [] and running.num_computed_tokens == 0
    assert scheduler.abort("wait") is waiting and scheduler.abort("wait") is None
    assert scheduler.abort("unknown") is None and not scheduler.has_unfinished()
    assert waiting.finish_reason == "abort"


def test_length_limits_and_stop_override():
    scheduler = make_scheduler(num_pages=40, budget=16, max_len=6)
    device = FakeDevice(scheduler.allocator)
    by_model_len = Request("len", [3, 4, 5, 6], greedy(100))
    by_max_tokens = Request("max", [3], greedy(2))
    run_engine_loop(scheduler, device, [by_model_len, by_max_tokens])
    assert by_model_len.num_tokens == 6 and by_model_len.finish_reason == "length"
    assert by_max_tokens.num_output_tokens == 2 and by_max_tokens.finish_reason == "length"
    stopped = Request("stop", [3], greedy(1))
    scheduler.add_request(stopped)
    plan = scheduler.schedule()
    assert scheduler.update(plan, [9]) == [stopped] and stopped.finish_reason == "length"
    scheduler.finish(stopped, RequestStatus.FINISHED_STOPPED)  # the engine found a stop token
    assert stopped.finish_reason == "stop" and scheduler.allocator.num_used_pages == 0


def test_sequence_that_outgrows_the_pool_ends_with_length():
    scheduler = make_scheduler(num_pages=4, page_size=2, budget=8, max_len=1000)  # 6 token slots
    request = Request("big", [3, 4, 5], greedy(50))
    run_engine_loop(scheduler, FakeDevice(scheduler.allocator), [request])
    assert request.finish_reason == "length" and request.num_tokens == 6
    assert request.output_token_ids == reference_output([3, 4, 5], 3)


def test_add_request_refuses_a_duplicate_id():
    scheduler = make_scheduler(num_pages=5, page_size=4, max_len=10)
    scheduler.add_request(Request("e", [1]))
    with pytest.raises(ValueError, match="duplicate request id 'e'"):
        scheduler.add_request(Request("e", [1]))
    assert scheduler.num_waiting == 1


def test_max_seq_len_is_the_smaller_of_max_model_len_and_the_pool():
    assert make_scheduler(num_pages=5, page_size=4, max_len=10).max_seq_len == 10
    assert make_scheduler(num_pages=3, page_size=4, max_len=100).max_seq_len == 8  # 2 usable pages


def test_constructor_limits_and_update_checks():
    with pytest.raises(ValueError, match="max_num_batched_tokens .* must be >= max_num_seqs"):
        make_scheduler(num_pages=4, max_num_seqs=8, budget=4)
    scheduler = make_scheduler(num_pages=8)
    scheduler.add_request(Request("a", [1, 2]))
    plan = scheduler.schedule()
    with pytest.raises(ValueError, match="expected 1 sampled ids, got 2"):
        scheduler.update(plan, [1, 2])
    assert StepPlan().is_empty and StepPlan().num_tokens == 0


def test_recompute_running_sends_every_running_request_back_in_order_and_frees_its_pages():
    scheduler = make_scheduler(num_pages=40, budget=16, max_num_seqs=8)
    device = FakeDevice(scheduler.allocator)
    requests = [Request(f"r{i}", [5 + i, 6, 7, 8, 9], greedy(10)) for i in range(3)]
    for request in requests:
        scheduler.add_request(request)
    scheduler.update(plan := scheduler.schedule(), device.run(plan))
    scheduler.add_request(queued := Request("queued", [3, 4], greedy(2)))
    assert scheduler.num_running == 3 and scheduler.allocator.num_used_pages > 0
    assert scheduler.recompute_running() == requests
    assert list(scheduler.waiting) == requests + [queued] and scheduler.num_running == 0
    assert all(r.num_computed_tokens == 0 and not r.page_ids and r.status == RequestStatus.PREEMPTED
               for r in requests)
    assert scheduler.allocator.num_used_pages == 0
    run_engine_loop(scheduler, device, [])  # they run again, from their prompt and the output they have
    for request in requests:
        assert request.output_token_ids == reference_output(request.prompt_token_ids, 10)


def test_to_batch_is_a_plain_immutable_snapshot_of_the_plan():
    scheduler = make_scheduler(num_pages=40, page_size=4, budget=10, max_num_seqs=8, max_prefill=2)
    device = FakeDevice(scheduler.allocator)
    decoding = Request("dec", [3, 4, 5], SamplingParams(max_tokens=5, temperature=0.7, seed=11))
    penalized = Request("pen", [6, 7], SamplingParams(max_tokens=5, repetition_penalty=1.3, seed=12))
    scheduler.add_request(decoding)
    scheduler.add_request(penalized)
    scheduler.update(plan := scheduler.schedule(), device.run(plan))
    long = Request("long", list(range(10, 30)), greedy(2))
    scheduler.add_request(long)
    plan = scheduler.schedule()  # two decode rows, then 8 of long's 20 prompt tokens
    batch = plan.to_batch()
    dec, pen = batch.decode
    (chunk,) = batch.prefill
    assert dec == ScheduledRow("dec", (decoding.output_token_ids[0],), 3, tuple(decoding.page_ids),
                               RowParams(decoding.params, seed=11, step=1))
    assert pen.sampling.prompt_token_ids == (6, 7) and pen.sampling.output_token_ids == tuple(
        penalized.output_token_ids)  # the history travels only for a row with a penalty
    assert chunk == ScheduledRow("long", tuple(range(10, 18)), 0, tuple(long.page_ids), None)  # no sample kept
    assert (batch.num_tokens, batch.num_prefill_tokens, batch.max_pages_per_seq) == (10, 8, 2)
    assert batch.num_attention_pairs == 4 + 3 + 8 * 9 // 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        dec.start = 0

    def values(value):  # every value reachable from the batch's fields
        yield value
        if isinstance(value, SamplingParams):
            return  # the request's own parameters, shared and only read
        if dataclasses.is_dataclass(value):
            for field in dataclasses.fields(value):
                yield from values(getattr(value, field.name))
        elif isinstance(value, (tuple, list)):
            for item in value:
                yield from values(item)
    assert not any(isinstance(v, (Request, list, dict)) for v in values(batch))  # plain, immutable data
    scheduler.update(plan, device.run(plan))
    assert batch.decode == (dec, pen) and dec.start == 3 and chunk.token_ids == tuple(range(10, 18))
    assert ScheduledBatch().is_empty and ScheduledBatch().max_pages_per_seq == 0


def test_step_data_and_output_side_modules_do_not_import_jax():
    import subprocess
    import sys
    code = ("import sys, jaxserve.core.scheduler, jaxserve.core.output_processor, jaxserve.core.outputs, jaxserve.core.structured_output, "
            "serve.structured, serve.tool_parsers, serve.reasoning, serve.chat_output, serve.protocol; "
            "assert 'jax' not in sys.modules, 'jax imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def _run_with_prompt_logprobs(scheduler, requests, device=None, max_steps=200):
    """The engine loop, with the engine's part for prompt logprobs: each step's rows are appended
    to their request (placeholders: the target ids). Returns the plans' prompt-logprob rows."""
    device = device or FakeDevice(scheduler.allocator)
    for request in requests:
        scheduler.add_request(request)
    rows = []
    for _ in range(max_steps):
        if not scheduler.has_unfinished():
            return rows
        plan = scheduler.schedule()
        batch = plan.to_batch()
        for row, (request, _) in zip(batch.rows, plan.scheduled):
            if row.prompt_logprobs is not None:
                rows.append((request.request_id, row.start, row.end, row.prompt_logprobs))
                request.prompt_logprobs.extend(row.prompt_logprobs.targets)
        assert sum(len(r.prompt_logprobs.targets) for r in batch.rows if r.prompt_logprobs) <= \
            scheduler.max_prompt_logprob_rows
        scheduler.update(plan, device.run(plan))
    raise AssertionError("no progress")


def test_prompt_logprob_rows_follow_the_chunks_and_stop_before_the_last_prompt_token():
    scheduler = make_scheduler(num_pages=40, budget=5)
    prompt = list(range(10, 22))  # 12 tokens: positions 0..10 predict tokens 1..11
    request = Request("r", prompt, SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=1))
    rows = _run_with_prompt_logprobs(scheduler, [request])
    assert [(start, end, r.first, r.targets) for _, start, end, r in rows] == [
        (0, 5, 0, tuple(prompt[1:6])), (5, 10, 5, tuple(prompt[6:11])), (10, 12, 10, (prompt[11],))]
    assert request.prompt_logprobs == prompt[1:] and len(request.output_token_ids) == 2
    assert request.status == RequestStatus.FINISHED_LENGTH


def test_prompt_logprob_rows_per_step_are_capped():
    """Two long prompts wanting prompt logprobs: a step computes at most max_prompt_logprob_rows
    of them (the second prompt's chunk is cut to the rows left), and every row comes exactly once."""
    scheduler = make_scheduler(num_pages=200, budget=512, max_len=512)
    assert scheduler.max_prompt_logprob_rows == MAX_PROMPT_LOGPROB_ROWS < 512
    prompts = [list(range(3, 203)), list(range(300, 500))]
    requests = [Request(f"r{i}", p, SamplingParams(max_tokens=1, prompt_logprobs=0)) for i, p in enumerate(prompts)]
    rows = _run_with_prompt_logprobs(scheduler, requests)
    first_step = [(rid, end - start, len(r.targets)) for rid, start, end, r in rows[:2]]
    # r0's whole prompt: 199 rows (its last token predicts the first output); r1 gets the rows left
    assert first_step == [("r0", 200, 199), ("r1", MAX_PROMPT_LOGPROB_ROWS - 199, MAX_PROMPT_LOGPROB_ROWS - 199)]
    for request, prompt in zip(requests, prompts):
        assert request.prompt_logprobs == prompt[1:]


def test_prompt_logprobs_skip_the_prefix_cache_and_max_tokens_zero_ends_after_the_prompt():
    scheduler = make_scheduler(num_pages=40, budget=16)
    device = FakeDevice(scheduler.allocator)
    prompt = list(range(10, 30))
    run_engine_loop(scheduler, device, [Request("warm", prompt, greedy(1))])
    cached = Request("cached", prompt, greedy(1))
    wanting = Request("wanting", prompt, SamplingParams(max_tokens=0, prompt_logprobs=2))
    rows = _run_with_prompt_logprobs(scheduler, [cached, wanting], device)
    assert cached.num_cached_tokens == 16 and wanting.num_cached_tokens == 0
    assert wanting.prompt_logprobs == prompt[1:] and [r[0] for r in rows] == ["wanting", "wanting"]
    assert wanting.output_token_ids == [] and wanting.status == RequestStatus.FINISHED_LENGTH
    assert scheduler.allocator.num_used_pages == 0


def test_prefill_beside_decoding_rows_is_bounded_by_long_prefill_token_threshold():
    """With decoding rows in a step its prefill chunks add up to at most the threshold; a step
    without decoding rows still takes the whole budget. Outputs are those of the unbounded run."""
    allocator = PageAllocator(80, 4, enable_prefix_caching=False)
    config = EngineConfig(max_num_seqs=4, max_num_batched_tokens=32, max_num_prefill_seqs=3,
                          long_prefill_token_threshold=5)
    scheduler = Scheduler(allocator, config, max_model_len=512)
    device = FakeDevice(allocator)
    streams = [Request(f"s{i}", [5 + i, 6], greedy(30)) for i in range(2)]
    long = Request("long", list(range(10, 70)), greedy(3))
    for request in streams + [long]:
        scheduler.add_request(request)
    first = scheduler.schedule()
    assert sum(n for _, n in first.prefill) == 2 + 2 + 28 and not first.decode  # nothing decodes yet: all 32
    scheduler.update(first, device.run(first))
    chunks = []
    while long.num_output_tokens == 0:
        plan = scheduler.schedule()
        assert len(plan.decode) == 2  # the streams get a token every step
        chunks.append(sum(n for _, n in plan.prefill))
        scheduler.update(plan, device.run(plan))
    assert chunks == [5] * 6 + [2]  # the remaining 32 prompt tokens, 5 a step beside the decoding streams
    run_engine_loop(scheduler, device, [])
    for request in streams + [long]:
        assert request.output_token_ids == reference_output(request.prompt_token_ids, request.params.max_tokens)
    with pytest.raises(ValueError, match="long_prefill_token_threshold must be >= 1"):
        Scheduler(allocator, dataclasses.replace(config, long_prefill_token_threshold=0), max_model_len=512)
