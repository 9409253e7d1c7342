"""The step functions of a model: one builder for the runner, the draft model and the GPU compile.

Every device call of a step is one of five jitted functions (`StepFunctions`), built here from
the model the step runs and the engine's shapes, plain (one device: the KV cache donated) or
sharded (a replica's mesh: the weights and the KV cache in their shardings, every other input
and output replicated). Nothing is compiled here: the runner compiles each function per bucket
at warm-up (`ModelRunner.warmup`), the draft model per target bucket
(jaxserve.speculative.draft_proposer), and jaxserve.planning.gpu_compile lowers them for a GPU
target on a machine without one.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax

from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.core.step import Bucket, BucketSet
from jaxserve.executor import decode_loop, device_setup, prompt_logprobs, sampler
from jaxserve.models import llama
from jaxserve.pooling import poolers
from jaxserve.speculative import verification
from pallas_kernels import dispatch


@dataclasses.dataclass(frozen=True)
class StepFunctions:
    """The jitted functions of one model's steps (jax.jit objects, compiled per shape on first use)."""
    # (params, kv_cache, batch) -> (logits f32[rows, vocab], kv_cache, prefill hidden rows
    # [prefill_hidden_rows, D]; absent when prefill_hidden_rows is 0); kv_cache donated.
    forward: Any
    verify_forward: Any  # the same, told that no row has more than K + 1 query tokens
    # (params, kv_cache, arrays, sampling, num_steps) -> (tokens i32[rows, max_steps], kv_cache):
    # decode_loop.decode_steps over the forward (no hidden rows); kv_cache donated.
    multi_step: Any
    sample: Any  # (logits f32[rows, vocab], sampling inputs) -> sampler.sample's outputs
    prompt_logprobs: Any  # (head params, hidden [H, D], indices i32[P], targets i32[P]) -> prompt_logprobs.compute's
    # The pooling runner's step (build's `pooling`; None otherwise): (params, kv_cache, batch, score
    # head [L, D] or None) -> (pooled f32[prefill chunks, D or L], kv_cache); kv_cache donated.
    pool: Any = None

    def forward_for(self, bucket: Bucket):
        """The forward that runs `bucket`: the verification one for a verification bucket."""
        return self.verify_forward if bucket.num_verify else self.forward


def bucket_set(engine_config: EngineConfig, backend: str, max_model_len: int) -> BucketSet:
    """The shape buckets an engine under `engine_config` compiles (verification buckets too with
    speculative decoding; explicit bucket lists are EngineConfig's, checked when it was made)."""
    speculative_tokens = engine_config.speculative_tokens
    kv_dtype = device_setup.kv_cache_dtype(engine_config.kv_cache_dtype)
    return BucketSet.create(
        backend=backend, max_num_seqs=engine_config.max_num_seqs,
        max_num_batched_tokens=engine_config.max_num_batched_tokens,
        max_num_prefill_seqs=engine_config.max_num_prefill_seqs, max_model_len=max_model_len,
        page_size=engine_config.page_size, speculative_tokens=speculative_tokens,
        max_verify_rows=verification.max_verify_rows(engine_config) if speculative_tokens else 0,
        decode_buckets=engine_config.decode_buckets, prefill_buckets=engine_config.prefill_buckets,
        width_buckets=dispatch.cost_grows_with_table_width(backend, kv_dtype))


def build(config: ModelConfig, params, *, backend: str, page_size: int, max_logprobs: int = 0,
          prefill_hidden_rows: int = 0, verify_row_tokens: int = 0, shardings=None,
          pooling: tuple[str, str] | None = None) -> StepFunctions:
    """The step functions of `config` (the model the step runs: a sharded replica's is
    `shardings.model_config`) with `backend`'s attention over pages of `page_size`.

    params: the weights the step reads (arrays or jax.ShapeDtypeStructs); a sharded step keeps
      their shardings. max_logprobs: top-k width of the sampler and prompt logprobs.
    prefill_hidden_rows: the forward also returns that many rows of its prefill tokens' residual
      stream (for prompt logprobs; 0: none). verify_row_tokens: K + 1 (0: no speculation).
    shardings: a `jaxserve.parallel.sharding.ModelShardings` for a step on its mesh, else None.
    pooling: (pooling type, a classifier's activation or "") for the pooling runner's step
      (jaxserve.pooling.poolers.pooled_step; one device only: EngineConfig refuses it sharded)."""
    mesh = None if shardings is None else shardings.mesh
    forward = functools.partial(_forward, config=config, backend=backend, mesh=mesh)
    step_forward = functools.partial(forward, prefill_hidden_rows=prefill_hidden_rows)
    verify_forward = functools.partial(step_forward, max_query_len=verify_row_tokens or None)
    multi_step = functools.partial(forward_steps, forward=forward, page_size=page_size)
    sample = functools.partial(sampler.sample, max_logprobs=max_logprobs)
    prompt = jax.jit(functools.partial(prompt_logprobs.compute, config=config, max_logprobs=max_logprobs))
    pool = None
    if pooling is not None:
        pool = jax.jit(functools.partial(poolers.pooled_step, forward=forward, config=config,
                                         pooling_type=pooling[0], activation=pooling[1]), donate_argnums=(1,))
    if shardings is None:
        return StepFunctions(jax.jit(step_forward, donate_argnums=(1,)), jax.jit(verify_forward, donate_argnums=(1,)),
                             jax.jit(multi_step, donate_argnums=(1,)), jax.jit(sample), prompt, pool)
    # One step for the whole mesh; logits gathered (replicated) for the sampler.
    kv = {"k": shardings.kv_cache, "v": shardings.kv_cache}
    weights = jax.tree.map(lambda a: a.sharding, params)  # quantized leaves: per array
    replicated = shardings.replicated
    forward_out = (replicated, kv, replicated) if prefill_hidden_rows else (replicated, kv)
    jit_forward = functools.partial(jax.jit, donate_argnums=(1,), in_shardings=(weights, kv, replicated),
                                    out_shardings=forward_out)
    return StepFunctions(
        jit_forward(step_forward), jit_forward(verify_forward),
        jax.jit(multi_step, donate_argnums=(1,), in_shardings=(weights, kv, replicated, replicated, replicated),
                out_shardings=(replicated, kv)),
        jax.jit(sample, in_shardings=replicated, out_shardings=replicated), prompt)


def _forward(params, kv_cache, batch, **static):
    """llama.forward, with the LoRA slab the params carry under "lora" (an engine with
    --enable_lora: jaxserve.executor.lora_slots.LoRASlots), if any."""
    return llama.forward(params, kv_cache, batch, lora=params.get("lora"), **static)


def forward_steps(params, kv_cache, arrays, sampling, num_steps, *, forward: Callable, page_size: int):
    """`num_steps` decode steps of `forward` (llama.forward, its static arguments bound) in one
    call: decode_loop.decode_steps, `arrays` and `sampling` as there. Returns (tokens
    int32[rows, max_steps], kv_cache)."""
    def step_logits(kv_cache, batch):
        return forward(params, kv_cache, batch)[:2]
    return decode_loop.decode_steps(step_logits, kv_cache, arrays, sampling, num_steps, page_size=page_size)
