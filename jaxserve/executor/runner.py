"""ModelRunner: ScheduledBatch -> fixed-shape numpy arrays -> one jitted step -> sampled ids.

The runner works from the scheduler's plain step data (`jaxserve.core.step.ScheduledBatch`) alone; it never
sees a `Request`. Shapes come from a small set of buckets (`BucketSet`): decode rows x prefill
tokens x block table width (one full width, the longest context's, wherever the attention's cost
follows the contexts present: BucketSet); every step pads to the smallest bucket that holds it
(while a background warm-up still compiles that one, to compiled ones: `shape_choice`), so after
warm-up no step compiles again. The executables live in one `ExecutableCache` that the warm-up
fills. The KV cache is donated to the step and updated in place. The jitted functions come from
`step_functions.build`; each step reaches the devices through the runner's transport
(`transport.LocalTransport`, or a multi-host front's: `use_transport`).

Two extras ride on the step without new shapes. Structured output: the sampler's `token_bitmask`
input is always there (all ones), and the rows of requests with a grammar get their allowed
tokens written in on the host (`structured_output.fill_bitmasks`) after the forward is dispatched,
so that work overlaps the device's. Prompt logprobs: the forward also returns the residual rows
of its prefill tokens, and a third jitted function (`prompt_logprobs.compute`, compiled per
bucket of rows) turns the wanted ones into logprobs, ranks and top-k on device; only those
[rows] / [rows, k] arrays cross to the host, in the step's one `device_get`.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

import cpu_kernels

from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.core import encoder_cache, structured_output
from jaxserve.core.outputs import StepInputError
from jaxserve.core.step import Bucket, ScheduledBatch, StepOutput, geometric_buckets, prompt_logprob_rows_limit
from jaxserve.executor import (decode_loop, device_setup, executable_cache, executables, kv_transfer, lora_slots,
                               prompt_logprobs, sampler, shape_choice, step_functions, transport,
                               vision_encoder)
from jaxserve.executor import warmup as warmup_lib
from jaxserve.models import cpu_layout, llama, prompt_activations
from jaxserve.models import lora as lora_lib
from jaxserve.multimodal.inputs import GEMMA3_ARCHITECTURE

log = logging.getLogger(__name__)


class ModelRunner:
    """Owns the weights and the KV cache on device; runs one step per ScheduledBatch."""

    def __init__(self, config: ModelConfig, params, engine_config: EngineConfig, *, num_pages: int,
                 max_model_len: int, shardings=None, eos_token_ids: Sequence[int] | None = None,
                 pooler=None, score_head: np.ndarray | None = None, vision=None):
        """The step of `config`'s model under `engine_config` (page size, limits, attention backend,
        KV cache dtype, max_logprobs) over a pool of `num_pages` pages (null page included) for
        sequences of at most `max_model_len`; on the mesh of `shardings` when given.
        `eos_token_ids` (default: the config's) are masked for rows short of their min_tokens.
        `pooler` (a jaxserve.pooling.config.PoolerConfig) makes it the pooling runner: its steps are
        prefill chunks only, each pooled (`score_head` [labels, hidden]: a classifier's), no sampler.
        `vision`: a vision-language model's tower (module, config, params), run in the steps."""
        self.config = config
        self.pooler = pooler
        self.page_size = engine_config.page_size
        self.num_pages = num_pages
        self.max_model_len = max_model_len
        self.max_pages_per_seq = -(-max_model_len // self.page_size)
        self.max_num_prefill_seqs = engine_config.max_num_prefill_seqs
        self.max_logprobs = engine_config.max_logprobs
        self.num_scheduler_steps = engine_config.num_scheduler_steps  # > 1: n decode steps in one call
        self.cpu_int8_activations = engine_config.cpu_int8_activations
        self.cpu_prompt_dtype = engine_config.cpu_prompt_dtype
        self.eos_token_ids = tuple(sorted(config.eos_token_ids if eos_token_ids is None else eos_token_ids))
        self.backend = device_setup.attention_backend(engine_config.attention_backend)
        self.buckets = step_functions.bucket_set(engine_config, self.backend, max_model_len)
        # The pooling runner's steps are prefill chunks only: no decode rows ever.
        self._bucket_list = tuple(b for b in self.buckets.all() if pooler is None or not b.num_decode)
        # Prompt logprobs: the forward also returns its prefill rows of the residual stream, padded
        # to the largest prefill bucket; a third jitted function turns the wanted ones (a bucket of
        # rows, at most the scheduler's per-step limit) into logprobs, on device.
        self.prompt_logprob_buckets = geometric_buckets(8, prompt_logprob_rows_limit(engine_config))
        self.warmup_prompt_logprobs = engine_config.warmup_prompt_logprobs  # in the warm-up's first phase
        # Sharded: weights placed on the mesh; the step runs `shardings.model_config` (the same
        # model, with KV heads replicated when tensor parallelism exceeds them).
        self.params = params if shardings is None else shardings.place(params)
        # Prompt chunks with 8-bit activations on an accelerator (EngineConfig.gpu_prompt_dtype).
        self.params = prompt_activations.mark(self.params, engine_config.gpu_prompt_dtype)
        step_config = config if shardings is None else shardings.model_config
        # What the forward reads: on the CPU a view of each layer's weights (no copy; XLA would
        # copy a layer's slice of the stacked weights in every step), else self.params.
        self._step_params = cpu_layout.layer_views(self.params, int8_activations=self.cpu_int8_activations,
                                                   prompt_dtype=self.cpu_prompt_dtype,
                                                   float32_attention=self.backend in cpu_layout.FLOAT32_ATTENTION_BACKENDS)
        # (a float32 model's matrices are then the kernel's strips alone: the stored ones are freed)
        self.params = cpu_layout.stored_params_left(self.params, self._step_params)
        # LoRA: the adapter slab travels with the weights (the step's params["lora"]); a slot's
        # write replaces it in place and never recompiles (jaxserve.models.lora).
        self.lora = None
        if engine_config.enable_lora:
            lora_dtype = engine_config.dtype if engine_config.lora_dtype == "auto" else engine_config.lora_dtype
            self.lora = lora_slots.LoRASlots(step_config, engine_config, device_setup.param_dtype(lora_dtype))
            self._step_params = {**self._step_params, "lora": self.lora.init(shardings)}
        self._head = prompt_logprobs.head_params(self.params)
        # "auto": the step's activations' dtype (the norms keep it: float32 for a bfloat16 model
        # on the CPU, see cpu_layout.bfloat16_views; else the model's float dtype)
        activations = self._step_params["final_norm"].dtype
        self.kv_cache_dtype = device_setup.kv_cache_dtype(engine_config.kv_cache_dtype) or activations
        device_setup.check_attention_operands(self.backend, config, activations, self.kv_cache_dtype, self.page_size)
        self.vision = None if vision is None else self._vision_encoder(vision, engine_config, activations)
        self._new_kv_cache = functools.partial(
            llama.init_kv_cache, step_config, llama.KVCacheSpec(num_pages, self.page_size), self.kv_cache_dtype,
            None if shardings is None else shardings.kv_cache)
        self.kv_cache = self._new_kv_cache()
        # The step's jitted functions, all on device (logits never reach the host): the sampler's
        # shapes depend only on the number of rows, so it compiles far fewer times.
        self._functions = step_functions.build(
            step_config, self._step_params, backend=self.backend, page_size=self.page_size, max_logprobs=self.max_logprobs,
            prefill_hidden_rows=max(self.buckets.prefill), verify_row_tokens=self.buckets.verify_row_tokens,
            shardings=shardings, pooling=None if pooler is None else (
                pooler.pooling_type, pooler.classifier.activation if pooler.classifier else ""))
        self._score_head = None if score_head is None else jnp.asarray(score_head, jnp.float32)  # [labels, hidden]
        self.transport = transport.LocalTransport()
        self.kv_store: kv_transfer.HostKVStore | None = None  # KV offload's bytes (enable_kv_offload)
        self.warmup_enabled = engine_config.warmup
        self.draft = None  # a draft_proposer.DraftProposer mirroring every step (speculative_method=draft)
        # Every compiled executable of the step (filled by warmup(), asked by every step).
        self.executables = executable_cache.ExecutableCache(
            self._open_executable_store(engine_config, step_config, shardings))
        self.warmup_state: warmup_lib.WarmupState | None = None  # None: no warm-up started
        self._warmup_plan: warmup_lib.WarmupPlan | None = None  # once one started
        self._hidden_rows = None  # the forward's prefill hidden rows (jax.ShapeDtypeStruct), once asked

    def use_transport(self, transport) -> None:
        """Routes every later step through `transport` (LocalTransport's `run`, `can_recover`,
        `failure` and `health`): a multi-host front's sends each step to the other processes
        before it runs here."""
        self.transport = transport

    def _open_executable_store(self, engine_config: EngineConfig, step_config: ModelConfig,
                               shardings) -> executables.ExecutableStore | None:
        """Where warm-up loads and saves its compiled shapes: the folder of --executables (strict),
        of --save_executables, else the automatic store beside the compilation cache (single
        process only: a multi-host job compiles together)."""
        if jax.process_count() > 1:
            return None
        description = executables.engine_description(
            model_config=step_config, backend=self.backend, buckets=self.buckets,
            prompt_logprob_buckets=self.prompt_logprob_buckets, page_size=self.page_size, num_pages=self.num_pages,
            max_model_len=self.max_model_len, max_logprobs=self.max_logprobs, eos_token_ids=self.eos_token_ids,
            num_scheduler_steps=self.num_scheduler_steps, cpu_int8_activations=self.cpu_int8_activations,
            mesh=None if shardings is None else shardings.mesh, params=self._step_params, kv_cache=self.kv_cache)
        if engine_config.executables is not None:
            return executables.ExecutableStore(engine_config.executables, description, mode="load")
        if engine_config.save_executables is not None:
            return executables.ExecutableStore(engine_config.save_executables, description, mode="save")
        directory = executables.default_directory()
        return None if directory is None else executables.ExecutableStore(directory, description)

    # ---- shapes ---------------------------------------------------------------------------
    def bucket_for(self, num_decode: int, num_prefill_tokens: int, pages_per_seq: int) -> Bucket:
        return self.buckets.fit(num_decode, num_prefill_tokens, pages_per_seq)

    def all_buckets(self) -> list[Bucket]:
        return list(self._bucket_list)

    # ---- host arrays ----------------------------------------------------------------------
    def _slots(self, page_ids: Sequence[int], start: int, stop: int) -> np.ndarray:
        """KV slots (page * page_size + offset) of positions start .. stop - 1. int32[stop - start]."""
        positions = np.arange(start, stop)
        pages = np.asarray(page_ids, np.int32)[positions // self.page_size]
        return pages * self.page_size + positions % self.page_size

    def build_batch(self, batch: ScheduledBatch, bucket: Bucket | None = None
                    ) -> tuple[Bucket, dict[str, np.ndarray], list]:
        """Pads the batch into `bucket` (default: the smallest that holds it). Returns (bucket, step
        arrays, the ScheduledRow of each sampled row: decode rows at 0.., prefill chunks at
        bucket.num_decode..; None for padding).
        A verification step's sampled rows are [row, position] (K + 1 per row)."""
        if batch.verify:
            return self._build_verify_batch(batch)
        bucket = bucket or self.bucket_for(len(batch.decode), batch.num_prefill_tokens, batch.max_pages_per_seq)
        arrays = self.empty_batch(bucket)
        dec_bucket = bucket.num_decode
        token_ids, positions, slot_mapping = arrays["token_ids"], arrays["positions"], arrays["slot_mapping"]
        decode_block_table, decode_seq_lens = arrays["decode_block_table"], arrays["decode_seq_lens"]
        prefill_block_table, prefill_seq_lens = arrays["prefill_block_table"], arrays["prefill_seq_lens"]
        query_start_loc, logits_indices = arrays["prefill_query_start_loc"], arrays["logits_indices"]
        query_start_loc[:] = batch.num_prefill_tokens
        rows: list = [None] * len(logits_indices)

        for i, row in enumerate(batch.decode):
            token_ids[i] = row.token_ids[0]
            positions[i] = row.start
            slot_mapping[i] = row.page_ids[row.start // self.page_size] * self.page_size + row.start % self.page_size
            decode_block_table[i, :len(row.page_ids)] = row.page_ids
            decode_seq_lens[i] = row.end
            logits_indices[i] = i
            rows[i] = row
            if row.lora_slot:
                arrays["lora_slots"][i] = row.lora_slot
        offset = 0
        for j, row in enumerate(batch.prefill):
            n = len(row.token_ids)
            t0 = dec_bucket + offset
            token_ids[t0:t0 + n] = row.token_ids
            positions[t0:t0 + n] = np.arange(row.start, row.end)
            slot_mapping[t0:t0 + n] = self._slots(row.page_ids, row.start, row.end)
            prefill_block_table[j, :len(row.page_ids)] = row.page_ids
            prefill_seq_lens[j] = row.end
            query_start_loc[j] = offset
            offset += n
            if self.pooler is None:  # (the pooling runner's step has no logit rows)
                logits_indices[dec_bucket + j] = t0 + n - 1
                rows[dec_bucket + j] = row
            if row.lora_slot:
                arrays["lora_slots"][t0:t0 + n] = row.lora_slot
        if self.vision is not None:
            vision_encoder.fill_image_arrays(arrays, batch, dec_bucket)
        return bucket, arrays, rows

    def _build_verify_batch(self, batch: ScheduledBatch) -> tuple[Bucket, dict[str, np.ndarray], list]:
        """A verification step: each row's tokens (its last token and proposals) as one ragged
        chunk, logits at each of its K + 1 positions (padding positions repeat its last token).
        Position p samples the row's output step + p, after proposals 0 .. p - 1 (its history,
        for penalties), with that step's random key: what a decode step there would draw."""
        width = self.buckets.verify_row_tokens
        bucket = self.buckets.fit_verify(len(batch.verify), batch.max_pages_per_seq)
        arrays = self.empty_batch(bucket)
        arrays["prefill_query_start_loc"][:] = batch.num_verify_tokens
        rows: list = [None] * len(arrays["logits_indices"])
        offset = 0
        for j, row in enumerate(batch.verify):
            n = len(row.token_ids)
            arrays["token_ids"][offset:offset + n] = row.token_ids
            arrays["positions"][offset:offset + n] = np.arange(row.start, row.end)
            arrays["slot_mapping"][offset:offset + n] = self._slots(row.page_ids, row.start, row.end)
            arrays["prefill_block_table"][j, :len(row.page_ids)] = row.page_ids
            arrays["prefill_seq_lens"][j] = row.end
            arrays["prefill_query_start_loc"][j] = offset
            arrays["logits_indices"][j * width:(j + 1) * width] = offset + np.minimum(np.arange(width), n - 1)
            if row.lora_slot:
                arrays["lora_slots"][offset:offset + n] = row.lora_slot
            for p in range(n):
                rows[j * width + p] = dataclasses.replace(row, sampling=_position_params(row, p))
            offset += n
        return bucket, arrays, rows

    def empty_batch(self, bucket: Bucket) -> dict[str, np.ndarray]:
        arrays = self.buckets.empty_batch(bucket)
        if self.pooler is not None:  # no logits: the step pools its prefill rows instead
            arrays["logits_indices"] = np.zeros(0, np.int32)
        if self.lora is not None:  # each token's adapter slot (0, the base model, for padding)
            arrays["lora_slots"] = np.zeros_like(arrays["token_ids"])
        if self.vision is not None:
            vision_encoder.add_image_arrays(arrays, bucket, mrope=self.config.mrope_section is not None,
                                            bidirectional=self.config.multimodal_architecture == GEMMA3_ARCHITECTURE)
        return arrays

    # ---- images -----------------------------------------------------------------------------
    def _vision_encoder(self, vision, engine_config: EngineConfig, dtype) -> vision_encoder.VisionEncoder:
        """The tower (module, config, params) and its image-embedding pool, which travels with the
        weights (as the LoRA slab) in `dtype`, the step's activations'."""
        encoder = vision_encoder.VisionEncoder(
            *vision, hidden_size=self.config.hidden_size, num_rows=encoder_cache.pool_rows(engine_config),
            dtype=dtype, max_image_tokens=encoder_cache.max_image_tokens(engine_config),
            cpu_kernels=self.backend == "xla" and not device_setup.on_gpu() and cpu_kernels.available())
        self._step_params = {**self._step_params, "image_embeddings": encoder.pool}
        return encoder

    def encoder_shapes(self) -> list:
        """The vision encoder's shapes (none for a text model), compiled with the first phase."""
        return [] if self.vision is None else self.vision.shapes()

    def lower_encoder(self, size):
        return self.vision.lower(size)

    def recover_images(self) -> None:
        """After a failed step: a new (zero) image-embedding pool if the failure consumed it."""
        if self.vision.pool.is_deleted():
            self.vision.pool = self.vision.new_pool()
        self._step_params["image_embeddings"] = self.vision.pool

    def _encode_images(self, jobs) -> None:
        """Runs the step's encoder jobs into the image-embedding pool the forward reads."""
        compiled = lambda size: self.executables.get("encoder", size)  # noqa: E731 (the warm-up's, or None)
        self._step_params["image_embeddings"] = self.vision.run(jobs, compiled)

    # ---- LoRA -----------------------------------------------------------------------------
    def write_lora_slot(self, slot: int, adapter) -> None:
        """Puts `adapter` (checkpoints.lora_adapter.LoRAAdapter) in slab slot `slot` (1..max_loras)."""
        self._step_params["lora"] = self.lora.write(self._step_params["lora"], slot, adapter)

    def clear_lora_slot(self, slot: int) -> None:
        """Slot `slot` back to the zero adapter."""
        self._step_params["lora"] = lora_lib.clear_slot(self._step_params["lora"], slot)

    # ---- multi-step decoding --------------------------------------------------------------
    def multi_step_buckets(self) -> list[Bucket]:
        """The decode-only buckets, each also compiled as n steps in one call (n > 1)."""
        if self.num_scheduler_steps < 2:
            return []
        return [b for b in self.all_buckets() if b.num_prefill_tokens == 0 and not b.num_verify]

    def _multi_step_inputs(self, bucket: Bucket, rows: Sequence, num_steps: int):
        """The arrays and stacked per-step sampling inputs of `decode_loop.decode_steps` for the
        decode `rows` (ScheduledRows; padded to the bucket); step i samples output step + i."""
        try:
            arrays, sampling = decode_loop.pack_inputs(
                [(row.token_ids[0], row.start, row.page_ids, row.sampling) for row in rows],
                num_rows=bucket.num_decode, table_width=bucket.pages_per_seq, num_steps=self.num_scheduler_steps,
                history_len=self.max_model_len, penalties=False, bias=sampler.ALWAYS_BIAS, eos_token_ids=self.eos_token_ids)
        except sampler.RowInputError as e:
            raise StepInputError(rows[e.row_index].request_id, str(e)) from e
        return arrays, sampling, np.int32(num_steps)

    def _execute_multi_step(self, batch: ScheduledBatch, start: float) -> StepOutput:
        bucket = self.bucket_for(len(batch.decode), 0, batch.max_pages_per_seq)
        arrays, sampling, num_steps = self._multi_step_inputs(bucket, batch.decode, batch.num_steps)
        device_start = time.perf_counter()
        compiled = self.executables.get("multi_step", bucket) or self._functions.multi_step
        tokens, self.kv_cache = compiled(self._step_params, self.kv_cache, arrays, sampling, num_steps)
        tokens = np.asarray(jax.device_get(tokens))[:len(batch.decode), :batch.num_steps]  # [rows, num_steps]
        device_seconds = time.perf_counter() - device_start
        return StepOutput(token_ids=tokens, logprobs=None, top_ids=None, top_logprobs=None, bucket=bucket,
                          device_seconds=device_seconds,
                          host_seconds=time.perf_counter() - start - device_seconds)

    def _sampling_inputs(self, rows: list, histories: bool | None = None) -> dict[str, np.ndarray]:
        """The sampler's inputs of the rows; with the token histories when `histories` (None:
        when a row has a penalty)."""
        try:
            return sampler.build_sampling_inputs([None if row is None else row.sampling for row in rows],
                                                 len(rows), self.max_model_len, histories, bias=sampler.ALWAYS_BIAS,
                                                 eos_token_ids=self.eos_token_ids, vocab_size=self.config.vocab_size)
        except sampler.RowInputError as e:
            raise StepInputError(rows[e.row_index].request_id, str(e)) from e

    def _prompt_logprob_inputs(self, batch: ScheduledBatch) -> tuple[dict[str, np.ndarray], list] | None:
        """The prompt-logprob rows of a step: `indices` (into the prefill tokens) and `targets`,
        int32[a prompt-logprob bucket] (padding: row 0, token 0), and per prefill chunk its
        (first, count) of them or None. None when no chunk wants prompt logprobs."""
        indices, targets, spans, offset = [], [], [], 0
        for row in batch.prefill:
            wanted = row.prompt_logprobs
            spans.append(None if wanted is None else (len(indices), len(wanted.targets)))
            if wanted is not None:
                first = offset + wanted.first - row.start
                indices.extend(range(first, first + len(wanted.targets)))
                targets.extend(wanted.targets)
            offset += len(row.token_ids)
        if not indices:
            return None
        size = shape_choice.prompt_logprob_rows(self.prompt_logprob_buckets, len(indices), self.executables)
        if size is None:
            raise ValueError(f"{len(indices)} prompt-logprob rows exceed the step's {self.prompt_logprob_buckets[-1]}")
        arrays = {"indices": np.zeros(size, np.int32), "targets": np.zeros(size, np.int32)}
        arrays["indices"][:len(indices)] = indices
        arrays["targets"][:len(targets)] = targets
        return arrays, spans

    # ---- device ---------------------------------------------------------------------------
    def execute(self, batch: ScheduledBatch) -> StepOutput:
        """Runs one step: host arrays in, sampled ids (and logprobs) out; the only crossing.

        While a background warm-up has not compiled the step's shape, a mixed step whose decode
        and prefill halves each have a compiled shape runs as those two (shape_choice.split).
        Raises StepInputError naming the request whose inputs could not be packed (nothing ran);
        any other exception comes from the device step (see `recover`)."""
        if batch.encode:
            self._encode_images(batch.encode)
        if self.pooler is not None:
            return self._execute_pool(batch)
        if batch.num_steps > 1:
            return self._execute_multi_step(batch, time.perf_counter())
        bucket = self._serving_bucket(batch)
        halves = shape_choice.split(batch, bucket, self._serving_bucket, self._runs_now)
        if halves is None:
            return self._execute_one(batch, bucket)
        return shape_choice.merge_outputs([self._execute_one(half, bucket) for half, bucket in halves])

    def _execute_pool(self, batch: ScheduledBatch) -> StepOutput:
        """The pooling runner's step: the prefill chunks' pooled partials [chunks, D or L] back to
        the host (no logits, no sampler); token_ids are zeros, one per chunk (no output token)."""
        start = time.perf_counter()
        bucket, arrays, _ = self.build_batch(batch)
        key = self.pool_key(bucket)
        device_start = time.perf_counter()
        compiled = self.executables.get("pool", key) or self._functions.pool
        pooled, self.kv_cache = compiled(self._step_params, self.kv_cache, arrays, self._score_head)
        pooled = np.asarray(jax.device_get(pooled))[:len(batch.prefill)]
        device_seconds = time.perf_counter() - device_start
        return StepOutput(token_ids=np.zeros(len(batch.prefill), np.int32), logprobs=None, top_ids=None,
                          top_logprobs=None, bucket=bucket, device_seconds=device_seconds,
                          host_seconds=time.perf_counter() - start - device_seconds, pooled=pooled)

    def pool_key(self, bucket: Bucket) -> tuple:
        """The executable cache's key of the pooled step of `bucket`: the bucket, the pooling type and
        a classifier's activation (saved executables of one model pooled two ways differ by it)."""
        return (bucket, self.pooler.pooling_type, self.pooler.classifier.activation if self.pooler.classifier else "")

    def lower_pool(self, key: tuple):
        """The pooled step of a `pool_key`, lowered for the warm-up to compile."""
        arrays = self.empty_batch(key[0])
        return self._functions.pool.lower(self._step_params, self.kv_cache, arrays, self._score_head)

    def _runs_now(self, batch: ScheduledBatch, bucket: Bucket) -> bool:
        """Whether `batch` runs now in `bucket`'s compiled forward and sampler, without waiting."""
        return (self.executables.ready("forward", bucket)
                and self.executables.ready("sample", self._sampler_key(bucket, self._with_histories(batch, bucket))))

    def _serving_bucket(self, batch: ScheduledBatch) -> Bucket:
        """The bucket the step runs in: its own, or while that one is still compiling the
        smallest compiled one that holds it (shape_choice.compiled_bucket_holding)."""
        if batch.verify:
            return self.buckets.fit_verify(len(batch.verify), batch.max_pages_per_seq)
        bucket = self.bucket_for(len(batch.decode), batch.num_prefill_tokens, batch.max_pages_per_seq)
        return shape_choice.compiled_bucket_holding(
            bucket, self._bucket_list, self.executables,
            lambda b: self._sampler_key(b, self._with_histories(batch, b)))

    def _with_histories(self, batch: ScheduledBatch, bucket: Bucket) -> bool:
        """Whether the step samples with the variant that reads token histories: when a row has
        a penalty, and while only that variant of the bucket's rows is compiled (the warm-up
        compiles it first: neutral penalties change no logit, so it serves every row)."""
        if any(row.sampling is not None and row.sampling.has_penalties for row in batch.rows):
            return True
        return (not self.executables.ready("sample", self._sampler_key(bucket, False))
                and self.executables.ready("sample", self._sampler_key(bucket, True)))

    def _sampler_key(self, bucket: Bucket, penalties: bool) -> tuple[int, bool, bool]:
        return (self.buckets.num_rows(bucket), penalties, sampler.ALWAYS_BIAS)

    def _execute_one(self, batch: ScheduledBatch, bucket: Bucket) -> StepOutput:
        start = time.perf_counter()
        bucket, arrays, rows = self.build_batch(batch, bucket)
        sampling = self._sampling_inputs(rows, self._with_histories(batch, bucket))
        prompt_rows = self._prompt_logprob_inputs(batch)
        grammars = [(i, row.sampling.grammar) for i, row in enumerate(rows)
                    if row is not None and row.sampling is not None and row.sampling.grammar is not None]
        device_start = time.perf_counter()
        out, prompt_out = jax.device_get(self.transport.run(self.run_step, bucket, arrays, sampling, grammars,
                                                             None if prompt_rows is None else prompt_rows[0]))
        device_seconds = time.perf_counter() - device_start
        prompt = None
        if prompt_rows is not None:
            spans = [None] * len(batch.decode) + prompt_rows[1]
            prompt = [None if span is None else {name: np.asarray(a)[span[0]:span[0] + span[1]]
                                                 for name, a in prompt_out.items()} for span in spans]
        keep = list(range(len(batch.decode))) + [bucket.num_decode + j for j in range(len(batch.prefill))]
        want_logprobs = any(row.sampling is not None and row.sampling.params.logprobs is not None
                            for row in batch.rows)
        names = ("token_ids", "logprobs", "top_ids", "top_logprobs") if want_logprobs else ("token_ids",)
        if batch.verify:  # [rows, K + 1, ...]: every position of each verify row
            width = self.buckets.verify_row_tokens
            kept = {name: np.asarray(out[name])[:len(batch.verify) * width].reshape(
                len(batch.verify), width, *np.shape(out[name])[1:]) for name in names}
        else:
            kept = {name: np.asarray(out[name])[keep] for name in names}
        return StepOutput(token_ids=kept["token_ids"], logprobs=kept.get("logprobs"), top_ids=kept.get("top_ids"),
                          top_logprobs=kept.get("top_logprobs"), bucket=bucket, device_seconds=device_seconds,
                          host_seconds=time.perf_counter() - start - device_seconds, prompt_logprobs=prompt)

    # ---- KV offload ---------------------------------------------------------------------------
    def enable_kv_offload(self, host_bytes: int, disk_path: str | None = None, disk_bytes: int = 0
                          ) -> tuple[int, int, int]:
        """Makes KV offload's store (kv_transfer.HostKVStore): `host_bytes` of host memory and
        `disk_bytes` of a file under `disk_path`, in whole pages of the pool; compiles its copies
        when the runner warms up. Returns (host blocks, disk slots, bytes per page). ValueError
        when a tier holds no page or the disk tier cannot be made (kv_transfer.check_disk_tier)."""
        per_page = kv_transfer.page_bytes(self.kv_cache, self.num_pages)
        num_host, num_disk = host_bytes // per_page, disk_bytes // per_page
        if num_host < 1:
            raise ValueError(f"--kv_offloading_size holds no KV page: one page of this model takes {per_page:,} bytes")
        if disk_path is not None and num_disk < 1:
            raise ValueError(f"--kv_offloading_disk_size holds no KV page: one page takes {per_page:,} bytes")
        if disk_path is not None:
            kv_transfer.check_disk_tier(disk_path, num_disk * per_page)
        self.kv_store = kv_transfer.HostKVStore(self.kv_cache, self.num_pages, num_host, disk_path, num_disk)
        if self.warmup_enabled:
            self.kv_store.compile(self.kv_cache)
        return num_host, num_disk, per_page

    def start_kv_transfers(self, transfers) -> None:
        """Runs a step's KV offload copies (kv_offload.KVTransfers) before the step: see kv_transfer."""
        self.kv_cache = self.kv_store.start(self.kv_cache, transfers)

    def land_kv_saves(self) -> None:
        self.kv_store.land_saves()

    def drop_kv_saves(self) -> None:
        self.kv_store.drop_saves()

    def recover(self) -> bool:
        """After a failed step: rebuilds the KV cache if the step consumed it (donated buffers
        are deleted once a call takes them). Returns whether it was rebuilt, i.e. every cached
        K/V is lost and the requests that had any must be recomputed. Never after a failed
        multi-host job (its transport refuses: the processes' caches could no longer be kept equal)."""
        if not self.transport.can_recover():
            return False
        if self.draft is not None:
            self.draft.recover()
        if not any(leaf.is_deleted() for leaf in jax.tree_util.tree_leaves(self.kv_cache)):
            return False
        self.kv_cache = self._new_kv_cache()
        return True

    # ---- compiling ------------------------------------------------------------------------
    def warmup(self, background: bool = False, is_serving: Callable[[], bool] = lambda: False) -> int:
        """Compiles the step for every bucket, ahead of time and on all cores (see
        jaxserve.executor.warmup: the first requests' shapes first; with `background` the call
        returns at once, `warmup_state` reports the progress and a shape starts only while
        `is_serving()` is false or a step waits for a shape). Returns the count of shapes."""
        plan = self._warmup_plan = warmup_lib.WarmupPlan(self, is_serving)
        self.warmup_state = plan.state
        return plan.run(background)

    def stop_warmup(self) -> None:
        """Ends a background warm-up early: the shapes not started are skipped (for a shutdown,
        once nothing steps any more)."""
        if self._warmup_plan is not None:
            self._warmup_plan.stop()

    def first_request_shapes(self) -> tuple[list[Bucket], list[tuple[int, bool, bool]]]:
        """What a first request needs: the prefill-only and decode-only steps, and their
        samplers with penalties (which serve every request; those without come later)."""
        first = [b for b in self.all_buckets() if not b.num_verify and not (b.num_decode and b.num_prefill_tokens)]
        return first, list(dict.fromkeys(self._sampler_key(b, True) for b in first))

    def sampler_shapes(self) -> list[tuple[int, bool, bool]]:
        """Every sampler shape of the step: (rows, penalties, bias)."""
        rows = sorted({key[0] for key in (self._sampler_key(b, False) for b in self.all_buckets())})
        return [(n, penalties, sampler.ALWAYS_BIAS) for n in rows for penalties in (False, True)]

    def lower_forward(self, bucket: Bucket):
        """The forward of `bucket`, lowered (jax.stages.Lowered) for the warm-up to compile."""
        return self._functions.forward_for(bucket).lower(self._step_params, self.kv_cache, self.empty_batch(bucket))

    def lower_sampler(self, key: tuple[int, bool, bool]):
        num_rows, penalties, bias = key
        logits = jax.ShapeDtypeStruct((num_rows, self.config.vocab_size), jnp.float32)
        sampling = sampler.build_sampling_inputs([None] * num_rows, num_rows, self.max_model_len, penalties,
                                                 bias, self.eos_token_ids, vocab_size=self.config.vocab_size)
        return self._functions.sample.lower(logits, sampling)

    def lower_multi_step(self, bucket: Bucket):
        arrays, sampling, num_steps = self._multi_step_inputs(bucket, [], self.num_scheduler_steps)
        return self._functions.multi_step.lower(self._step_params, self.kv_cache, arrays, sampling, num_steps)

    def lower_prompt_logprobs(self, num_rows: int):
        if self._hidden_rows is None:  # the forward's prefill rows of the residual stream
            bucket = next(b for b in self.all_buckets() if b.num_prefill_tokens)
            hidden = jax.eval_shape(self._functions.forward_for(bucket), self._step_params, self.kv_cache,
                                    self.empty_batch(bucket))[2]
            self._hidden_rows = jax.ShapeDtypeStruct(hidden.shape, hidden.dtype)
        rows = jax.ShapeDtypeStruct((num_rows,), jnp.int32)
        return self._functions.prompt_logprobs.lower(self._head, self._hidden_rows, rows, rows)

    def time_forward(self, bucket: Bucket, arrays: dict[str, np.ndarray]) -> float:
        """Seconds of one call of `bucket`'s forward on `arrays` (its shapes, from build_batch),
        results waited for; compiled first (into the executable cache) if no warm-up has. For
        measuring the buckets (jaxserve.planning.bucket_measure): it writes the arrays' K/V
        slots, so only on an engine that serves nothing."""
        compiled = self.executables.get("forward", bucket) or self.executables.load_or_compile(
            "forward", bucket, lambda: self.lower_forward(bucket))
        start = time.perf_counter()
        logits, self.kv_cache, _ = compiled(self._step_params, self.kv_cache, arrays)
        jax.block_until_ready((logits, self.kv_cache))
        return time.perf_counter() - start

    def run_step(self, bucket: Bucket, arrays, sampling, grammars=(), prompt_rows=None):
        """Dispatches the step's jitted functions (forward, sampler, prompt logprobs when
        `prompt_rows` is given) on its inputs (host or device arrays); returns their device
        outputs (sampler's, prompt logprobs' or None). The transport calls it (a multi-host
        worker too). The grammar rows' bitmasks are filled on the host while the forward runs."""
        forward = self.executables.on_first_use("forward", bucket, self.lower_forward)
        logits, self.kv_cache, hidden = forward(self._step_params, self.kv_cache, arrays)
        if self.draft is not None:  # the draft's K/V of the same tokens, in the same slots
            self.draft.mirror(bucket, arrays)
        structured_output.fill_bitmasks(grammars, sampling["token_bitmask"])
        key = (logits.shape[0], sampler.has_histories(sampling), sampler.has_bias(sampling))
        sampled = self.executables.on_first_use("sample", key, self.lower_sampler)(logits, sampling)
        if prompt_rows is None:
            return sampled, None
        compute = (self.executables.get("prompt_logprobs", len(prompt_rows["indices"]))
                   or self._functions.prompt_logprobs)
        return sampled, compute(self._head, hidden, prompt_rows["indices"], prompt_rows["targets"])


def _position_params(row, position: int):
    """How position `position` of a verify row is sampled: its output step, and (for penalties)
    its history with the proposals before it."""
    sampling = row.sampling
    if position == 0:
        return sampling
    history = sampling.output_token_ids
    if sampling.has_penalties:
        history = tuple(history) + tuple(row.token_ids[1:position + 1])
    return dataclasses.replace(sampling, step=sampling.step + position, output_token_ids=history)
