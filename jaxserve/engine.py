"""Engine: continuous batching over the paged KV cache.

`Engine` is synchronous: `add_request`, `abort` and `step` (one scheduled model step, returning a
delta per request that advanced). `jaxserve.async_engine.AsyncEngine` runs it for asyncio callers.
"""
from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from typing import Sequence

from jaxserve.detokenizer import IncrementalDetokenizer, StopChecker
from jaxserve.outputs import EngineStats, RequestOutput, StepInputError, TokenLogprob
from jaxserve.page_allocator import PageAllocator
from jaxserve.request import Request, RequestLimits, RequestStatus, SamplingParams, check_request
from jaxserve.scheduler import Scheduler, StepPlan

log = logging.getLogger(__name__)


@dataclasses.dataclass
class EngineConfig:
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    max_num_prefill_seqs: int = 2
    page_size: int = 16
    num_pages: int | None = None  # None: sized by the memory planner
    max_model_len: int | None = None  # None: min(the model's context, 2048)
    enable_prefix_caching: bool = True
    dtype: str | None = None  # None: float32 on CPU, bfloat16 on GPU
    attention_backend: str | None = None  # None: Pallas on GPU, the blocked XLA path on CPU
    max_waiting_requests: int = 1024
    max_logprobs: int = 20
    memory_utilization: float = 0.9
    warmup: bool = True
    tensor_parallel_size: int = 1  # devices one replica's weights, KV heads and vocabulary span
    data_parallel_size: int = 1  # replicas (from_model builds them; an Engine is one replica)
    quantization: str | None = None  # int8 | int4 (jaxserve.quantization): linear layers, after loading
    kv_cache_dtype: str = "auto"  # auto (the weights' float dtype) | int8 | fp8 (pallas_kernels.kv_quant)


@dataclasses.dataclass
class FinishedRequest:
    """The whole result of one request (offline generation)."""
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    num_cached_tokens: int
    ttft: float | None  # seconds from arrival to the first token
    e2e: float  # seconds from arrival to the end
    logprobs: list[TokenLogprob] | None = None

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or len(self.token_ids) < 2:
            return None
        return (self.e2e - self.ttft) / (len(self.token_ids) - 1)


class _Stream:
    """Host-side text state of one request: detokenizer and stop strings."""

    def __init__(self, request: Request, tokenizer):
        self.request = request
        self.detokenizer = IncrementalDetokenizer(tokenizer, request.prompt_token_ids) if tokenizer else None
        self.stop_checker = StopChecker(request.params.stop)


class Engine:
    """Synchronous engine: the scheduler (host) plus the model runner (device)."""

    def __init__(self, model_config, params, tokenizer, engine_config: EngineConfig | None = None,
                 *, model_name: str = "model", shardings=None):
        from jaxserve import runner as runner_lib  # jax lives behind the runner
        from jaxserve import device_setup

        cfg = engine_config or EngineConfig()
        device_setup.enable_compilation_cache()
        params = device_setup.quantize_weights(params, cfg.quantization)
        if shardings is None and cfg.tensor_parallel_size > 1:
            from jaxserve import sharding
            mesh = sharding.make_mesh(model_config, cfg.tensor_parallel_size)
            shardings = sharding.ModelShardings.create(model_config, mesh)
        self.config = cfg
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = min(cfg.max_model_len or min(model_config.max_position_embeddings, 2048),
                                 model_config.max_position_embeddings)
        num_pages = cfg.num_pages or device_setup.plan_num_pages(
            model_config, cfg, self.max_model_len, params, shardings=shardings)
        self.allocator = PageAllocator(num_pages, cfg.page_size, cfg.enable_prefix_caching)
        self.scheduler = Scheduler(self.allocator, max_num_seqs=cfg.max_num_seqs,
                                   max_num_batched_tokens=cfg.max_num_batched_tokens,
                                   max_num_prefill_seqs=cfg.max_num_prefill_seqs,
                                   max_model_len=self.max_model_len)
        self.runner = runner_lib.ModelRunner(
            model_config, params, num_pages=num_pages, page_size=cfg.page_size,
            max_model_len=self.max_model_len, max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=cfg.max_num_batched_tokens,
            max_num_prefill_seqs=cfg.max_num_prefill_seqs,
            backend=device_setup.attention_backend(cfg.attention_backend),
            max_logprobs=cfg.max_logprobs, shardings=shardings,
            kv_dtype=device_setup.kv_cache_dtype(cfg.kv_cache_dtype))
        self.weights_bytes, self.kv_cache_bytes = device_setup.array_bytes(self.runner.params, self.runner.kv_cache)
        eos = set(model_config.eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            eos.add(tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        self._streams: dict[str, _Stream] = {}
        self.num_steps = 0
        self.num_computed_tokens = 0  # model tokens computed (prefix-cache hits are not computed)
        self.time_in_steps = 0.0
        self.num_step_failures = 0
        self.last_step_error: str | None = None
        if cfg.warmup:
            self.runner.warmup()

    @classmethod
    def from_model(cls, model: str, engine_config: EngineConfig | None = None):
        """Loads a converted model directory, a GGUF/HF source, or the alias "smollm2".

        Weights are restored straight into each device's shards. With data_parallel_size > 1
        the result is a `data_parallel.DataParallelEngine` of replicas (same generate API).
        Raises ValueError when the model cannot be split over the requested devices."""
        from checkpoints import default_model, load
        from jaxserve import data_parallel, device_setup

        cfg = engine_config or EngineConfig()
        device_setup.initialize_distributed()
        model_dir = default_model.resolve_model(model)
        model_config = load.load_config(model_dir)
        dtype = device_setup.param_dtype(cfg.dtype)
        tokenizer = load.load_tokenizer(model_dir)
        return data_parallel.build_engine(
            cls, model_config, tokenizer, cfg, model_name=default_model.served_model_name(model),
            load_params=lambda shardings: load.load_params(
                model_dir, dtype, None if shardings is None else shardings.checkpoint_shardings()))

    # ---- requests -------------------------------------------------------------------------
    @property
    def limits(self) -> RequestLimits:
        """What a request may ask for: the engine's vocabulary, context, KV capacity and logprobs."""
        return RequestLimits(vocab_size=self.model_config.vocab_size, max_seq_len=self.scheduler.max_seq_len,
                             max_model_len=self.max_model_len, max_logprobs=self.config.max_logprobs)

    def check_request(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        """Raises InvalidRequestError (a ValueError) when the request can never be served."""
        check_request(prompt_token_ids, params, self.limits)

    def make_request(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams) -> Request:
        """Admission: checks the request completely and returns it ready for `add`."""
        self.check_request(prompt_token_ids, params)
        return Request(request_id, list(prompt_token_ids), params)

    def add(self, request: Request) -> None:
        """Queues a request made by `make_request` (already checked; not checked again)."""
        self.scheduler.add_request(request)
        self._streams[request.request_id] = _Stream(request, self.tokenizer)

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int],
                    params: SamplingParams) -> Request:
        request = self.make_request(request_id, prompt_token_ids, params)
        self.add(request)
        return request

    def abort(self, request_id: str) -> RequestOutput | None:
        """Aborts a request now (its pages return at once); its closing delta, or None if unknown."""
        request = self.scheduler.abort(request_id)
        stream = self._streams.pop(request_id, None)
        if request is None or stream is None:
            return None
        return self._output(stream, [], "", None)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=self.scheduler.num_running, num_waiting=self.scheduler.num_waiting,
            kv_pages_used=self.allocator.num_used_pages, kv_pages_total=self.allocator.num_total_pages,
            num_preemptions=self.scheduler.num_preemptions,
            prefix_cache_queried_tokens=self.allocator.num_prefix_queries_tokens,
            prefix_cache_hit_tokens=self.allocator.num_prefix_hit_tokens,
            weights_bytes=self.weights_bytes, kv_cache_bytes=self.kv_cache_bytes,
            num_step_failures=self.num_step_failures)

    # ---- one step -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedules and runs one model step; returns a delta for every request that advanced."""
        plan = self.scheduler.schedule()
        if plan.is_empty:
            return []
        try:
            result = self.runner.execute(plan)
        except StepInputError as e:  # nothing ran: fail that request, the others run next step
            log.error("request %s could not be packed into a step: %s", e.request.request_id, e)
            return [self._fail(e.request, f"the request could not be run: {e}")]
        except Exception as e:
            return self._recover_from_failed_step(plan, e)
        self.num_steps += 1
        self.num_computed_tokens += plan.num_tokens
        self.time_in_steps += result.device_seconds
        rows = {req.request_id: i for i, req in enumerate(plan.decode + [r for r, _ in plan.prefill])}
        appended = self.scheduler.update(plan, result.token_ids.tolist())
        outputs = []
        for request in appended:
            stream = self._streams.get(request.request_id)
            if stream is None:
                continue
            logprob = None
            if request.params.logprobs is not None and result.logprobs is not None:
                i = rows[request.request_id]
                k = request.params.logprobs
                logprob = TokenLogprob(
                    request.output_token_ids[-1], float(result.logprobs[i]),
                    [(int(t), float(lp)) for t, lp in zip(result.top_ids[i][:k], result.top_logprobs[i][:k])])
            outputs.append(self._advance(stream, logprob))
        return outputs

    def _advance(self, stream: _Stream, logprob: TokenLogprob | None) -> RequestOutput:
        """Stop checks and detokenization for the token just appended to the request."""
        request = stream.request
        token_id = request.output_token_ids[-1]
        params = request.params
        text = ""
        stop_string_matched = False
        if token_id in params.stop_token_ids or (token_id in self.eos_token_ids and not params.ignore_eos):
            self.scheduler.finish(request, RequestStatus.FINISHED_STOPPED)  # the token is not text
        elif stream.detokenizer is not None:
            text, stop_string_matched = stream.stop_checker.add(stream.detokenizer.add(token_id))
        if stop_string_matched:
            self.scheduler.finish(request, RequestStatus.FINISHED_STOPPED)
        elif not request.is_finished:
            self.scheduler.check_length(request)
        if request.is_finished and not stop_string_matched and stream.detokenizer is not None:
            text += stream.stop_checker.add(stream.detokenizer.flush())[0] + stream.stop_checker.flush()
        return self._output(stream, [token_id], text, [logprob] if logprob else None)

    def _output(self, stream: _Stream, token_ids, text, logprobs) -> RequestOutput:
        request = stream.request
        if request.is_finished:
            self._streams.pop(request.request_id, None)
        return RequestOutput(
            request_id=request.request_id, new_token_ids=token_ids, new_text=text,
            finished=request.is_finished, finish_reason=request.finish_reason,
            num_prompt_tokens=request.num_prompt_tokens, num_output_tokens=request.num_output_tokens,
            num_cached_tokens=request.num_cached_tokens, new_logprobs=logprobs,
            error=request.error_message)

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
        if self.runner.recover():
            recomputed = self.scheduler.recompute_running()
            self.allocator.reset_prefix_cache()
            log.warning("the failed step consumed the KV cache: rebuilt it; %d running requests will "
                        "be recomputed", len(recomputed))
        return outputs

    def _fail(self, request: Request, message: str) -> RequestOutput:
        """Ends one request with an error (pages return); its closing delta."""
        request.error_message = message
        if not request.is_finished:
            self.scheduler.finish(request, RequestStatus.FINISHED_ERROR)
        stream = self._streams.get(request.request_id) or _Stream(request, None)
        return self._output(stream, [], "", None)

    def fail_all(self, message: str) -> list[RequestOutput]:
        """Ends every unfinished request with an error (shutdown, or a step that could not recover)."""
        return [self._fail(stream.request, message) for stream in list(self._streams.values())]

    # ---- offline --------------------------------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams], *,
                 request_ids: Sequence[str] | None = None, on_finish=None) -> list[FinishedRequest]:
        """Runs every prompt (token ids) to completion with continuous batching; results in order.

        `on_finish(result)` is called as each request finishes."""
        params_list = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        ids = list(request_ids or [f"gen-{uuid.uuid4().hex[:12]}-{i}" for i in range(len(prompts))])
        requests = {rid: self.add_request(rid, p, sp) for rid, p, sp in zip(ids, prompts, params_list)}
        texts = {rid: [] for rid in ids}
        logprobs = {rid: [] for rid in ids}
        results: dict[str, FinishedRequest] = {}
        while self.has_unfinished():
            for out in self.step():
                texts[out.request_id].append(out.new_text)
                if out.new_logprobs:
                    logprobs[out.request_id].extend(out.new_logprobs)
                if out.finished:
                    req = requests[out.request_id]
                    results[out.request_id] = result = FinishedRequest(
                        out.request_id, req.prompt_token_ids, list(req.output_token_ids),
                        "".join(texts[out.request_id]), out.finish_reason, req.num_cached_tokens,
                        None if req.first_token_time is None else req.first_token_time - req.arrival_time,
                        (req.finish_time or time.monotonic()) - req.arrival_time,
                        logprobs[out.request_id] if req.params.logprobs is not None else None)
                    if on_finish:
                        on_finish(result)
        return [results[rid] for rid in ids]
