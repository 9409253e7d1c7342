"""The step contract: what the scheduler hands the runner and what comes back, as plain data.

The scheduler plans a step over live requests (`scheduler.StepPlan`) and gives the runner its
snapshot, a `ScheduledBatch` of `ScheduledRow`s: token ids, positions, block-table rows and how
each row is sampled (`RowParams`). The runner pads it into one of the step shapes
(`Bucket`, from the engine's `BucketSet`) and returns a `StepOutput` of host arrays. Nothing
here changes a `Request` (`row_params` reads one, to snapshot it), and nothing here imports jax
(numpy only, for the padding arrays of a bucket).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np

from jaxserve.config import EngineConfig
from jaxserve.settings import BucketListError  # noqa: F401 (a bad explicit bucket list: EngineConfig refuses it)
from jaxserve.core.request import Request, SamplingParams

# The most prompt-logprob rows one step computes (each is a [vocab] row of logits on the device;
# the runner's prompt-logprob shapes hold row counts up to this, or max_num_batched_tokens if lower).
MAX_PROMPT_LOGPROB_ROWS = 256


def prompt_logprob_rows_limit(config: EngineConfig) -> int:
    return min(MAX_PROMPT_LOGPROB_ROWS, config.max_num_batched_tokens)


@dataclasses.dataclass(frozen=True, slots=True)
class RowParams:
    """How one row is sampled: the request's sampling parameters (read only), where its random
    stream is, and its token history (needed, and filled by the scheduler, only with a penalty)."""

    params: SamplingParams = dataclasses.field(default_factory=SamplingParams)
    seed: int = 0
    step: int = 0  # number of output tokens so far
    prompt_token_ids: Sequence[int] = ()
    output_token_ids: Sequence[int] = ()
    # The request's structured_output.GrammarState (read only here: the runner writes its allowed
    # tokens into the row's bitmask; the engine advances it after the step).
    grammar: Any = None

    @property
    def has_penalties(self) -> bool:
        return uses_penalties(self.params)


def uses_penalties(params: SamplingParams) -> bool:
    """Whether sampling reads the token history (repetition, presence or frequency penalty)."""
    return params.repetition_penalty != 1.0 or params.presence_penalty != 0.0 or params.frequency_penalty != 0.0


def row_params(request: Request) -> RowParams:
    """How the request's next output token is sampled: a snapshot of its sampling state (the scheduler's
    rows and the draft model's proposals read it)."""
    history = ((tuple(request.prompt_token_ids), tuple(request.output_token_ids))
               if uses_penalties(request.params) else ((), ()))  # copied only for rows that read it
    return RowParams(request.params, request.seed, request.num_output_tokens, *history, grammar=request.grammar)


@dataclasses.dataclass(frozen=True, slots=True)
class PromptLogprobRows:
    """Prompt logprobs computed in a prefill chunk: positions `first .. first + len(targets) - 1`
    each predict the prompt token after it, `targets[i]` (whose logprob and rank are returned,
    with the top `num_logprobs`)."""

    first: int
    targets: tuple[int, ...]
    num_logprobs: int


@dataclasses.dataclass(frozen=True, slots=True)
class EncodeJob:
    """An image the step encodes first (vision tower and projector) into rows of the runner's
    image-embedding pool (jaxserve.core.encoder_cache), where its tokens' embeddings are read."""

    image: Any  # jaxserve.multimodal.inputs.ImageInput
    rows: tuple[int, ...]  # one per image token


@dataclasses.dataclass(frozen=True, slots=True)
class ScheduledRow:
    """One sequence's part of a step: `token_ids` at positions `start ..` of the sequence whose
    K/V pages are `page_ids` (positions before `start` are already in the cache)."""

    request_id: str
    token_ids: tuple[int, ...]  # computed this step: one for a decode row, a chunk for prefill
    start: int  # position of token_ids[0]
    page_ids: tuple[int, ...]  # the sequence's block-table row; holds positions up to `end`
    sampling: RowParams | None  # None: a prefill chunk short of the sequence's end (its sample is dropped)
    prompt_logprobs: PromptLogprobRows | None = None  # prompt positions of the chunk whose logprobs are wanted
    lora_slot: int = 0  # the LoRA slab's slot of the sequence's adapter (0: the base model)
    # Image input (a vision-language model; None for text): each token's row of the image-embedding
    # pool (0: the token's own embedding), each token's M-RoPE positions (int32 [3, tokens]), and
    # each token's highest visible key position (bidirectional image spans; else its own position).
    image_rows: tuple[int, ...] | None = None
    mrope_positions: Any = None
    key_limits: tuple[int, ...] | None = None

    @property
    def end(self) -> int:
        """Context length after the step (positions 0 .. end - 1 are in the cache)."""
        return self.start + len(self.token_ids)


@dataclasses.dataclass(frozen=True)
class ScheduledBatch:
    """One step: decode rows (one token each) and prefill chunks, in the order of the sampled ids;
    or, in a verification step, only `verify` rows: a decoding sequence's last token and its
    proposed tokens, sampled at every position (`sampling` is the first position's; the runner
    derives the others)."""

    decode: tuple[ScheduledRow, ...] = ()
    prefill: tuple[ScheduledRow, ...] = ()
    verify: tuple[ScheduledRow, ...] = ()
    num_steps: int = 1  # multi-step decoding: tokens per decode row, drawn on the device one after another
    encode: tuple[EncodeJob, ...] = ()  # images encoded before the step's forward

    @property
    def rows(self) -> tuple[ScheduledRow, ...]:
        return self.decode + self.prefill + self.verify

    @property
    def num_prefill_tokens(self) -> int:
        return sum(len(row.token_ids) for row in self.prefill)

    @property
    def num_verify_tokens(self) -> int:
        return sum(len(row.token_ids) for row in self.verify)

    @property
    def num_tokens(self) -> int:
        """Tokens the step computes (multi-step: every decode row's n steps)."""
        return len(self.decode) * self.num_steps + self.num_prefill_tokens + self.num_verify_tokens

    @property
    def max_pages_per_seq(self) -> int:
        """Block-table width the step needs: pages of its widest row."""
        return max((len(row.page_ids) for row in self.rows), default=0)

    @property
    def num_attention_pairs(self) -> int:
        """(query, key) pairs the step's causal attention covers: a query at position p sees p + 1 keys."""
        return sum(len(row.token_ids) * row.start + len(row.token_ids) * (len(row.token_ids) + 1) // 2
                   for row in self.rows)

    @property
    def is_empty(self) -> bool:
        return not self.decode and not self.prefill and not self.verify


def geometric_buckets(low: int, high: int, factor: int = 2) -> tuple[int, ...]:
    """low, factor*low, factor**2*low, ... capped by high (which is always included)."""
    sizes, size = [], min(low, high)
    while size < high:
        sizes.append(size)
        size *= factor
    sizes.append(high)
    return tuple(sizes)


@dataclasses.dataclass(frozen=True)
class Bucket:
    """One step shape (the device side builds one executable per shape)."""
    num_decode: int  # decode rows
    num_prefill_tokens: int  # prefill tokens (0: no prefill part)
    pages_per_seq: int  # block table width: pages per sequence the step may read
    # A verification step (speculative decoding): this many rows of K + 1 tokens each, through the
    # prefill (ragged) path as one chunk per row, with logits at every token; num_decode is 0
    # and num_prefill_tokens num_verify * (K + 1).
    num_verify: int = 0


# The geometric rule's smallest decode and prefill buckets (when no explicit list is given).
MIN_DECODE_BUCKET = 8
MIN_PREFILL_BUCKET = 32
# Decode-only buckets of the CPU (XLA) path below the smallest decode bucket, from
# bench/step_profile.py --row_sweep (see BucketSet).
CPU_SMALL_DECODE_BUCKETS = (1, 2, 4)


@dataclasses.dataclass(frozen=True)
class BucketSet:
    """The step shapes of an engine: every combination of its decode rows, prefill tokens
    and block-table widths (but not the empty step).

    Rows and tokens double from bucket to bucket, so a step pays for at most twice its work (on
    CPU a decode step's cost grows with its rows: 16 running sequences in a 32-row bucket took
    twice as long). Block-table widths are bucketed (x4) only where the attention's cost grows
    with the width (`width_buckets`, pallas_kernels.dispatch.cost_grows_with_table_width: the
    Mosaic kernels over int8 pages, the reference); every other backend's cost follows the
    contexts present, so its steps have one width, the longest context's.

    Off the CPU path (`shared_sampler_rows`) a decode-only step returns as many logit rows as a
    step with prefill chunks beside the same decode rows (decode rows + max_num_prefill_seqs), so
    the two share one sampler shape: on a GPU a few more rows of LM head and sampler cost
    microseconds against a step of milliseconds, and every sampler shape is one more executable.

    On the CPU, decode-only steps also get `decode_only` buckets below the smallest decode bucket
    (CPU_SMALL_DECODE_BUCKETS): a decode step's cost there is its weight and K/V bytes plus work
    per row, so one or two streams in an 8-row bucket would pay for six idle rows (SmolLM2,
    ~500-token contexts, bench/step_profile.py --row_sweep in bench/RESULTS.md). They are not
    combined with prefill buckets, whose tokens outweigh a few padded decode rows.

    Explicit lists (EngineConfig.decode_buckets / prefill_buckets, e.g. from `jaxserve plan
    --measure_buckets`) replace the geometric rule's sizes; on the CPU the decode sizes below
    min(MIN_DECODE_BUCKET, the largest) are the decode-only ones, as above.

    On the CPU a step's prefill tokens may also be cut down to a smaller bucket (`cut_prefill`,
    the scheduler's `fit_prefill_to_bucket`): there a prompt chunk's cost is mostly its tokens'
    FLOPs, so 300 tokens in the 512-token bucket pay for 512, where 256 now and 44 in the next
    step pay for 320 (SmolLM2 float32, a 300-token prompt's TTFT 326 -> 238 ms, bench/RESULTS.md).
    On an accelerator a step's fixed cost outweighs the padding, and a step more would cost more."""
    decode: tuple[int, ...]
    prefill: tuple[int, ...]
    pages: tuple[int, ...]
    max_num_prefill_seqs: int
    decode_only: tuple[int, ...] = ()  # decode rows of decode-only steps, below min(decode[1:])
    verify: tuple[int, ...] = ()  # rows of verification steps (speculative decoding; none without)
    verify_row_tokens: int = 0  # K + 1: a verify row's last token and at most K proposals
    shared_sampler_rows: bool = False  # decode-only steps have the logit rows of decode + prefill ones
    cut_prefill: bool = False  # the scheduler may cut a step's prefill tokens to a smaller bucket (CPU)

    @classmethod
    def create(cls, *, backend: str, max_num_seqs: int, max_num_batched_tokens: int,
               max_num_prefill_seqs: int, max_model_len: int, page_size: int,
               speculative_tokens: int = 0, max_verify_rows: int = 0,
               decode_buckets: tuple[int, ...] | None = None, prefill_buckets: tuple[int, ...] | None = None,
               width_buckets: bool = False) -> "BucketSet":
        """The buckets of an engine; with `speculative_tokens` K > 0 also verification buckets of
        1, 2, 4, .. `max_verify_rows` rows of K + 1 tokens. `decode_buckets` / `prefill_buckets`:
        explicit lists of decode rows / prefill tokens (EngineConfig's, parsed and checked there),
        else the geometric rule's. `width_buckets`: block-table widths of 256 keys, x4, up to
        the longest context (else that one width)."""
        max_pages_per_seq = -(-max_model_len // page_size)
        pages = (geometric_buckets(-(-256 // page_size), max_pages_per_seq, 4) if width_buckets else
                 (max_pages_per_seq,))
        if decode_buckets is None:
            decode = geometric_buckets(MIN_DECODE_BUCKET, max_num_seqs, 2)
            small = tuple(rows for rows in CPU_SMALL_DECODE_BUCKETS if rows < decode[0]) if backend == "xla" else ()
        else:
            split = min(MIN_DECODE_BUCKET, decode_buckets[-1]) if backend == "xla" else 0
            decode = tuple(s for s in decode_buckets if s >= split)
            small = tuple(s for s in decode_buckets if s < split)
        prefill = (geometric_buckets(MIN_PREFILL_BUCKET, max_num_batched_tokens, 2) if prefill_buckets is None
                   else tuple(prefill_buckets))
        verify = geometric_buckets(1, max_verify_rows, 2) if speculative_tokens else ()
        return cls((0,) + decode, (0,) + prefill, pages, max_num_prefill_seqs, small, verify,
                   speculative_tokens + 1 if speculative_tokens else 0, shared_sampler_rows=backend != "xla",
                   cut_prefill=backend == "xla")

    @property
    def decode_sizes(self) -> tuple[int, ...]:
        """Every decode row count of a decode-only step (the decode-only and the combined ones)."""
        return tuple(sorted(set(self.decode_only) | {d for d in self.decode if d}))

    @property
    def prefill_sizes(self) -> tuple[int, ...]:
        """Every prefill token count of a step."""
        return tuple(p for p in self.prefill if p)

    @property
    def prefill_cut_sizes(self) -> tuple[int, ...]:
        """The prefill token counts the scheduler may cut a step's prefill down to (none off the CPU)."""
        return self.prefill_sizes if self.cut_prefill else ()

    def all(self) -> list[Bucket]:
        return ([Bucket(d, 0, n) for d in self.decode_only for n in self.pages]
                + [Bucket(d, p, n) for d in self.decode for p in self.prefill for n in self.pages if d or p]
                + [self._verify_bucket(rows, n) for rows in self.verify for n in self.pages])

    def _verify_bucket(self, rows: int, pages: int) -> Bucket:
        return Bucket(0, rows * self.verify_row_tokens, pages, rows)

    def fit_verify(self, num_rows: int, pages_per_seq: int) -> Bucket:
        """The smallest verification bucket that holds a verification step."""
        return self._verify_bucket(next(b for b in self.verify if b >= num_rows),
                                   next(b for b in self.pages if b >= pages_per_seq))

    def smallest_and_largest(self) -> list[Bucket]:
        """The corner shapes: smallest and largest of each kind (a check of the GPU build CI can afford)."""
        def ends(sizes):  # 0 (no part of that kind) where allowed, the smallest size, the largest
            nonzero = [size for size in sizes if size]
            return sorted({size for size in sizes if size == 0} | {nonzero[0], nonzero[-1]})
        return [Bucket(d, p, n) for d in ends(self.decode) for p in ends(self.prefill) for n in ends(self.pages)
                if d or p]

    def fit(self, num_decode: int, num_prefill_tokens: int, pages_per_seq: int) -> Bucket:
        """The smallest bucket that holds a step."""
        if num_prefill_tokens == 0 and num_decode <= max(self.decode_only, default=0):
            return Bucket(next(b for b in self.decode_only if b >= num_decode), 0,
                          next(b for b in self.pages if b >= pages_per_seq))
        return Bucket(next(b for b in self.decode if b >= num_decode),
                      next(b for b in self.prefill if b >= num_prefill_tokens),
                      next(b for b in self.pages if b >= pages_per_seq))

    def num_rows(self, bucket: Bucket) -> int:
        """Logit rows of a bucket's step (what its sampler samples)."""
        if bucket.num_verify:  # verification: logits at every token
            return bucket.num_decode + bucket.num_prefill_tokens
        num_prefill_seqs = self.max_num_prefill_seqs if bucket.num_prefill_tokens else 0
        return bucket.num_decode + (self.max_num_prefill_seqs if bucket.num_decode and self.shared_sampler_rows
                                    else num_prefill_seqs)

    def empty_batch(self, bucket: Bucket) -> dict[str, np.ndarray]:
        """All-padding arrays of one bucket's shapes (padding tokens write into the null page)."""
        dec, pre, P = bucket.num_decode, bucket.num_prefill_tokens, bucket.pages_per_seq
        num_prefill_seqs = bucket.num_verify or (self.max_num_prefill_seqs if pre else 0)
        T = dec + pre
        num_rows = self.num_rows(bucket)
        return dict(
            token_ids=np.zeros(T, np.int32),  # [T]
            positions=np.zeros(T, np.int32),  # [T]
            slot_mapping=np.zeros(T, np.int32),  # [T]
            decode_block_table=np.zeros((dec, P), np.int32),  # [num_decode, pages]
            decode_seq_lens=np.zeros(dec, np.int32),  # [num_decode]
            prefill_block_table=np.zeros((num_prefill_seqs, P), np.int32),  # [num_prefill_seqs, pages]
            prefill_seq_lens=np.zeros(num_prefill_seqs, np.int32),  # [num_prefill_seqs]
            prefill_query_start_loc=np.zeros(num_prefill_seqs + 1, np.int32),  # [num_prefill_seqs + 1]
            logits_indices=np.zeros(num_rows, np.int32))  # [rows]


@dataclasses.dataclass(frozen=True)
class StepOutput:
    """Host copies of what one step sampled, one row per row of its batch (decode rows, then
    prefill chunks; in a verification step one row per verify row, with a draw at each of its
    K + 1 positions: an extra axis after the rows), and what the step cost."""
    token_ids: np.ndarray  # int32[num_rows] (verification: [num_rows, K + 1]; multi-step: [num_rows, n])
    logprobs: np.ndarray | None  # float32[num_rows]; None when no row asked for logprobs
    top_ids: np.ndarray | None  # int32[num_rows, max_logprobs]
    top_logprobs: np.ndarray | None  # float32[num_rows, max_logprobs]
    bucket: Bucket  # the shape the step ran in
    device_seconds: float  # jitted forward + sampler: host arrays in, sampled ids out
    host_seconds: float  # the runner's host work: packing the arrays, slicing the results
    # Per row of the batch: None, or for a prefill chunk with prompt-logprob rows the arrays of
    # `prompt_logprobs.compute` for them (logprobs, ranks [n]; top_ids, top_logprobs [n, max_logprobs]).
    prompt_logprobs: list[dict[str, np.ndarray] | None] | None = None
    # The pooling runner: each prefill chunk's pooled partial, float32 [chunks, hidden] (or a classifier's
    # activated scores [chunks, labels]), in the batch's prefill order (jaxserve.pooling.poolers).
    pooled: np.ndarray | None = None
