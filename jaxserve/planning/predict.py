"""Latency and throughput predictor: a roofline of the engine's steps on one device.

The model. A step computes `tokens` token rows (decode rows + prefill tokens); each row reads the
K/V of its context. On one device (tensor parallelism splits heads, MLP columns and vocabulary
as jaxserve.planning.memory does), with a = compute-dtype bytes, the step is two kinds of work:

  linear layers (and lm_head):
    bytes       = weights_bytes                          every weight read once (quantized sizes)
                + activation_bytes_per_token * tokens    per layer 4 d + (2 hq + 2 hkv) hd + 4 f
                                                          elements, and the float32 logits twice
    flops       = 2 * matmul_params * tokens             (the embedding lookup multiplies nothing)
  attention:
    bytes       = kv_bytes_per_token * (kv_read + tokens)  K/V read for every row's context, and written
    flops       = 4 * layers * hq * hd * pairs           QK^T and PV of every (query, key) pair
  interconnect (tensor_parallel_size n > 1): two all-reduces of [tokens, d] per layer (after the
                attention and MLP outputs) and one all-gather of the [tokens, vocab / n] float32
                logits, a ring moving 2 (n - 1) / n of each all-reduce and (n - 1) / n of the
                gather per device, plus COLLECTIVE_LATENCY_S per collective

    seconds     = max(linear bytes / bandwidth, linear flops / peak)
                + max(attention bytes / bandwidth, attention flops / peak)
                + interconnect_bytes / interconnect_bandwidth + collectives * COLLECTIVE_LATENCY_S

Each kind is bound by its own ceiling and the kinds run one after the other (a layer's matmuls,
then its attention, then its collective: nothing in the step overlaps them), so their times add,
rather than the step's total bytes and FLOPs meeting one roofline. The bound named is the ceiling
that accounts for most of the seconds: "bandwidth", "compute" or "interconnect".

The ceilings are the device's: a GPU preset's datasheet figures or the flags, one bandwidth and
one peak for all the work. On the CPU, where the probe (jaxserve.planning.probe) measures them,
they are the rates the step's own operations reach at the step's number of rows
(`Ceilings.operators`): a float32 matmul of the model's shape reads its weights at a fraction of a
plain copy's bandwidth and multiplies at a fraction of the large-matmul rate when it has few rows,
and the decode attention kernel walks its pages at a bandwidth of its own. No efficiency factor is
fitted to a measured step: the probe times single operations, never the step predicted. A run
reaches a fraction of the ceilings, which the engine's step records report (`StepCostModel.step`,
the same arithmetic). Decode TPOT at batch B and context C: one step of B rows, kv_read = B C,
pairs = B (C + 1). TTFT of a prompt of L tokens: its prefill chunks of the step's token budget,
each reading the weights again, then the first token comes out of the last chunk. Host time
(scheduling, sampling on the host) is not in it.

Pure host arithmetic on ModelConfig and the memory plan; the per-device parameter counts come
from jaxserve.planning.memory (which reads the model's weight declaration).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Sequence

from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.planning import memory
from jaxserve.planning import gpu_targets

# Latency of one collective over NVLink (a small NCCL all-reduce takes some microseconds): the
# floor of the interconnect term, per collective.
COLLECTIVE_LATENCY_S = 10e-6
BOUNDS = ("bandwidth", "compute", "interconnect")
LOGITS_BYTES = 4  # the logits are float32


class PredictError(ValueError):
    """Bad input to the predictor (non-positive ceilings, batch sizes, lengths)."""


@dataclasses.dataclass(frozen=True)
class OperatorCeilings:
    """What the step's operations reach on this machine at `rows` token rows (the CPU probe):
    bytes/s and FLOP/s of the linear layers' matmul, bytes/s of the decode attention kernel."""
    rows: int
    matmul_bandwidth: float
    matmul_flops: float
    attention_bandwidth: float
    compute_dtype: str = "float32"  # what the matmul multiplied in (prompt chunks: maybe bfloat16 or int8)


@dataclasses.dataclass(frozen=True)
class Ceilings:
    """What one device can do at most: bytes/s of memory, FLOP/s, and bytes/s it sends to its
    tensor-parallel peers in one direction (None: unknown; only needed with tensor parallelism).
    `operators` (the CPU probe; empty for presets and flags): the rates of the step's own
    operations at a few row counts, which replace the two device-wide figures for the step's work."""
    memory_bandwidth: float
    peak_flops: float
    interconnect_bandwidth: float | None
    source: str  # where the figures come from: a GPU preset, a probe, the flags
    operators: tuple[OperatorCeilings, ...] = ()

    def at_rows(self, rows: int) -> OperatorCeilings:
        """The ceilings of a step of `rows` token rows: the device-wide figures, or the probed
        operators' rates interpolated on log2(rows) between the row counts probed (the nearest
        one's outside them)."""
        if not self.operators:
            return OperatorCeilings(rows, self.memory_bandwidth, self.peak_flops, self.memory_bandwidth)
        probed = sorted(self.operators, key=lambda o: o.rows)
        if rows <= probed[0].rows or len(probed) == 1:
            return probed[0] if rows <= probed[0].rows else probed[-1]
        if rows >= probed[-1].rows:
            return probed[-1]
        upper = next(i for i, o in enumerate(probed) if o.rows >= rows)
        lo, hi = probed[upper - 1], probed[upper]
        w = (math.log2(rows) - math.log2(lo.rows)) / (math.log2(hi.rows) - math.log2(lo.rows))
        mix = lambda a, b: a + w * (b - a)  # noqa: E731
        return OperatorCeilings(rows, mix(lo.matmul_bandwidth, hi.matmul_bandwidth),
                                mix(lo.matmul_flops, hi.matmul_flops),
                                mix(lo.attention_bandwidth, hi.attention_bandwidth), hi.compute_dtype)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _positive(name: str, value: float | None) -> float | None:
    if value is not None and not value > 0:
        raise PredictError(f"{name} must be positive, got {value}")
    return value


def resolve_ceilings(cfg: EngineConfig, target: str | None = None,
                     probe: Callable[[], tuple] | None = None) -> Ceilings | None:
    """The device ceilings: cfg's memory_bandwidth_gbps / peak_tflops / interconnect_gbps where
    set, else the `target` GPU preset's (memory bandwidth from its proto; bfloat16 dense peak and
    half the NVLink figure, one direction, from gpu_targets), else `probe()` -> (bytes/s, FLOP/s)
    or (bytes/s, FLOP/s, [OperatorCeilings]) for what is still missing; the probed operators'
    rates are kept only when no flag gave a ceiling (a flag's figure is then the ceiling for all
    the work). None when bandwidth or peak stays unknown (no target, no probe)."""
    bandwidth = _positive("memory_bandwidth_gbps", cfg.memory_bandwidth_gbps)
    peak = _positive("peak_tflops", cfg.peak_tflops)
    link = _positive("interconnect_gbps", cfg.interconnect_gbps)
    given = [bandwidth is not None, peak is not None]
    bandwidth, peak, link = (None if v is None else v * s for v, s in ((bandwidth, 1e9), (peak, 1e12), (link, 1e9)))
    source, operators = "flags", ()
    if target is not None:
        bandwidth = bandwidth or gpu_targets.target_memory_bandwidth(target)
        peak = peak or gpu_targets.TARGET_PEAK_BF16_FLOPS[target]
        link = link or gpu_targets.TARGET_NVLINK_BYTES_PER_S[target] / 2
        source = f"{target} preset" + (" and flags" if any(given) else "")
    elif not all(given) and probe is not None:
        probed_bandwidth, probed_peak, *probed_operators = probe()
        if not any(given) and probed_operators:
            operators = tuple(probed_operators[0])
        bandwidth, peak = bandwidth or probed_bandwidth, peak or probed_peak
        source = "cpu probe" + (" and flags" if any(given) else "")
    if bandwidth is None or peak is None:
        return None
    return Ceilings(float(bandwidth), float(peak), None if link is None else float(link), source, operators)


@dataclasses.dataclass(frozen=True)
class StepCost:
    """What one step of `rows` token rows moves and computes on one device; `attention_bytes` and
    `attention_flops` are the attention's part of `bytes` and `flops` (the rest is the linear layers')."""
    bytes: float
    flops: float
    interconnect_bytes: float
    collectives: int
    attention_bytes: float = 0.0
    attention_flops: float = 0.0
    rows: int = 1

    def times(self, ceilings: Ceilings) -> dict[str, float]:
        """Seconds of the work each ceiling binds: "bandwidth" and "compute" sum the linear layers'
        and the attention's time (at `ceilings.at_rows(rows)`'s rates) under whichever of the two
        binds each on the device-wide roofline; "interconnect" is the collectives' (0 without)."""
        link = 0.0
        if self.collectives:
            if ceilings.interconnect_bandwidth is None:
                raise PredictError("tensor parallelism needs the interconnect bandwidth (--interconnect_gbps)")
            link = self.interconnect_bytes / ceilings.interconnect_bandwidth + self.collectives * COLLECTIVE_LATENCY_S
        at = ceilings.at_rows(max(self.rows, 1))
        times = {"bandwidth": 0.0, "compute": 0.0, "interconnect": link}
        for moved, computed, bandwidth, peak in (
                (self.bytes - self.attention_bytes, self.flops - self.attention_flops, at.matmul_bandwidth,
                 at.matmul_flops),
                (self.attention_bytes, self.attention_flops, at.attention_bandwidth, ceilings.peak_flops)):
            # The time at the rates this work reaches; the bound it is charged to by the device's
            # roofline (a probed rate comes from one timing, which alone cannot say what bound it).
            bound = "bandwidth" if moved / ceilings.memory_bandwidth >= computed / ceilings.peak_flops else "compute"
            times[bound] += max(moved / bandwidth, computed / peak)
        return times

    def seconds_and_bound(self, ceilings: Ceilings) -> tuple[float, str]:
        """The step's seconds (the sum of `times`) and the ceiling that binds most of them."""
        times = self.times(ceilings)
        return sum(times.values()), max(BOUNDS, key=times.__getitem__)


@dataclasses.dataclass(frozen=True)
class StepCostModel:
    """Per-model constants of the roofline (per device), so that a step's cost is a few
    multiplications (the engine prices every step with it)."""
    weights_bytes: int
    kv_bytes_per_token: int
    activation_bytes_per_token: int
    matmul_params: int  # parameters multiplied per token: linear layers + lm_head
    attention_flops_per_pair: int  # 4 * layers * heads * head_dim
    interconnect_bytes_per_token: float
    collectives_per_step: int

    @classmethod
    def create(cls, model: ModelConfig, *, weight_dtype: str, compute_dtype: str, kv_cache_dtype: str,
               tensor_parallel_size: int = 1, weights_bytes: int | None = None) -> "StepCostModel":
        """The constants for `model` with these dtypes over `tensor_parallel_size` devices;
        `weights_bytes` (measured) replaces memory.weights_bytes's estimate."""
        tp = tensor_parallel_size
        a = memory.FLOAT_DTYPE_BYTES[memory.normalize_dtype(compute_dtype, tuple(memory.FLOAT_DTYPE_BYTES))]
        hq, hkv = model.num_q_heads // tp, memory.kv_heads_per_device(model, tp)
        f, vocab = math.ceil(model.intermediate_size / tp), math.ceil(model.vocab_size / tp)
        per_layer = 4 * model.hidden_size + (2 * hq + 2 * hkv) * model.head_dim + 4 * f
        counts = memory.count_params(model, tp)
        if weights_bytes is None:
            weights_bytes = memory.weights_bytes(model, weight_dtype, tp)
            if memory.quant_format(memory.normalize_dtype(weight_dtype, memory.WEIGHT_DTYPES)) is not None:
                # Quantized: the rest (embeddings, norms, biases) is held in the compute dtype, not
                # the planner's bfloat16 (float32 on the CPU).
                rest = counts["embeddings"] + counts["norms"] + counts["biases"]
                weights_bytes += rest * (a - memory.FLOAT_DTYPE_BYTES[memory.QUANTIZED_COMPUTE_DTYPE])
        link = 0.0
        if tp > 1:
            link = (model.num_layers * 2 * model.hidden_size * a * 2 * (tp - 1) / tp
                    + vocab * LOGITS_BYTES * (tp - 1))
        return cls(
            weights_bytes=int(weights_bytes),
            kv_bytes_per_token=memory.kv_bytes_per_token(model, kv_cache_dtype, tp),
            activation_bytes_per_token=model.num_layers * per_layer * a + 2 * vocab * LOGITS_BYTES,
            matmul_params=counts["linear"] + vocab * model.hidden_size,
            attention_flops_per_pair=4 * model.num_layers * hq * model.head_dim,
            interconnect_bytes_per_token=link, collectives_per_step=2 * model.num_layers + 1 if tp > 1 else 0)

    def step(self, num_tokens: int, kv_tokens_read: int, attention_pairs: int) -> StepCost:
        """One step of `num_tokens` token rows whose rows read `kv_tokens_read` cached tokens' K/V
        in all and whose attention covers `attention_pairs` (query, key) pairs."""
        attention_bytes = float(self.kv_bytes_per_token * (kv_tokens_read + num_tokens))
        attention_flops = float(self.attention_flops_per_pair * attention_pairs)
        return StepCost(
            bytes=float(self.weights_bytes + self.activation_bytes_per_token * num_tokens) + attention_bytes,
            flops=float(2 * self.matmul_params * num_tokens) + attention_flops,
            interconnect_bytes=self.interconnect_bytes_per_token * num_tokens,
            collectives=self.collectives_per_step if num_tokens else 0,
            attention_bytes=attention_bytes, attention_flops=attention_flops, rows=num_tokens)

    def decode(self, batch: int, context: int) -> StepCost:
        """A decode step of `batch` rows, each at `context` cached tokens."""
        return self.step(batch, batch * context, batch * (context + 1))

    def prefill(self, prompt_len: int, chunk: int) -> list[StepCost]:
        """The prefill steps of one prompt in chunks of `chunk` tokens (each sees the chunks before)."""
        costs = []
        for start in range(0, prompt_len, chunk):
            end = min(start + chunk, prompt_len)
            costs.append(self.step(end - start, start, (end * (end + 1) - start * (start + 1)) // 2))
        return costs


def cost_model_for_plan(model: ModelConfig, plan: memory.MemoryPlan) -> StepCostModel:
    """The cost model of the engine `plan` sizes (its dtypes and split). The weight bytes are
    the estimate of what a step reads, not the plan's resident bytes (which count the CPU
    step's second layout of quantized weights)."""
    return StepCostModel.create(model, weight_dtype=plan.weight_dtype, compute_dtype=plan.compute_dtype,
                                kv_cache_dtype=plan.kv_cache_dtype, tensor_parallel_size=plan.tensor_parallel_size)


def prefill_chunk(cfg: EngineConfig) -> int:
    """Tokens of one prompt per step: the step budget, at most the long-prefill threshold."""
    return min(cfg.max_num_batched_tokens, cfg.long_prefill_token_threshold or cfg.max_num_batched_tokens)


def _point(cost: StepCost, ceilings: Ceilings) -> dict[str, Any]:
    times = cost.times(ceilings)
    seconds, bound = sum(times.values()), max(BOUNDS, key=times.__getitem__)
    return {"ms": seconds * 1e3, "bound": bound, "bytes": cost.bytes, "flops": cost.flops,
            **{f"{name}_ms": t * 1e3 for name, t in times.items()}}


def predict(model: ModelConfig, plan: memory.MemoryPlan, cfg: EngineConfig, ceilings: Ceilings, *,
            batch_sizes: Sequence[int], context_len: int, prompt_len: int) -> dict[str, Any]:
    """Decode TPOT at each batch size (at `context_len`), TTFT of a `prompt_len` prompt and the
    most decode tokens/s at the concurrency the engine allows (max_num_seqs, or fewer when the KV
    pool holds fewer sequences of `context_len` tokens), as a JSON-able dict."""
    for name, value in (("context_len", context_len), ("prompt_len", prompt_len), *(
            ("batch size", b) for b in batch_sizes)):
        if not isinstance(value, int) or value < 1:
            raise PredictError(f"{name} must be a positive integer, got {value!r}")
    if not batch_sizes:
        raise PredictError("give at least one batch size")
    costs = cost_model_for_plan(memory.parallel_model(model, cfg), plan)
    pages_per_seq = math.ceil(context_len / plan.page_size)
    kv_limit = (plan.num_pages - 1) // pages_per_seq
    decode = []
    for batch in batch_sizes:
        point = _point(costs.decode(batch, context_len), ceilings)
        tpot_ms = point.pop("ms")
        decode.append({"batch_size": batch, "context_len": context_len, "tpot_ms": tpot_ms,
                       "fits": batch <= min(kv_limit, plan.max_num_seqs), **point,
                       "tokens_per_s": batch / tpot_ms * 1e3})
    chunks = costs.prefill(prompt_len, prefill_chunk(cfg))
    steps = [cost.seconds_and_bound(ceilings) for cost in chunks]
    ttft_bounds = sorted({bound for _, bound in steps}, key=lambda b: -sum(s for s, x in steps if x == b))
    concurrency = min(plan.max_num_seqs, kv_limit)
    best = _point(costs.decode(concurrency, context_len), ceilings) if concurrency else None
    return {
        "ceilings": ceilings.to_dict(),
        "cost_model": dataclasses.asdict(costs),
        "decode": decode,
        "ttft": {"prompt_len": prompt_len, "chunk_tokens": prefill_chunk(cfg), "steps": len(chunks),
                 "ttft_ms": sum(s for s, _ in steps) * 1e3, "bound": ttft_bounds[0],
                 "compute_dtype": ceilings.at_rows(prefill_chunk(cfg)).compute_dtype},
        "max_decode_throughput": {
            "concurrency": concurrency, "max_num_seqs": plan.max_num_seqs, "kv_limited_seqs": kv_limit,
            "context_len": context_len, "limited_by": "max_num_seqs" if plan.max_num_seqs <= kv_limit else "kv_cache",
            "tpot_ms": best["ms"] if best else None, "bound": best["bound"] if best else None,
            "tokens_per_s": concurrency / best["ms"] * 1e3 if best else 0.0},
    }


def format_table(prediction: dict[str, Any]) -> str:
    """A human-readable view of `predict`'s result."""
    c = prediction["ceilings"]
    link = "-" if c["interconnect_bandwidth"] is None else f"{c['interconnect_bandwidth'] / 1e9:,.0f} GB/s"
    lines = [f"ceilings ({c['source']}): memory {c['memory_bandwidth'] / 1e9:,.1f} GB/s, compute "
             f"{c['peak_flops'] / 1e12:,.2f} TFLOP/s, interconnect {link}",
             *[f"  at {o['rows']} rows (probed): matmul {o['matmul_bandwidth'] / 1e9:,.1f} GB/s and "
               f"{o['matmul_flops'] / 1e9:,.1f} GFLOP/s ({o['compute_dtype']}), decode attention "
               f"{o['attention_bandwidth'] / 1e9:,.1f} GB/s"
               for o in c.get("operators") or ()],
             f"{'batch':>6} {'context':>8} {'TPOT ms':>9} {'bound':>12} {'bw ms':>9} {'compute ms':>10} "
             f"{'link ms':>8} {'tok/s':>9} {'fits':>5}"]
    for d in prediction["decode"]:
        lines.append(f"{d['batch_size']:>6} {d['context_len']:>8} {d['tpot_ms']:>9.2f} {d['bound']:>12} "
                     f"{d['bandwidth_ms']:>9.2f} {d['compute_ms']:>10.2f} {d['interconnect_ms']:>8.2f} "
                     f"{d['tokens_per_s']:>9,.0f} {'yes' if d['fits'] else 'NO':>5}")
    t, m = prediction["ttft"], prediction["max_decode_throughput"]
    lines.append(f"TTFT of a {t['prompt_len']}-token prompt: {t['ttft_ms']:,.1f} ms ({t['steps']} chunk(s) of "
                 f"{t['chunk_tokens']} tokens, {t['bound']}-bound, matmuls in {t['compute_dtype']})")
    if m["tpot_ms"] is None:
        lines.append("max decode throughput: no sequence of that context fits")
    else:
        lines.append(f"max decode throughput: {m['tokens_per_s']:,.0f} tokens/s at {m['concurrency']} sequences "
                     f"of {m['context_len']} tokens (limited by {m['limited_by']}; TPOT {m['tpot_ms']:.2f} ms, "
                     f"{m['bound']}-bound)")
    return "\n".join(lines)
