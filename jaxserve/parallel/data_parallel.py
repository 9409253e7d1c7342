"""Data parallelism: independent engine replicas, each on its own row of the device mesh.

Every replica has its own weights (sharded over its `tensor_parallel_size` devices), KV page
pool, scheduler and step loop; nothing crosses between replicas during a step. The offline
`DataParallelEngine` splits a batch of prompts across replicas and runs them in threads (a
step blocks only on its own devices; XLA releases the GIL); the server's async client
(`jaxserve.async_engine.AsyncEngine`) steps each replica in its own thread and routes each
request to the one with the fewest in flight.
README "Multi-device" explains, with measurements, why replicas rather than a batch sharded
over the "data" mesh axis.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Sequence

import jax

from jaxserve.core.outputs import EngineStats
from jaxserve.executor import device_setup
from jaxserve.parallel import multihost, sharding
from jaxserve.planning import memory

log = logging.getLogger(__name__)


def build_engine(engine_cls, model_config, tokenizer, cfg, *, model_name: str,
                 load_params: Callable):
    """The one engine builder: an `engine_cls` (one replica) or a DataParallelEngine of
    `cfg.data_parallel_size` replicas, each on its own `cfg.tensor_parallel_size` devices.

    load_params(shardings) returns the weights of one replica: `shardings` is that replica's
    `sharding.ModelShardings` (restore into `shardings.checkpoint_shardings()`), or None for a
    single device. The split is checked before any weight is loaded (ValueError), and each
    replica's memory budget is read before its weights take memory (the planner subtracts them)."""
    tp, dp, ep = cfg.tensor_parallel_size, cfg.data_parallel_size, cfg.enable_expert_parallel
    sharding.with_expert_parallel(model_config, ep, tp)  # a dense model or experts that do not divide: refused
    if tp == 1 and dp == 1:
        replica_shardings = [None]
    else:
        mesh = sharding.make_mesh(model_config, tp, dp, expert_parallel=ep)
        replica_shardings = [sharding.ModelShardings.create(model_config, replica_mesh, expert_parallel=ep)
                             for replica_mesh in sharding.replica_meshes(mesh)]
    engines = []
    for index, shardings in enumerate(replica_shardings):
        if multihost.is_multihost():
            budget = None if cfg.num_pages else _agreed_memory_budget(shardings, index)
            rss_before = multihost.rss_bytes()
            params = load_params(shardings)
            _log_loaded_weights(params, rss_before, shardings)
        else:
            budget = None if cfg.num_pages else device_setup.memory_budget_bytes(shardings)
            params = load_params(shardings)
        engines.append(engine_cls(model_config, params, tokenizer, cfg, model_name=model_name,
                                  shardings=shardings, device_memory_bytes=budget))
    return engines[0] if dp == 1 else DataParallelEngine(engines)


def _agreed_memory_budget(shardings, index: int) -> int:
    """Several processes (jax.distributed): the memory budget of this process's first device of
    the replica, the smallest over the processes, so that every process plans the same KV pool."""
    device = next(d for d in shardings.mesh.devices.flat if d.process_index == jax.process_index())
    return multihost.agree_min(f"memory_budget/{index}", memory.device_memory_budget_bytes(device))


def _log_loaded_weights(params, rss_before: int | None, shardings) -> None:
    """Logs what one process of a multi-host job holds of the weights, and its RSS growth; under
    expert parallelism also the routed experts its devices hold."""
    local = sum(s.data.nbytes for leaf in jax.tree.leaves(params) for s in leaf.addressable_shards)
    total = sum(leaf.nbytes for leaf in jax.tree.leaves(params))
    rss_after = multihost.rss_bytes()
    mib = lambda b: b / 2**20
    experts = ""
    if shardings is not None and shardings.expert_parallel:
        held = {name: addressable_experts(weight) for name, weight in params["layers"].items()
                if name.endswith("_exps") and isinstance(weight, jax.Array)}
        experts = "; routed experts " + ", ".join(
            f"{name} {_ranges(indices)}" for name, indices in held.items()) + f" of {shardings.model_config.num_experts}"
    log.info("process %d of %d: weights loaded: %.1f MiB on this process's devices of %.1f MiB in all; "
             "RSS %.1f MiB -> %.1f MiB%s", jax.process_index(), jax.process_count(), mib(local), mib(total),
             mib(rss_before or 0), mib(rss_after or 0), experts)


def addressable_experts(weight: jax.Array) -> list[int]:
    """The routed experts (axis 1 of an [L, E, ...] expert weight) of which this process's
    devices hold any part, in order."""
    experts = range(weight.shape[1])
    return sorted({e for shard in weight.addressable_shards for e in experts[shard.index[1]]})


def _ranges(indices: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5"."""
    runs: list[list[int]] = []
    for i in indices:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ",".join(f"{a}-{b}" if b > a else f"{a}" for a, b in runs)


def sum_stats(stats: Sequence[EngineStats]) -> EngineStats:
    """The replicas' stats added up (tuples of counters element-wise, of names merged; the LoRA
    slots, the same on every replica, taken once)."""
    def add(values):
        values = list(values)
        if isinstance(values[0], tuple) and any(isinstance(v, str) for t in values for v in t):
            return tuple(sorted(set().union(*values)))
        if isinstance(values[0], tuple):
            return tuple(map(sum, zip(*values)))
        return sum(values)
    fields = [f.name for f in dataclasses.fields(EngineStats)]
    summed = {name: add(getattr(s, name) for s in stats) for name in fields}
    return EngineStats(**{**summed, "max_lora": max(s.max_lora for s in stats)})


class DataParallelEngine:
    """Replicas behind the offline API of `Engine` (check_request, generate, stats)."""

    def __init__(self, replicas: list):
        self.replicas = replicas
        first = replicas[0]
        self.config, self.model_config = first.config, first.model_config
        self.tokenizer, self.model_name, self.max_model_len = first.tokenizer, first.model_name, first.max_model_len
        self.pooler = first.pooler  # the pooling runner's (None: the engines generate)
        self.image_processor = first.image_processor  # a vision-language model's (None: a text model)

    def check_request(self, prompt_token_ids, params, multimodal=None) -> None:
        self.replicas[0].check_request(prompt_token_ids, params, multimodal)

    def stats(self) -> EngineStats:
        return sum_stats([r.stats() for r in self.replicas])

    def generate(self, prompts, params, *, request_ids=None, on_finish=None, multimodal=None) -> list:
        """Engine.generate over the replicas: prompts are split by estimated work (prompt plus
        max_tokens, longest first), each replica runs its share in a thread; results in order.
        `multimodal`: each prompt's images (MultimodalInputs or None), as Engine.generate."""
        params_list = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        images = list(multimodal) if multimodal is not None else [None] * len(prompts)
        ids = list(request_ids or [f"gen-{uuid.uuid4().hex[:12]}-{i}" for i in range(len(prompts))])
        shares: list[list[int]] = [[] for _ in self.replicas]
        load = [0] * len(self.replicas)
        for i in sorted(range(len(prompts)), key=lambda i: -(len(prompts[i]) + params_list[i].max_tokens)):
            r = min(range(len(load)), key=load.__getitem__)
            shares[r].append(i)
            load[r] += len(prompts[i]) + params_list[i].max_tokens
        lock = threading.Lock()

        def locked_on_finish(result):
            if on_finish is not None:
                with lock:
                    on_finish(result)

        def run(replica, share):
            share = sorted(share)
            return share, replica.generate([prompts[i] for i in share], [params_list[i] for i in share],
                                           request_ids=[ids[i] for i in share], on_finish=locked_on_finish,
                                           multimodal=[images[i] for i in share])

        results: list = [None] * len(prompts)
        with ThreadPoolExecutor(len(self.replicas), thread_name_prefix="jaxserve-replica") as pool:
            futures = [pool.submit(run, r, s) for r, s in zip(self.replicas, shares) if s]
            for future in futures:
                share, outputs = future.result()
                for i, out in zip(share, outputs):
                    results[i] = out
        return results
