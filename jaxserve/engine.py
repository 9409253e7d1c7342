"""Engine: continuous batching over the paged KV cache.

`Engine` is synchronous: `add_request`, `abort` and `step` (one scheduled model step, returning a
delta per request that advanced). `jaxserve.async_engine.AsyncEngine` runs it for asyncio callers.

The engine is the core: scheduling, the model step, stop tokens and length limits, recovery from
a failed step. Each step's per-request results go, as `CoreOutput`s, to the output side
(`jaxserve.core.output_processor`: detokenization, stop strings, logprobs), and each step that ran
leaves one `StepRecord` (shape, work, device and host time) for benchmarks and metrics.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import time
import uuid
from typing import Callable, Sequence

from checkpoints import load  # Engine.from_model and the draft model open what --model names
from checkpoints import lora_adapter, pooling_checkpoint
from jaxserve.config import EngineConfig
from jaxserve.core.output_processor import CoreOutput, OutputProcessor, RowLogprobs
from jaxserve.core.outputs import (EngineStats, FinishedRequest, RequestOutput, StepInputError, StepRecord,
                                   merge_deltas, prompt_logprob_entries, with_metrics)
from jaxserve.core.encoder_cache import EncoderCache, pool_rows
from jaxserve.core.kv_offload import KVOffload
from jaxserve.core.lora_registry import LoRANotFoundError, LoRAPlacementError, LoRARegistry
from jaxserve.setting_checks import LoRAModule
from jaxserve.core.page_allocator import PageAllocator
from jaxserve.core.request import (InvalidRequestError, Request, RequestLimits, RequestStatus, SamplingParams,
                                   check_pooling_request, check_request)
from jaxserve.core.scheduler import Scheduler, StepPlan
from jaxserve.planning import memory
from jaxserve.pooling.accumulate import engine_pooling
from jaxserve.multimodal.admission import check_prompt_images, check_vision_settings
from jaxserve.core.structured_output import GrammarCompiler, StructuredOutputError, check_structured_output
from jaxserve.speculative import ngram

log = logging.getLogger(__name__)


STEP_RECORDS_KEPT = 1024  # the most recent StepRecords an engine keeps


class Engine:
    """Synchronous engine: the scheduler (host) plus the model runner (device)."""

    def __init__(self, model_config, params, tokenizer, engine_config: EngineConfig | None = None,
                 *, model_name: str = "model", shardings=None, device_memory_bytes: int | None = None,
                 draft_model=None, pooler=None, score_head=None, vision=None, image_processor=None):
        """One replica over loaded weights: on the first device, or on the devices of `shardings`
        (a `sharding.ModelShardings`, required with tensor_parallel_size > 1). Engines are built
        by `data_parallel.build_engine` (which `from_model` uses); tests and benchmarks may call
        this directly on one device. Without `num_pages` the KV pool is `memory.plan_engine`'s
        for `device_memory_bytes` (default: the device's budget, read now). With
        speculative_method="draft", `draft_model` is the draft's (ModelConfig, params); default:
        loaded from `speculative_model`. With runner="pooling", `pooler` (a PoolerConfig; default
        last token, normalized) and a classifier's `score_head` [labels, hidden] say how it pools.
        A vision-language model takes `vision`, its tower's (module, vision config, params), and
        the `image_processor` of its requests' images (checkpoints.load.ModelSource's)."""
        from jaxserve.executor import runner as runner_lib  # jax lives behind the runner
        from jaxserve.executor import device_setup

        cfg = engine_config or EngineConfig()  # checked when made (EngineConfig.check)
        if shardings is None and cfg.tensor_parallel_size > 1:
            raise ValueError(f"tensor_parallel_size={cfg.tensor_parallel_size} needs the replica's shardings; "
                             f"build the engine with Engine.from_model or data_parallel.build_engine")
        device_setup.enable_compilation_cache()
        params = device_setup.quantize_weights(params, cfg.quantization, model_config,
                                               embedding=cfg.quantize_embedding, sharded=shardings is not None)
        self.config = cfg
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = cfg.model_len(model_config)
        if cfg.speculative_method == "draft":
            draft_model = draft_model or _load_draft(cfg)
        num_pages = cfg.num_pages or device_setup.plan_engine(
            model_config, cfg, params, shardings=shardings, device_memory_bytes=device_memory_bytes,
            draft_model=draft_model[0] if draft_model else None).num_pages
        self.pooler, self.pooled, prefix_caching = engine_pooling(cfg, pooler)
        self.eos_token_ids = _eos_token_ids(model_config, tokenizer)
        if model_config.multimodal_architecture:
            check_vision_settings(model_config, cfg, vision is not None)
        self.image_processor = image_processor if model_config.multimodal_architecture else None
        self.runner = runner_lib.ModelRunner(model_config, params, cfg, num_pages=num_pages,
                                             max_model_len=self.max_model_len, shardings=shardings,
                                             eos_token_ids=self.eos_token_ids, pooler=self.pooler,
                                             score_head=score_head, vision=vision)
        self.weights_bytes, self.kv_cache_bytes = device_setup.array_bytes(self.runner.params, self.runner.kv_cache)
        # KV offload: the host (and disk) tiers under the prefix cache; the runner holds their bytes.
        self.offload = KVOffload.build(cfg, self.runner, prefix_caching, device_setup.process_count() > 1,
                                       memory.host_memory_budget_bytes(1.0))
        self.allocator = PageAllocator(num_pages, cfg.page_size, prefix_caching, self.offload and self.offload.tiers)
        encoder_cache = EncoderCache(pool_rows(cfg)) if model_config.multimodal_architecture else None  # image rows
        self.scheduler = Scheduler(self.allocator, cfg, self.max_model_len, encoder_cache,
                                   prefill_cut_sizes=self.runner.buckets.prefill_cut_sizes)
        # LoRA: the adapters served by name (--lora_modules, and loads at run time), in the runner's slab.
        self.loras: LoRARegistry | None = None
        if cfg.enable_lora:
            self.loras = LoRARegistry(
                lambda path: lora_adapter.load_adapter(path, model_config, cfg.max_lora_rank),
                self.runner.write_lora_slot, self.runner.clear_lora_slot, cfg.max_loras, cfg.max_cpu_loras)
            for module in cfg.lora_modules or ():
                self.loras.add(module)
        self.output_processor = OutputProcessor(tokenizer)
        # Structured output compiles grammars against the tokenizer (none without one).
        self.grammar_compiler = (GrammarCompiler(tokenizer, model_config.vocab_size, self.eos_token_ids)
                                 if tokenizer is not None else None)
        self.step_records: collections.deque[StepRecord] = collections.deque(maxlen=STEP_RECORDS_KEPT)
        self._last_step_end: float | None = None  # perf_counter() when the last step ended with work left
        self._step_listeners: tuple[Callable[[StepRecord], None], ...] = ()
        self.num_steps = 0
        self.num_computed_tokens = 0  # model tokens computed (prefix-cache hits are not computed)
        self.time_in_steps = 0.0
        self.num_step_failures = 0
        self.last_step_error: str | None = None
        self.proposer = self._proposer(draft_model)  # speculative decoding's
        if cfg.warmup:
            # In the background only for one process without a draft model (a multi-host job's
            # processes, and the draft's shapes, warm up before the first step).
            background = cfg.background_warmup and self.runner.draft is None and device_setup.process_count() == 1
            self.runner.warmup(background=background, is_serving=self.has_unfinished)
            if self.runner.draft is not None:
                self.runner.draft.warmup(self.runner.all_buckets())

    def _proposer(self, draft_model):
        """What proposes the tokens a verification step checks (speculative decoding), or None."""
        cfg = self.config
        if cfg.speculative_method == "ngram":
            return ngram.NgramProposer(cfg.prompt_lookup_min, cfg.prompt_lookup_max)
        if cfg.speculative_method != "draft":
            return None
        from jaxserve.speculative.draft_proposer import DraftProposer  # device code, as the runner's
        draft_config, draft_params = draft_model
        self.runner.draft = DraftProposer(
            draft_config, draft_params, self.runner, max_rows=self.scheduler.max_verify_rows,
            num_speculative_tokens=cfg.num_speculative_tokens, eos_token_ids=self.eos_token_ids)
        return self.runner.draft

    @classmethod
    def from_model(cls, model: str, engine_config: EngineConfig | None = None):
        """Loads a converted model directory, a GGUF/HF source, or the alias "smollm2".

        Weights are restored straight into each device's shards. With data_parallel_size > 1
        the result is a `data_parallel.DataParallelEngine` of replicas (same generate API).
        Raises ValueError when the model cannot be split over the requested devices (settings
        that cannot work at all are refused when the EngineConfig is made: config.SettingError)."""
        from jaxserve.executor import device_setup  # jax lives behind the runner (see __init__)
        from jaxserve.parallel import data_parallel, multihost

        multihost.initialize()
        cfg = device_setup.platform_config(engine_config or EngineConfig())
        source = load.open_model(model)
        pooler, score_head = pooling_checkpoint.pooling_model(source.path, source.config.hidden_size, cfg.runner,
                                                              cfg.pooler_config)
        engine_cls = functools.partial(cls, pooler=pooler, score_head=score_head) if pooler is not None else cls
        if source.config.multimodal_architecture:  # the vision tower and the image processor too
            module, vision_config = source.vision_tower()
            engine_cls = functools.partial(
                engine_cls, vision=(module, vision_config, source.load_vision_params(device_setup.param_dtype(cfg.dtype))),
                image_processor=source.load_image_processor())
        return data_parallel.build_engine(
            engine_cls, source.config, source.load_tokenizer(), cfg, model_name=source.name,
            load_params=lambda shardings: source.load_params(
                cfg.dtype, None if shardings is None else shardings.checkpoint_shardings()))

    # ---- requests -------------------------------------------------------------------------
    @property
    def limits(self) -> RequestLimits:
        """What a request may ask for: the engine's vocabulary, context, KV capacity and logprobs."""
        return RequestLimits(vocab_size=self.model_config.vocab_size, max_seq_len=self.scheduler.max_seq_len,
                             max_model_len=self.max_model_len, max_logprobs=self.config.max_logprobs)

    def check_request(self, prompt_token_ids: Sequence[int], params: SamplingParams, multimodal=None) -> None:
        """Raises InvalidRequestError (a ValueError) when the request can never be served. A
        structured-output grammar is compiled here unless it already was (`compile_structured_output`).
        `multimodal`: the prompt's images (jaxserve.multimodal.inputs.MultimodalInputs), or None."""
        if self.pooler is not None:  # a pooling engine: the prompt alone (core.request.pooling_params)
            check_pooling_request(prompt_token_ids, params, self.limits)
        else:
            check_request(prompt_token_ids, params, self.limits)
        if multimodal is not None:
            check_prompt_images(prompt_token_ids, multimodal, self.model_config, self.model_name,
                                self.scheduler.max_image_tokens)
        if params.lora_name is not None and (self.loras is None or params.lora_name not in self.loras):
            raise InvalidRequestError(f"The model `{params.lora_name}` does not exist.", param="model",
                                      code="model_not_found")
        if params.structured_output is not None:
            self.compile_structured_output(params)

    def compile_structured_output(self, params: SamplingParams) -> None:
        """Compiles `params.structured_output` against the tokenizer (kept on it: done once, and
        shared by the requests made from these params). The server calls this in its thread pool
        before admission. InvalidRequestError naming the client's field if it cannot be used."""
        spec = params.structured_output
        if spec is None:
            return
        try:
            check_structured_output(spec)
            if self.grammar_compiler is None:
                raise StructuredOutputError("structured output needs the model's tokenizer", spec.param)
            self.grammar_compiler.compile(spec)
        except StructuredOutputError as e:
            raise InvalidRequestError(str(e), param=e.param) from None

    def make_request(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                     multimodal=None) -> Request:
        """Admission: checks the request completely and returns it ready for `add` (with its own
        grammar state when it has structured output). `multimodal`: the prompt's images
        (jaxserve.multimodal.inputs.prompt_images), or None."""
        self.check_request(prompt_token_ids, params, multimodal)
        request = Request(request_id, list(prompt_token_ids), params)
        request.multimodal = multimodal if multimodal is not None and multimodal.images else None
        if params.lora_name is not None:
            request.prefix_salt = self.loras.prefix_salt(params.lora_name)
        if params.structured_output is not None:
            request.grammar = self.grammar_compiler.new_state(params.structured_output)
            request.grammar.executor = self.grammar_compiler.executor()
        return request

    def add(self, request: Request) -> None:
        """Queues a request made by `make_request` (already checked; not checked again)."""
        self.scheduler.add_request(request)
        self.output_processor.add(request.request_id, request.prompt_token_ids, request.params)

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                    multimodal=None) -> Request:
        request = self.make_request(request_id, prompt_token_ids, params, multimodal)
        self.add(request)
        return request

    def abort(self, request_id: str) -> RequestOutput | None:
        """Aborts a request now (its pages return at once); its closing delta, or None if unknown."""
        request = self.scheduler.abort(request_id)
        if request is None:
            return None
        return self._close(request)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def stats(self) -> EngineStats:
        spec = self.scheduler.spec_stats
        warmup = self.runner.warmup_state
        return EngineStats(
            num_running=self.scheduler.num_running, num_waiting=self.scheduler.num_waiting,
            kv_pages_used=self.allocator.num_used_pages, kv_pages_total=self.allocator.num_usable_pages,
            num_preemptions=self.scheduler.num_preemptions,
            prefix_cache_queried_tokens=self.allocator.num_prefix_queries_tokens,
            prefix_cache_hit_tokens=self.allocator.num_prefix_hit_tokens,
            weights_bytes=self.weights_bytes, kv_cache_bytes=self.kv_cache_bytes,
            num_step_failures=self.num_step_failures, spec_verify_steps=spec.num_verify_steps,
            spec_proposed_tokens=spec.num_proposed_tokens, spec_accepted_tokens=spec.num_accepted_tokens,
            spec_accepted_per_position=tuple(spec.accepted_per_position),
            warmup_shapes_compiled=warmup.compiled if warmup else 0, warmup_shapes_total=warmup.total if warmup else 0,
            lora_running=_adapters(self.scheduler.running), lora_waiting=_adapters(self.scheduler.waiting),
            max_lora=self.config.max_loras if self.loras is not None else 0,
            **(self.offload.stats() if self.offload else {}))

    def warmup_status(self) -> dict | None:
        """The warm-up's progress ({"ready", "compiled", "total", "error"}: ModelRunner.warmup_state),
        None without a warm-up. "ready": the shapes a first request needs are compiled."""
        state = self.runner.warmup_state
        return None if state is None else state.to_dict()

    def executor_failure(self) -> str | None:
        """Why this engine can run no step any more (its executor failed for good: a multi-host
        job that lost a process), or None."""
        return self.runner.transport.failure()

    def executor_health(self) -> dict:
        """What the executor adds to /health (a multi-host job: its processes and failure)."""
        return self.runner.transport.health()

    def stop_warmup(self) -> None:
        """Ends a background warm-up early, for a shutdown once nothing steps any more: the
        shapes not started are skipped, so the process exits without compiling them."""
        self.runner.stop_warmup()

    def add_step_listener(self, listener: Callable[[StepRecord], None]) -> None:
        """Calls `listener(record)` after every step that ran, on the thread that steps the engine."""
        self._step_listeners += (listener,)

    def remove_step_listener(self, listener: Callable[[StepRecord], None]) -> None:
        self._step_listeners = tuple(f for f in self._step_listeners if f != listener)  # == matches bound methods

    # ---- one step -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedules and runs one model step; returns a delta for every request that advanced."""
        start = time.perf_counter()
        host_gap = 0.0 if self._last_step_end is None else start - self._last_step_end
        self._last_step_end = None
        plan = self.scheduler.schedule()
        transfers = None
        if self.offload is not None:  # KV offload's copies, before the step: saves started, spills and restores done
            try:
                transfers = self.offload.start_copies()
            except Exception as e:
                return self._kv_copies_failed(plan, e)
        try:
            return self._run(plan, start, host_gap)
        finally:
            if transfers:
                self.offload.finish_copies(transfers)

    def _run(self, plan: StepPlan, start: float, host_gap: float) -> list[RequestOutput]:
        if plan.is_empty:
            return []
        if self.loras is not None:
            failed = self._place_adapters(plan)
            if failed:  # the step runs next time without them (its pages stay reserved)
                return failed
        batch = plan.to_batch()
        try:
            result = self.runner.execute(batch)
        except StepInputError as e:  # nothing ran: fail that request, the others run next step
            request = next(r for r, _ in plan.scheduled if r.request_id == e.request_id)
            log.error("request %s could not be packed into a step: %s", e.request_id, e)
            return [self._fail(request, f"the request could not be run: {e}")]
        except Exception as e:
            return self._recover_from_failed_step(plan, e)
        self.num_steps += 1
        self.num_computed_tokens += batch.num_tokens
        self.time_in_steps += result.device_seconds
        rows = {row.request_id: i for i, row in enumerate(batch.rows)}
        if result.pooled is not None:  # before update: the chunks start where each request's computed tokens end
            for (request, num_new), partial in zip(plan.prefill, result.pooled):
                self.pooled.add(request.request_id, request.num_prompt_tokens, request.num_computed_tokens, num_new,
                                partial)
        if result.prompt_logprobs is not None:  # before update: a request may finish in it (max_tokens 0)
            for row, (request, _), out in zip(batch.rows, plan.scheduled, result.prompt_logprobs):
                if out is not None and request.status == RequestStatus.RUNNING:
                    request.prompt_logprobs.extend(prompt_logprob_entries(row.prompt_logprobs, out))
        num_outputs_before = {request.request_id: request.num_output_tokens for request, _ in plan.scheduled}
        appended = self.scheduler.update(plan, result.token_ids.tolist())
        outputs, failed = [], []
        num_output_tokens = 0
        for request in appended:
            if not request.num_output_tokens:  # max_tokens 0: the prompt (and its logprobs) is all
                outputs.append(self._close(request))
                continue
            first = num_outputs_before[request.request_id]
            output = self._emit(request, first, rows[request.request_id], result)
            if output is None:
                failed.append(request)
                continue
            outputs.append(output)
            num_output_tokens += request.num_output_tokens - first
        for request in failed:
            outputs.append(self._fail_grammar(request))
        if self.proposer is not None:
            self._propose()
        self._record_step(batch, result, time.perf_counter() - start, num_output_tokens, host_gap)
        if self.has_unfinished():
            self._last_step_end = time.perf_counter()
        return outputs

    def _place_adapters(self, plan: StepPlan) -> list[RequestOutput]:
        """Puts the adapters of the step's requests in the slab's slots (the scheduler keeps at
        most --max_loras distinct ones running) and gives each request its slot. An adapter that
        cannot be placed (evicted from host memory, its folder gone) is no longer served: its
        requests end with an error, returned, and the step is not run."""
        names = [r.params.lora_name for r, _ in plan.scheduled if r.params.lora_name is not None]
        try:
            slots = self.loras.place(names, self._adapters_in_use())
        except LoRAPlacementError as e:
            log.error("%s; its requests fail and it is unloaded", e)
            if e.name in self.loras:
                self.loras.remove(e.name)
            return [self._fail(r, str(e)) for r in self.scheduler.unfinished_requests()
                    if r.params.lora_name == e.name]
        for request, _ in plan.scheduled:
            request.lora_slot = slots.get(request.params.lora_name, 0)
        return []

    def _adapters_in_use(self) -> set[str]:
        """The LoRA adapters of the unfinished requests."""
        return {r.params.lora_name for r in self.scheduler.unfinished_requests()} - {None}

    # ---- LoRA adapters at run time --------------------------------------------------------
    def read_lora_adapter(self, path: str):
        """The PEFT adapter in folder `path`, read and checked against this engine's model
        (checkpoints.lora_adapter.LoRAError naming the reason; ValueError when LoRA is off).
        Touches nothing of the engine: any thread may call it."""
        if self.loras is None:
            raise ValueError("LoRA is not enabled: start the server with --enable_lora")
        return lora_adapter.load_adapter(path, self.model_config, self.config.max_lora_rank)

    def load_lora_adapter(self, name: str, path: str, adapter=None) -> None:
        """Serves the PEFT adapter in folder `path` as `name` from the next request on (`adapter`:
        read already by `read_lora_adapter`, else read now). LoRAError naming the reason,
        ValueError when LoRA is off or the name is taken; the adapters served are untouched."""
        if adapter is None:
            adapter = self.read_lora_adapter(path)
        self.loras.add(LoRAModule(name, path), adapter)

    def unload_lora_adapter(self, name: str) -> None:
        """Stops serving adapter `name` (requests already running with it finish with it);
        LoRANotFoundError when no adapter has that name."""
        if self.loras is None:
            raise LoRANotFoundError(f"The lora adapter '{name}' cannot be found.")
        self.loras.remove(name)
        self.loras.release_unused(self._adapters_in_use())  # at once when no request uses it

    def lora_modules(self) -> list[LoRAModule]:
        """The adapters served (none without LoRA)."""
        return [] if self.loras is None else self.loras.modules()

    def _emit(self, request: Request, first: int, row: int, result) -> RequestOutput | None:
        """The delta of a request that got output tokens `first ..` in this step (one, or in a
        verification step the accepted ones): each is checked in order (its grammar, stop
        tokens, then stop strings in the output processor); a stop drops the tokens after it.
        None when a token breaks the request's grammar (the caller fails the request)."""
        new_tokens = request.output_token_ids[first:]
        verified = result.token_ids.ndim == 2  # [rows, K + 1] or [rows, n steps]: a draw per position
        deltas = []
        for position, token_id in enumerate(new_tokens):
            if request.grammar is not None and not request.grammar.accept(token_id):
                return None  # cannot happen with the mask applied; fails this request only
            if self._is_stop_token(request, token_id):
                del request.output_token_ids[first + position + 1:]
                self.scheduler.finish(request, RequestStatus.FINISHED_STOPPED)
            last = request.num_output_tokens == first + position + 1
            logprobs = None
            if request.params.logprobs is not None and result.logprobs is not None:
                index = (row, position) if verified else row
                logprobs = RowLogprobs(float(result.logprobs[index]), result.top_ids[index], result.top_logprobs[index])
            core = self._core_output(request, logprobs, token_index=first + position,
                                     finished=last)
            delta, stopped = self.output_processor.process([core])
            deltas.append(delta[0])
            if stopped:  # a stop string ended it at this token
                del request.output_token_ids[first + position + 1:]
                self.scheduler.finish(request, RequestStatus.FINISHED_STOPPED)
                break
            if last:
                break
        return with_metrics(request, deltas[0] if len(deltas) == 1 else merge_deltas(deltas))

    def _propose(self) -> None:
        """Sets the proposed tokens of every decoding request for the next step, when that step
        can be a verification step (all running requests decode, none waits to be admitted)."""
        running = self.scheduler.running
        if (not running or len(running) > self.scheduler.max_verify_rows
                or (self.scheduler.waiting and len(running) < self.scheduler.max_num_seqs)
                or not all(map(self.scheduler.is_decoding, running))):
            return
        k = self.config.num_speculative_tokens
        wanted = [r for r in running if r.grammar is None and r.params.max_tokens - r.num_output_tokens > 1]
        if wanted:
            for request, proposal in zip(wanted, self.proposer.propose(wanted, k)):
                request.spec_token_ids = proposal

    def _is_stop_token(self, request: Request, token_id: int) -> bool:
        """Whether a new token ends the request: one of its stop tokens, or EOS unless ignored.
        With a grammar EOS always stops: the grammar allows it only where its output is complete."""
        params = request.params
        return token_id in params.stop_token_ids or (token_id in self.eos_token_ids
                                                     and (not params.ignore_eos or request.grammar is not None))

    @staticmethod
    def _core_output(request: Request, logprobs: RowLogprobs | None = None, token_index: int | None = None,
                     finished: bool = True) -> CoreOutput:
        """The request's output token `token_index` (None: no new token, the request's end), with
        its finish reason when `finished` (the request's last token so far). The prompt logprobs
        go with the first token (or the end of a max_tokens 0 request)."""
        new_token = token_index is not None
        first = (token_index == 0 if new_token
                 else request.num_output_tokens == 0 and request.finish_reason == "length")
        return CoreOutput(
            request_id=request.request_id, prompt_logprobs=request.prompt_logprobs if first else None,
            new_token_ids=(request.output_token_ids[token_index],) if new_token else (),
            finish_reason=request.finish_reason if finished else None, num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=token_index + 1 if new_token else request.num_output_tokens,
            num_cached_tokens=request.num_cached_tokens, logprobs=logprobs, error=request.error_message,
            error_param=request.error_param)

    def _close(self, request: Request) -> RequestOutput:
        """The closing delta of a request the core ended without a new token (abort, error)."""
        outputs, _ = self.output_processor.process([self._core_output(request)])
        if self.pooled is not None:  # a pooling request's vector (None unless its whole prompt was pooled)
            pooled = self.pooled.pop(request.request_id)
            if pooled is not None and request.error_message is None:
                outputs[0] = dataclasses.replace(outputs[0], pooled=pooled)
        return with_metrics(request, outputs[0])

    def _record_step(self, batch, result, step_seconds: float, num_output_tokens: int, host_gap: float = 0.0) -> None:
        """Keeps the step's StepRecord and hands it to the listeners (a failing listener is logged)."""
        record = StepRecord.of(batch, result, step_seconds, num_output_tokens, host_gap)
        self.step_records.append(record)
        for listener in self._step_listeners:
            try:
                listener(record)
            except Exception:
                log.exception("a step listener failed")

    def _recover_from_failed_step(self, plan: StepPlan, error: Exception) -> list[RequestOutput]:
        """A device step failed and no single request can be blamed: its requests end with an
        error, the engine goes on. If the step consumed the KV cache, the cache is rebuilt and
        every other running request is recomputed from its tokens (the prefix cache is dropped)."""
        self.num_step_failures += 1
        self.last_step_error = f"{type(error).__name__}: {error}"
        num_prefill_tokens = sum(n for _, n in plan.prefill)
        log.error("engine step failed (%d decode rows, %d prefill chunks of %d tokens, %d pages in "
                  "the widest row); failing its %d requests", len(plan.decode), len(plan.prefill),
                  num_prefill_tokens, max(len(r.page_ids) for r, _ in plan.scheduled), plan.num_seqs,
                  exc_info=error)
        message = f"engine step failed: {self.last_step_error}"
        outputs = [self._fail(request, message) for request, _ in plan.scheduled]
        if self.scheduler.encoder_cache is not None:  # the step's images may not be encoded, the pool lost
            self.scheduler.encoder_cache.clear()
            self.runner.recover_images()
        if self.runner.recover():
            recomputed = self.scheduler.recompute_running()
            self.allocator.reset_prefix_cache()
            log.warning("the failed step consumed the KV cache: rebuilt it; %d running requests will "
                        "be recomputed", len(recomputed))
        return outputs

    def _kv_copies_failed(self, plan: StepPlan, error: Exception) -> list[RequestOutput]:
        """KV offload's copies before a step failed (their blocks are back in the tiers): as a failed
        step, its requests end with an error (some wait for restored pages that may not be there),
        and the pages restored for them are forgotten by the prefix cache."""
        outputs = self._recover_from_failed_step(plan, error) if not plan.is_empty else []
        self.allocator.reset_prefix_cache()
        return outputs

    def _fail(self, request: Request, message: str, param: str | None = None) -> RequestOutput:
        """Ends one request with an error (pages return); its closing delta. `param`: the client's
        field that caused it, when its input did."""
        request.error_message, request.error_param = message, param
        if not request.is_finished:
            self.scheduler.finish(request, RequestStatus.FINISHED_ERROR)
        return self._close(request)

    def _fail_grammar(self, request: Request) -> RequestOutput:
        """Ends a request whose grammar failed while generating: a limit of the grammar engine met
        past the first token (its input's doing: the client gets a 400 naming the field). When
        llguidance reports the error, the compiler forgets the constraint: later requests with it
        are refused at admission."""
        constraint, error = request.grammar.constraint, request.grammar.error
        param = constraint.param if constraint is not None else "structured_output"
        message = (f"structured output failed after {request.num_output_tokens} tokens: "
                   f"{error or 'the grammar refused the sampled token'} ('{param}')")
        log.warning("request %s: %s", request.request_id, message)
        if error is not None and constraint is not None and self.grammar_compiler is not None:
            self.grammar_compiler.forget(constraint, f"'{param}' cannot be used: {error}")
        return self._fail(request, message, param=param)

    def fail_all(self, message: str) -> list[RequestOutput]:
        """Ends every unfinished request with an error (shutdown, or a step that could not recover)."""
        return [self._fail(request, message) for request in self.scheduler.unfinished_requests()]

    # ---- offline --------------------------------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams], *,
                 request_ids: Sequence[str] | None = None, on_finish=None,
                 multimodal: Sequence | None = None) -> list[FinishedRequest]:
        """Runs every prompt (token ids) to completion with continuous batching; results in order.

        `on_finish(result)` is called as each request finishes. `multimodal`: each prompt's images
        (jaxserve.multimodal.inputs.MultimodalInputs or None), for a vision-language model."""
        params_list = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        ids = list(request_ids or [f"gen-{uuid.uuid4().hex[:12]}-{i}" for i in range(len(prompts))])
        images = list(multimodal) if multimodal is not None else [None] * len(prompts)
        requests = {rid: self.add_request(rid, p, sp, mm) for rid, p, sp, mm in zip(ids, prompts, params_list, images)}
        texts = {rid: [] for rid in ids}
        logprobs = {rid: [] for rid in ids}
        results: dict[str, FinishedRequest] = {}
        while self.has_unfinished():
            for out in self.step():
                texts[out.request_id].append(out.new_text)
                if out.new_logprobs:
                    logprobs[out.request_id].extend(out.new_logprobs)
                if out.finished:
                    results[out.request_id] = result = FinishedRequest.of(
                        requests[out.request_id], out, "".join(texts[out.request_id]), logprobs[out.request_id])
                    if on_finish:
                        on_finish(result)
        return [results[rid] for rid in ids]


def _adapters(requests) -> tuple[str, ...]:
    """The LoRA adapters of `requests`, sorted."""
    return tuple(sorted({r.params.lora_name for r in requests} - {None}))


def _eos_token_ids(model_config, tokenizer) -> frozenset[int]:
    """The model's end-of-sequence ids and the tokenizer's."""
    tokenizer_eos = () if tokenizer is None or tokenizer.eos_token_id is None else (tokenizer.eos_token_id,)
    return frozenset(model_config.eos_token_ids) | frozenset(tokenizer_eos)


def _load_draft(cfg: EngineConfig):
    """The draft model of `cfg.speculative_model` (anything --model takes): (ModelConfig, params)."""
    source = load.open_model(cfg.speculative_model)
    return source.config, source.load_params(cfg.dtype or "float32", None)
