"""Engine: continuous batching over the paged KV cache.

`Engine` is synchronous: `add_request`, `abort` and `step` (one scheduled model step, returning a
delta per request that advanced). `jaxserve.async_engine.AsyncEngine` runs it for asyncio callers.
"""
from __future__ import annotations

import dataclasses
import time
import uuid
from typing import Sequence

from jaxserve.detokenizer import IncrementalDetokenizer, StopChecker
from jaxserve.outputs import EngineStats, RequestOutput, TokenLogprob
from jaxserve.page_allocator import PageAllocator
from jaxserve.request import Request, RequestStatus, SamplingParams
from jaxserve.scheduler import Scheduler



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
            cls, model_config, tokenizer, cfg, model_name=model,
            load_params=lambda shardings: load.load_params(
                model_dir, dtype, None if shardings is None else shardings.checkpoint_shardings()))

    # ---- requests -------------------------------------------------------------------------
    def check_request(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        """Raises ValueError with a clear message when the request can never be served."""
        params.validate()
        if params.logprobs is not None and params.logprobs > self.config.max_logprobs:
            raise ValueError(f"logprobs must be <= {self.config.max_logprobs}, got {params.logprobs}")
        if not prompt_token_ids:
            raise ValueError("the prompt must contain at least one token")
        vocab = self.model_config.vocab_size
        if any(not isinstance(t, int) or t < 0 or t >= vocab for t in prompt_token_ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        if len(prompt_token_ids) >= self.scheduler.max_seq_len:
            raise ValueError(f"the prompt has {len(prompt_token_ids)} tokens; it must be shorter than "
                             f"max_model_len ({self.scheduler.max_seq_len}) to leave room for output")

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int],
                    params: SamplingParams) -> Request:
        self.check_request(prompt_token_ids, params)
        request = Request(request_id, list(prompt_token_ids), params)
        self.scheduler.add_request(request)
        self._streams[request_id] = _Stream(request, self.tokenizer)
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
            weights_bytes=self.weights_bytes, kv_cache_bytes=self.kv_cache_bytes)

    # ---- one step -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedules and runs one model step; returns a delta for every request that advanced."""
        plan = self.scheduler.schedule()
        if plan.is_empty:
            return []
        result = self.runner.execute(plan)
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

    def fail_all(self, message: str) -> list[RequestOutput]:
        """Ends every unfinished request with an error (after a failed step); pages return."""
        outputs = []
        for request_id, stream in list(self._streams.items()):
            stream.request.error_message = message
            if not stream.request.is_finished:
                self.scheduler.finish(stream.request, RequestStatus.FINISHED_ERROR)
            outputs.append(self._output(stream, [], "", None))
        return outputs

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
