"""Continuous-batching scheduler: one token budget per step, no separate prefill/decode phases.

Each request only tracks `num_computed_tokens` against `num_tokens`. A step first gives every
running request in decode state its one token, then spends the remaining budget on prefill chunks
(running requests mid-prefill first, then waiting requests FCFS). When the KV pages run out, the
most recently admitted request not yet scheduled in this step is preempted: its pages are freed
and it is recomputed later from its prompt and the output it already has.

The `StepPlan` names live requests (the scheduler's and the engine's bookkeeping); the runner gets
its `to_batch()` snapshot, a `ScheduledBatch`: plain, immutable data (token ids, positions,
block-table rows and sampling rows per row) that `ModelRunner.execute` packs into the bucketed
device arrays. The runner never sees a `Request`, so nothing on the device side can read or change
host bookkeeping (a row's `RowParams.grammar`, the request's structured-output state, is only
read there: the engine advances it). No jax here.

Speculative decoding (jaxserve.speculative.verification): in a step with no prefill work, decoding requests
that carry proposed tokens (`Request.spec_token_ids`) make it a *verification step*: every decode
row becomes a `ScheduledBatch.verify` row of its last token plus its proposals (trimmed to the
free pages, the token budget and the request's limits; pages are never preempted for a proposal),
the device draws a token at each position, and `update` keeps the accepted ones; pages held only
for rejected proposals go back at once.

Multi-step decoding (`num_scheduler_steps` n > 1): a step of decoding rows only, none of which
needs the host between tokens (no penalties, grammar or logprobs), becomes n decode steps in one
device call: `plan.num_steps` tokens per row, within every row's limits and the free pages
(again without preempting), reserved now; `update` appends them all and the engine applies
stops token by token (the draws after a stop are dropped, like rejected proposals).

Prompt logprobs: a prefill chunk of a request that asked for them names its prompt positions
whose logprobs the step computes (`PromptLogprobRows`); a step computes at most
`prompt_logprob_rows_limit` of them (the chunk is cut to fit), and such a request does not take
prefix-cache pages until its prompt's logprobs are all computed (a cached page has no logits).
"""
from __future__ import annotations

import collections
import dataclasses
import time

from jaxserve.config import EngineConfig
from jaxserve.core.encoder_cache import (EncoderCache, StepImages, chunk_image_rows, chunk_key_limits, fit_chunk,
                                        max_image_tokens)
from jaxserve.core.page_allocator import PageAllocator
from jaxserve.core.request import Request, RequestStatus
from jaxserve.multimodal.inputs import text_positions
from jaxserve.speculative import verification
from jaxserve.core.step import (PromptLogprobRows, ScheduledBatch, ScheduledRow, prompt_logprob_rows_limit, row_params,
                                uses_penalties)


# LoRA: requests admitted past the oldest waiting one while its adapter has no slot, at most; then
# admission waits for it (Scheduler._next_admissible).
LORA_PASS_LIMIT = 64

# A step's prefill tokens are cut down to the next smaller bucket when that and the rest's bucket
# next step hold at least this many tokens fewer than their own bucket would
# (Scheduler.fit_prefill_to_bucket): a step more costs about what 80 tokens of float32 prefill do
# (SmolLM2 on 2 cores, StepRecords: prefill steps of 256, 32 and 12 tokens took 213, 71 and 53 ms,
# about 53 ms plus 0.66 ms a token; bench/RESULTS.md).
PREFILL_CUT_MIN_SAVED_TOKENS = 96


@dataclasses.dataclass
class StepPlan:
    """What one step computes, over live requests (the scheduler's `update` applies its results)."""
    decode: list[Request] = dataclasses.field(default_factory=list)  # one token each: the last one
    prefill: list[tuple[Request, int]] = dataclasses.field(default_factory=list)  # (request, num_new_tokens)
    preempted: list[Request] = dataclasses.field(default_factory=list)  # pages freed during this schedule()
    # A verification step (no prefill): the proposed tokens of each decode request (maybe none).
    proposals: dict[str, tuple[int, ...]] | None = None
    num_steps: int = 1  # multi-step decoding (decode rows only): tokens each decode row gets
    images: StepImages | None = None  # a vision-language model's: the images the step's chunks cover

    @property
    def is_verify(self) -> bool:
        return self.proposals is not None

    def num_proposed(self, request: Request) -> int:
        return len(self.proposals.get(request.request_id, ())) if self.proposals is not None else 0

    @property
    def scheduled(self) -> list[tuple[Request, int]]:
        """(request, num_new_tokens) in the order of the sampled ids: decode first, then prefill."""
        return [(request, self.num_steps + self.num_proposed(request)) for request in self.decode] + self.prefill

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    @property
    def num_seqs(self) -> int:
        return len(self.decode) + len(self.prefill)

    @property
    def is_empty(self) -> bool:
        return not self.decode and not self.prefill

    def to_batch(self) -> ScheduledBatch:
        """The plan as plain data for the runner; a snapshot, taken before `Scheduler.update`."""
        if self.proposals is not None:
            return ScheduledBatch(verify=tuple(_verify_row(request, self.proposals.get(request.request_id, ()))
                                               for request in self.decode))
        return ScheduledBatch(decode=tuple(_scheduled_row(request, 1, self.images) for request in self.decode),
                              prefill=tuple(_scheduled_row(request, n, self.images) for request, n in self.prefill),
                              num_steps=self.num_steps, encode=tuple(self.images.encode) if self.images else ())


def _verify_row(request: Request, proposals: tuple[int, ...]) -> ScheduledRow:
    start = request.num_computed_tokens
    return ScheduledRow(request.request_id, (request.token_id_at(start),) + tuple(proposals), start,
                        tuple(request.page_ids), row_params(request), lora_slot=request.lora_slot)


def _scheduled_row(request: Request, num_new: int, images: StepImages | None = None) -> ScheduledRow:
    start = request.num_computed_tokens
    end = start + num_new
    if num_new == 1:
        token_ids = (request.token_id_at(start),)
    else:
        token_ids = tuple(request.all_token_ids[start:end])
    sampling = None
    if end == request.num_tokens and request.params.max_tokens > 0:  # the sample is the next output token
        sampling = row_params(request)
    prompt_logprobs = None
    if _num_prompt_logprob_rows(request, num_new):
        first = max(start, len(request.prompt_logprobs))
        last = min(end, request.num_prompt_tokens - 1)
        prompt_logprobs = PromptLogprobRows(first, tuple(request.prompt_token_ids[first + 1:last + 1]),
                                            request.params.prompt_logprobs)
    image_fields = {}
    if images is not None:  # a vision-language model: M-RoPE positions for every row, the rest with images
        mm = request.multimodal
        image_fields["mrope_positions"] = text_positions(mm, start, end)
        if mm is not None:
            image_fields["image_rows"] = chunk_image_rows(mm, start, end, images.rows)
            image_fields["key_limits"] = chunk_key_limits(mm, start, end) if mm.bidirectional else None
    return ScheduledRow(request.request_id, token_ids, start, tuple(request.page_ids), sampling, prompt_logprobs,
                        lora_slot=request.lora_slot, **image_fields)


def _num_prompt_logprob_rows(request: Request, num_new: int) -> int:
    """Prompt-logprob rows a chunk of `num_new` tokens from the request's next position computes."""
    if not request.num_prompt_logprobs_missing:
        return 0
    start = request.num_computed_tokens
    return max(min(start + num_new, request.num_prompt_tokens - 1) - max(start, len(request.prompt_logprobs)), 0)


def _cap_prompt_logprob_chunk(request: Request, num_new: int, rows_left: int) -> int:
    """The longest chunk (at most `num_new` tokens) whose prompt-logprob rows fit in `rows_left`."""
    if not request.num_prompt_logprobs_missing:
        return num_new
    start = request.num_computed_tokens
    return min(num_new, max(start, len(request.prompt_logprobs)) - start + rows_left)


class Scheduler:
    def __init__(self, allocator: PageAllocator, config: EngineConfig, max_model_len: int,
                 encoder_cache: EncoderCache | None = None, prefill_cut_sizes: tuple[int, ...] = (),
                 prefill_cut_min_saved: int = PREFILL_CUT_MIN_SAVED_TOKENS) -> None:
        """Schedules under `config`'s limits (max_num_seqs, max_num_batched_tokens,
        max_num_prefill_seqs) for sequences of at most `max_model_len` (config.model_len of the model).
        `encoder_cache`: a vision-language model's (chunks fitted around images, which each step
        encodes within a budget of max_num_batched_tokens image tokens: jaxserve.core.encoder_cache).
        `prefill_cut_sizes`: the prefill buckets a step's prefill tokens may be cut down to
        (BucketSet.prefill_cut_sizes; `fit_prefill_to_bucket`), ascending; none: never cut;
        `prefill_cut_min_saved`: the bucket tokens a cut must save."""
        max_num_seqs, max_num_batched_tokens = config.max_num_seqs, config.max_num_batched_tokens
        max_num_prefill_seqs = config.max_num_prefill_seqs
        if max_model_len < 1:  # (the config's own bounds are checked when it is made: EngineConfig.check)
            raise ValueError(f"max_model_len must be >= 1, got {max_model_len}")
        self.allocator = allocator
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_prefill_seqs = max_num_prefill_seqs
        self.long_prefill_token_threshold = config.long_prefill_token_threshold
        self.prefill_cut_sizes = tuple(prefill_cut_sizes)
        self.prefill_cut_min_saved = prefill_cut_min_saved
        self.max_prompt_logprob_rows = prompt_logprob_rows_limit(config)
        self.max_model_len = max_model_len
        self.max_spec_tokens = config.speculative_tokens  # 0: no verification steps
        self.max_verify_rows = verification.max_verify_rows(config) if self.max_spec_tokens else 0
        self.spec_stats = verification.SpeculationStats(self.max_spec_tokens)
        self.num_scheduler_steps = config.num_scheduler_steps
        # LoRA: at most max_loras distinct adapters among the running requests (None: LoRA off).
        self.max_loras = config.max_loras if config.enable_lora else None
        # A pooling engine samples nothing: a prompt's last token is part of a prefill chunk (the
        # pooling step pools chunks only), never a decode row.
        self.prompt_only = config.runner == "pooling"
        self.encoder_cache = encoder_cache
        self.max_image_tokens = max_image_tokens(config)  # (what admission allows an image)
        self._num_passed_over = 0  # requests admitted past the oldest waiting one (its adapter had no room)
        # A sequence longer than the whole pool could never be computed.
        self.max_seq_len = min(max_model_len, allocator.num_usable_pages * allocator.page_size)
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []  # admission order, oldest first
        self._requests: dict[str, Request] = {}
        self.num_preemptions = 0

    # ---- queue management ---------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished(self) -> bool:
        return bool(self.running or self.waiting)

    def unfinished_requests(self) -> list[Request]:
        """Every request added and not finished, in the order they were added."""
        return list(self._requests.values())

    def add_request(self, request: Request) -> None:
        """Queues a request that passed `request.check_request` (this does not check it again);
        ValueError on a duplicate id."""
        if request.request_id in self._requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        request.status = RequestStatus.WAITING
        self._requests[request.request_id] = request
        self.waiting.append(request)

    def abort(self, request_id: str) -> Request | None:
        """Finishes an unfinished request as aborted (pages freed now); None if unknown or done."""
        request = self._requests.get(request_id)
        if request is None:
            return None
        self.finish(request, RequestStatus.FINISHED_ABORTED)
        return request

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Ends a request and frees its pages. On an already finished request only the status
        changes (e.g. a stop string found on the token that also hit the length limit)."""
        if not status.is_finished:
            raise ValueError(f"{status} is not a finished status")
        if request.status.is_finished:
            request.status = status
            return
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self.allocator.free_request(request)
        request.status = status
        request.finish_time = time.monotonic()
        self._requests.pop(request.request_id, None)

    def check_length(self, request: Request) -> bool:
        """Finishes the request with FINISHED_LENGTH if it may not or cannot grow any more."""
        if request.status.is_finished:
            return request.status == RequestStatus.FINISHED_LENGTH
        if request.num_output_tokens >= request.params.max_tokens or request.num_tokens >= self.max_seq_len:
            self.finish(request, RequestStatus.FINISHED_LENGTH)
            return True
        return False

    # ---- one step -----------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        """Decides the next step (pages are reserved for it now); empty when nothing can run."""
        plan = StepPlan()
        budget = self.max_num_batched_tokens
        scheduled: set[str] = set()
        if self.encoder_cache is not None:
            plan.images = StepImages(budget=self.max_num_batched_tokens)

        decoding = set() if self.prompt_only else {r.request_id for r in self.running if self.is_decoding(r)}
        for request in [r for r in self.running if r.request_id in decoding]:
            if budget < 1 or request.status != RequestStatus.RUNNING or self._fit_images(request, 1, plan) < 1:
                continue
            if self._reserve_pages(request, 1, scheduled, plan):
                plan.decode.append(request)
                scheduled.add(request.request_id)
                budget -= 1

        prefill_budget = budget  # prefill chunks beside decoding rows: at most long_prefill_token_threshold
        if plan.decode and self.long_prefill_token_threshold is not None:
            prefill_budget = min(budget, self.long_prefill_token_threshold)
        rows_left = self.max_prompt_logprob_rows  # prompt-logprob rows this step may still compute
        for request in [r for r in self.running if r.request_id not in decoding]:
            if prefill_budget < 1 or len(plan.prefill) >= self.max_num_prefill_seqs:
                break
            if request.status != RequestStatus.RUNNING:
                continue
            num_new = _cap_prompt_logprob_chunk(
                request, min(request.num_tokens - request.num_computed_tokens, prefill_budget), rows_left)
            num_new = self._fit_images(request, num_new, plan, beyond=budget)
            if num_new < 1:
                continue
            if self._reserve_pages(request, num_new, scheduled, plan):
                plan.prefill.append((request, num_new))
                scheduled.add(request.request_id)
                budget -= num_new
                prefill_budget -= num_new
                rows_left -= _num_prompt_logprob_rows(request, num_new)

        if not plan.preempted:  # a request preempted now is not re-admitted in the same step
            self._admit_waiting(plan, prefill_budget, rows_left, budget)
        self.fit_prefill_to_bucket(plan)
        if self.max_spec_tokens and not plan.prefill and 0 < len(plan.decode) <= self.max_verify_rows:
            self._schedule_proposals(plan, budget)
        if self.num_scheduler_steps > 1 and not plan.prefill and plan.decode and not plan.is_verify:
            self._schedule_steps(plan)
        if self.encoder_cache is not None:
            if plan.is_empty:  # nothing runs: rows reserved while planning stay unencoded
                self.encoder_cache.forget([job.image.content_hash for job in plan.images.encode])
            self.encoder_cache.unpin_all()
        return plan

    def fit_prefill_to_bucket(self, plan: StepPlan) -> None:
        """Cuts the plan's last prefill chunk so that the step's prefill tokens fill the next
        smaller bucket, when that bucket and the one the rest of them take next step hold at
        least `prefill_cut_min_saved` tokens fewer than their own bucket would: the rest of that
        prompt comes in the next step (the pages reserved for it are given back until then).
        Nothing changes without `prefill_cut_sizes`, for a chunk that would not keep a token,
        or one of a request with images (its chunk is fitted around them)."""
        sizes = self.prefill_cut_sizes
        total = sum(n for _, n in plan.prefill)
        if not sizes or not plan.prefill or total > sizes[-1]:
            return
        own = next(size for size in sizes if size >= total)
        smaller = max((size for size in sizes if size < total), default=0)
        request, num_new = plan.prefill[-1]
        excess = total - smaller
        if not smaller or num_new <= excess or request.multimodal is not None:
            return
        rest_bucket = next(size for size in sizes if size >= excess)
        if own - smaller - rest_bucket < self.prefill_cut_min_saved:
            return
        plan.prefill[-1] = (request, num_new - excess)
        keep = self.allocator.num_pages_for_tokens(request.num_computed_tokens + num_new - excess)
        self.allocator.free(request.page_ids[keep:])
        del request.page_ids[keep:]

    def _fit_images(self, request: Request, num_new: int, plan: StepPlan, start: int | None = None,
                    beyond: int = 0) -> int:
        """The request's chunk of at most `num_new` tokens from `start` (default: its next token)
        fitted around its images (encoder_cache.fit_chunk); `num_new` for a request without. An
        image the chunk starts in that `num_new` cannot hold may take up to `beyond` tokens (the
        step's budget left: past long_prefill_token_threshold, so an image larger than it is not
        held back for ever)."""
        if request.multimodal is None or num_new < 1:
            return num_new
        start = request.num_computed_tokens if start is None else start
        fitted = fit_chunk(request.multimodal, start, num_new, self.encoder_cache, plan.images)
        image = request.multimodal.span_at(start)
        if fitted or image is None or not num_new < image.end - start <= beyond:
            return fitted
        return fit_chunk(request.multimodal, start, image.end - start, self.encoder_cache, plan.images)

    def _schedule_steps(self, plan: StepPlan) -> None:
        """Makes a decode-only plan n decode steps in one call when no row needs the host between
        its tokens: as many steps (up to num_scheduler_steps) as every row's max_tokens and
        context allow and the free pages hold (no request is preempted for them)."""
        if any(uses_penalties(r.params) or r.grammar is not None or r.params.logprobs is not None
               for r in plan.decode):
            return
        num_steps = min([self.num_scheduler_steps]
                        + [min(r.params.max_tokens - r.num_output_tokens, self.max_seq_len - r.num_tokens)
                           for r in plan.decode])
        allocator = self.allocator

        def pages_needed(steps):  # positions num_computed .. num_computed + steps - 1 of every row
            return sum(max(allocator.num_pages_for_tokens(r.num_computed_tokens + steps) - len(r.page_ids), 0)
                       for r in plan.decode)

        while num_steps > 1 and not allocator.can_allocate(pages_needed(num_steps)):
            num_steps -= 1
        if num_steps < 2:
            return
        for request in plan.decode:
            request.page_ids.extend(allocator.allocate(max(
                allocator.num_pages_for_tokens(request.num_computed_tokens + num_steps) - len(request.page_ids), 0)))
        plan.num_steps = num_steps

    def _schedule_proposals(self, plan: StepPlan, budget: int) -> None:
        """Makes a decode-only plan a verification step when some request carries proposals:
        each keeps as many as its limits, the token budget and the free pages allow (no request
        is preempted for a proposal)."""
        if not any(request.spec_token_ids for request in plan.decode):
            return
        allocator, page_size = self.allocator, self.allocator.page_size
        proposals = {}
        for request in plan.decode:
            k = min(len(request.spec_token_ids), self.max_spec_tokens, budget,
                    request.params.max_tokens - request.num_output_tokens - 1,  # each kept draw is an output
                    self.max_seq_len - request.num_tokens,
                    (len(request.page_ids) + allocator.num_free_pages) * page_size - request.num_computed_tokens - 1)
            if k < 1:
                continue
            request.page_ids.extend(allocator.allocate(
                allocator.num_pages_for_tokens(request.num_computed_tokens + 1 + k) - len(request.page_ids)))
            proposals[request.request_id] = tuple(request.spec_token_ids[:k])
            budget -= k
        if proposals:
            plan.proposals = proposals

    def _admit_waiting(self, plan: StepPlan, budget: int, rows_left: int, step_budget: int) -> None:
        """Admits waiting requests into the step's prefill (`budget` tokens; `step_budget`: what an
        image at a chunk's start may take beyond it)."""
        allocator = self.allocator
        while (self.waiting and budget > 0 and len(self.running) < self.max_num_seqs
               and len(plan.prefill) < self.max_num_prefill_seqs):
            request = self._next_admissible()
            if request is None:
                break
            # The last token is always recomputed (its logits are needed), so match before it. A
            # request still owed prompt logprobs computes its whole prompt: cached pages have no logits.
            prefix_tokens = ([] if request.num_prompt_logprobs_missing
                             else request.prefix_key_ids(request.num_tokens - 1))  # an image's positions: its hash
            # Cached pages on the device, then those KV offload restores (fresh pages filled from host memory).
            cached_pages, offloaded = allocator.find_prefix(prefix_tokens, request.prefix_salt)
            num_computed = (len(cached_pages) + len(offloaded)) * allocator.page_size
            # (a request owed prompt logprobs starts from 0, what the cap counts from)
            num_new = _cap_prompt_logprob_chunk(request, min(request.num_tokens - num_computed, budget), rows_left)
            num_new = self._fit_images(request, num_new, plan, start=num_computed, beyond=step_budget)
            num_needed = allocator.num_pages_for_tokens(num_computed + num_new) - len(cached_pages)
            if num_new < 1 or num_needed > allocator.num_free_pages_after_acquiring(cached_pages):
                break
            if request is self.waiting[0]:
                self._num_passed_over = 0
            else:
                self._num_passed_over += 1
            self.waiting.remove(request)
            request.page_ids = allocator.match_prefix(prefix_tokens, request.prefix_salt)
            request.page_ids += allocator.acquire_offloaded(offloaded)
            request.page_ids += allocator.allocate(num_needed - len(offloaded))
            request.num_computed_tokens = num_computed
            request.num_cached_tokens = num_computed
            request.status = RequestStatus.RUNNING
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
            self.running.append(request)
            plan.prefill.append((request, num_new))
            budget -= num_new
            step_budget -= num_new
            rows_left -= _num_prompt_logprob_rows(request, num_new)

    def _next_admissible(self) -> Request | None:
        """The waiting request to admit next: the oldest, unless its LoRA adapter has no room
        among the running requests' (--max_loras distinct); then the oldest whose adapter has,
        until LORA_PASS_LIMIT requests were admitted past it: from then on none is, the running
        requests drain, and its adapter gets a slot (no adapter waits without bound)."""
        head = self.waiting[0]
        if self.max_loras is None:
            return head
        running = {r.params.lora_name for r in self.running} - {None}
        fits = lambda r: r.params.lora_name is None or r.params.lora_name in running or len(running) < self.max_loras  # noqa: E731
        if fits(head):
            return head
        if self._num_passed_over >= LORA_PASS_LIMIT:
            return None
        return next((r for r in self.waiting if fits(r)), None)

    @staticmethod
    def is_decoding(request: Request) -> bool:
        """Whether the request's next step is a decode step: all but its last token computed."""
        return request.num_tokens - request.num_computed_tokens == 1

    def _reserve_pages(self, request: Request, num_new: int, scheduled: set[str], plan: StepPlan) -> bool:
        """Grows `request.page_ids` to hold `num_new` more tokens, preempting the most recently
        admitted unscheduled requests while pages are short. False if `request` itself was
        preempted."""
        allocator = self.allocator
        num_needed = allocator.num_pages_for_tokens(request.num_computed_tokens + num_new) - len(request.page_ids)
        while not allocator.can_allocate(num_needed):
            victim = next(r for r in reversed(self.running) if r.request_id not in scheduled)
            self._preempt(victim, plan)
            if victim is request:
                return False
        if num_needed > 0:
            request.page_ids.extend(allocator.allocate(num_needed))
        return True

    def recompute_running(self) -> list[Request]:
        """Sends every running request back to the front of the waiting queue, in admission order,
        to be recomputed from its tokens (the KV cache was lost); returns them."""
        requests = list(self.running)
        plan = StepPlan()
        for request in reversed(requests):
            self._preempt(request, plan)
        return requests

    def _preempt(self, request: Request, plan: StepPlan) -> None:
        self.running.remove(request)
        self.allocator.free_request(request)
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(request)
        plan.preempted.append(request)
        self.num_preemptions += 1

    def _verified_tokens(self, proposed: tuple[int, ...], draws) -> list[int]:
        """A verified row's accepted tokens (counted in spec_stats)."""
        tokens = verification.accepted_tokens(proposed, draws[:len(proposed) + 1])
        if proposed:
            self.spec_stats.record(len(proposed), len(tokens) - 1)
        return tokens

    def _append_computed(self, request: Request, tokens: list[int], now: float) -> None:
        """Appends the output tokens a row got in one step (verified, or several steps' draws),
        within its max_tokens and the length limit: its last token and all new ones but the last
        are now computed; pages held only for positions past that are returned."""
        room = min(request.params.max_tokens - request.num_output_tokens, self.max_seq_len - request.num_tokens)
        tokens = tokens[:max(room, 1)]
        request.num_computed_tokens += len(tokens)  # the row's last token and the accepted proposals
        request.output_token_ids.extend(tokens)
        if request.first_token_time is None:
            request.first_token_time = now
        request.spec_token_ids = []
        self.allocator.register_full_pages(request)
        keep = self.allocator.num_pages_for_tokens(request.num_tokens)
        if len(request.page_ids) > keep:
            self.allocator.free(request.page_ids[keep:])
            del request.page_ids[keep:]

    def update(self, plan: StepPlan, sampled_token_ids: list[int]) -> list[Request]:
        """Applies the results of the step that ran `plan`.

        `sampled_token_ids` holds one id per decode request, then one per prefill entry; in a
        verification step, one sequence per decode request: its draws at each position (the
        accepted ones, up to the request's limits, are appended; `verification.accepted_tokens`).
        Returns the requests that got new output tokens (a prefill chunk only when it reached the
        end of the sequence; with max_tokens 0, the chunk that ended the prompt: no token, finished
        with FINISHED_LENGTH). Requests that hit max_tokens or the length limit come back already finished
        with FINISHED_LENGTH; the engine checks stop tokens and stop strings on all of them and
        calls `finish` (which only changes the status of one already finished).
        Requests finished (aborted) while the step ran are skipped.
        """
        if len(sampled_token_ids) != plan.num_seqs:
            raise ValueError(f"expected {plan.num_seqs} sampled ids, got {len(sampled_token_ids)}")
        appended: list[Request] = []
        now = time.monotonic()
        if plan.is_verify or plan.num_steps > 1:
            if plan.is_verify:
                self.spec_stats.num_verify_steps += 1
            for request, draws in zip(plan.decode, sampled_token_ids):
                if request.status == RequestStatus.RUNNING:
                    tokens = draws[:plan.num_steps] if plan.num_steps > 1 else self._verified_tokens(
                        plan.proposals.get(request.request_id, ()), draws)
                    self._append_computed(request, tokens, now)
                    appended.append(request)
            for request in appended:
                self.check_length(request)
            return appended
        for (request, num_new), token_id in zip(plan.scheduled, sampled_token_ids):
            if request.status != RequestStatus.RUNNING:
                continue
            request.num_computed_tokens += num_new
            self.allocator.register_full_pages(request)
            if request.num_computed_tokens == request.num_tokens:
                if request.params.max_tokens > 0:  # max_tokens 0 (prompt logprobs only): no output token
                    request.output_token_ids.append(int(token_id))
                    if request.first_token_time is None:
                        request.first_token_time = now
                appended.append(request)
        for request in appended:
            self.check_length(request)
        return appended
