"""Multi-LoRA and embeddings on the GPU: bench/gpu_check.sh's `lora_pooling` step, which measures
what issues 50 and 51 ask of the CPU (bench/lora_decode.py, bench/lora_load.py, bench/pooling.py).

1. lora_decode (issue 50: the decode step with 4 adapters of rank 16 among 32 rows at most 1.3x a
   base-only step). A random-weight Llama-3-8B-shaped bfloat16 model (16 GB of weights: a LoRA
   update is small beside them, so the ratio says what the kernels' launches and reads cost; on
   SmolLM2's 0.27 GB a GPU step is launch-bound), 32 decode rows with contexts of 64-128 tokens,
   the steps of bench/lora_decode.py: base (llama.forward without a slab), lora (a bfloat16 slab,
   as the GPU engine's, of 4 random adapters of rank 16 on all seven projections, the rows on slots
   0-4 in turn) and lora-base (the same program, every row on slot 0), for each kernel family: the
   Triton kernels (attention backend "pallas": paged attention and lora_bgmv) and the Mosaic GPU
   ones (backend "mosaic": mosaic_decode and mosaic_lora), each family's base step through its own
   attention. The four programs are compiled at once on threads, then the six steps timed in turns
   (`repeats` each in `rounds` rounds; medians and minima). Check `adapters_applied/<family>`:
   every row on an adapter changes its logits from the base step's by more than
   ADAPTER_MARGIN times any row on slot 0 does (lora's slot-0 rows and every lora-base row), which a
   slab that is never read fails.
2. embeddings (issue 51: SmolLM2 as an embedding model embeds 256 inputs of 64 tokens in at most
   0.8x transformers' time, batches of 32, same run). bench/pooling.py's workload on a random-weight
   SmolLM2-135M-shaped bfloat16 model: jaxserve's pooling engine (--runner=pooling, last token,
   normalized; bench/pooling.py's limits: 64 sequences, 2048 batched tokens, 32 prefills;
   Engine.generate of every input at once) against transformers' Llama in bfloat16 on the same
   weights in this process (torch on the GPU: static batches of 32, the last token's row of
   last_hidden_state normalized, ids to the device and embeddings back to the host timed), an
   untimed pass of each first, then `rounds` rounds of fresh inputs timed in turns, the order
   rotating; medians, their ratio, tokens/s, and the step's roofline: its FLOPs (the linear layers
   and causal attention) over a bfloat16 matmul's FLOP/s measured here. Check
   `embeddings_vs_transformers`: the lowest cosine between the two sides' embeddings at least
   MIN_COSINE ("unknown" without torch: then only jaxserve's figures).
3. lora_load (issue 50: an adapter loaded at run time reaches its first token within 1 s of the
   load call). bench/lora_load.py's measurement, in process: an engine over the Llama-3-8B-shaped
   weights of part 1 with --enable_lora --max_loras=4 --max_lora_rank=16, one sequence at a time,
   the shapes its requests use compiled by an untimed base request; then `load_repeats` + 1 times:
   a random PEFT adapter of rank 16 on all seven projections of every layer written to a fresh
   folder (safetensors, as peft writes one: 168 MB at this shape; the same values each time), the
   load call (AsyncEngine.load_lora_adapter: what POST /v1/load_lora_adapter awaits) and at once a
   streamed greedy request naming the adapter; the seconds from the load call to its return and to
   the first token (the request stops there: the figure is the prefill's token, and no decode shape
   is compiled for it); a base request's first token beside, from its own start; the adapter
   unloaded. Every prompt is fresh random tokens (no prefix-cache hit). The first repeat (its slot
   write compiles) is kept apart from the medians and maxima. Check `lora_load`: every request
   produced its token.

Check `every_figure`: each figure measured, positive and finite, else unknown naming the missing.
The issues' targets are figures (`within_target`), not checks: a first GPU run that misses one has
measured it. Every figure is written to --out as measured (bench/gpu_check_report.StepReport), each
part in its own guard, a part's seconds in phase_s. `--small`: tiny models and loads, the same code
path (the CPU dry run: the kernels interpreted, the engines on the XLA path). Exit 1 when a check
failed or differed.

    python3 bench/lora_pooling_gpu.py --out=results.json [--small]
"""
from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import functools
import gc
import importlib.util
import math
import os
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jaxserve import platforms  # noqa: E402

platforms.default_to_cpu_without_gpu()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from bench.gpu_check_report import StepReport, require_gpu  # noqa: E402
from bench.lora_decode import smollm2_config  # noqa: E402
from bench.lora_load import adapter_tensors, save_adapter  # noqa: E402
from bench.step_profile import decode_batch, timed_in_turns  # noqa: E402
from jaxserve.config import ModelConfig  # noqa: E402
from jaxserve.core.request import SamplingParams, pooling_params  # noqa: E402
from jaxserve.engine import Engine, EngineConfig  # noqa: E402
from jaxserve.models import llama, lora, weights  # noqa: E402
from jaxserve.pooling.accumulate import finish_embedding  # noqa: E402
from pallas_kernels import compat, lora_bgmv, mosaic_lora  # noqa: E402

LLAMA3_8B = ModelConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
                        num_q_heads=32, num_kv_heads=8, head_dim=128, rope_theta=500000.0,
                        max_position_embeddings=8192)
# head_dim 64: the Mosaic kernels take multiples of 64 only. One layer: Mosaic GPU's interpreter
# takes about a second a layer for a step of 8 rows on the CPU (tests/test_mosaic_lora.py reads other layers).
TINY = ModelConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=1, num_q_heads=4,
                   num_kv_heads=2, head_dim=64, max_position_embeddings=1024)
TINY_SMOLLM2 = ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_q_heads=2,
                           num_kv_heads=1, head_dim=32, tie_word_embeddings=True, max_position_embeddings=256)
FULL = dict(lora_model=LLAMA3_8B, rows=32, contexts=(64, 128), repeats=10, rounds=3, load_repeats=5, prompt_tokens=8,
            embed_model=smollm2_config(), inputs=256, input_tokens=64, hf_batch=32, embed_rounds=5, matmul=8192,
            embed_limits=dict(max_num_seqs=64, max_num_batched_tokens=2048, max_num_prefill_seqs=32,
                              max_model_len=128))
SMALL = dict(lora_model=TINY, rows=8, contexts=(8, 16), repeats=1, rounds=1, load_repeats=2, prompt_tokens=8,
             embed_model=TINY_SMOLLM2, inputs=32, input_tokens=16, hf_batch=8, embed_rounds=2, matmul=128,
             embed_limits=dict(max_num_seqs=16, max_num_batched_tokens=64, max_num_prefill_seqs=4, max_model_len=32))
MAX_LORAS, RANK, PAGE_SIZE, DTYPE = 4, 16, 16, jnp.bfloat16
TARGETS = {"lora_over_base": 1.3, "first_token_s": 1.0, "embeddings_over_transformers": 0.8}
# Every row on an adapter must move its logits from the base step's by more than this many times
# any slot-0 row's difference (which two programs that round alike keep at or near zero).
ADAPTER_MARGIN = 4.0
# Lowest cosine between jaxserve's and transformers' embeddings, both bfloat16 on the same weights
# (bench/pooling.py: 0.9986 between jaxserve in bfloat16 and transformers in float32 on the CPU).
MIN_COSINE = 0.99
SEED = 51



def kernel_families(on_gpu: bool) -> dict[str, str]:
    """{family: attention backend}: Triton's, and Mosaic GPU's where this jax has it (compiled on a
    GPU, interpreted elsewhere). The backend also picks the LoRA kernel (pallas_kernels.dispatch)."""
    families = {"triton": "pallas" if on_gpu else "interpret"}
    if compat.has_mosaic_gpu():
        families["mosaic"] = "mosaic" if on_gpu else "mosaic_interpret"
    return families


# ---- 1. the decode step with adapters against the base model's ---------------------------------

def random_slab(config: ModelConfig, seed: int = 0) -> lora.Slab:
    """A bfloat16 slab (the GPU engine's lora_dtype) of MAX_LORAS random adapters of rank RANK on
    every projection (0.01 x normal, as bench/lora_decode.py's), slot 0 the zero adapter; made on the device."""
    shapes = lora.slab_shapes(config, MAX_LORAS, RANK)
    keys = iter(jax.random.split(jax.random.key(seed), 2 * len(shapes)))

    @functools.partial(jax.jit, static_argnums=(1,))
    def leaf(key, shape):
        return (0.01 * jax.random.normal(key, shape, jnp.float32)).astype(DTYPE).at[:, 0].set(0)

    return {name: {side: leaf(next(keys), shape) for side, shape in pair.items()} for name, pair in shapes.items()}


def kernel_takes(family: str, config: ModelConfig, rows: int) -> dict[str, bool]:
    """Per projection, whether the family's LoRA kernel takes its operands (else dispatch runs XLA's form)."""
    supports = lora_bgmv.supports if family == "triton" else mosaic_lora.supports
    takes = {}
    for name, (d_in, d_out) in lora.projection_shapes(config).items():
        x = jax.ShapeDtypeStruct((rows, d_in), DTYPE)
        a = jax.ShapeDtypeStruct((MAX_LORAS + 1, d_in, RANK), DTYPE)
        b = jax.ShapeDtypeStruct((MAX_LORAS + 1, RANK, d_out), DTYPE)
        takes[name] = bool(supports(x, a, b))
    return takes


def compile_steps(config, params, slab, batch, lora_batch, families: dict[str, str], report) -> dict:
    """{(family, "base" | "lora"): (compiled step, its own KV cache)}, compiled at once on threads
    (XLA compiles with the GIL released, as the engine's warm-up does); a program that fails is
    that family's failed check."""
    num_pages = batch["decode_block_table"].size + 1

    def job(backend, with_slab):
        forward = functools.partial(llama.forward, config=config, backend=backend)
        cache = llama.init_kv_cache(config, llama.KVCacheSpec(num_pages, PAGE_SIZE), DTYPE)
        if with_slab:
            step = jax.jit(lambda p, c, b, s: forward(p, c, b, lora=s), donate_argnums=(1,))
            return step.lower(params, cache, lora_batch, slab).compile(), cache
        step = jax.jit(lambda p, c, b: forward(p, c, b), donate_argnums=(1,))
        return step.lower(params, cache, batch).compile(), cache

    compiled = {}
    with concurrent.futures.ThreadPoolExecutor(2 * len(families)) as pool:
        futures = {(family, kind): pool.submit(job, backend, kind == "lora")
                   for family, backend in families.items() for kind in ("base", "lora")}
        for (family, kind), future in futures.items():
            with report.guard(f"adapters_applied/{family}"):
                compiled[family, kind] = future.result()
    return compiled


def relative_row_differences(logits: np.ndarray, base: np.ndarray) -> np.ndarray:
    """Per row, max |logits - base| / max |base| (over the whole step), float32."""
    return np.abs(logits - base).max(axis=1) / max(float(np.abs(base).max()), 1e-30)


def adapters_applied(base: np.ndarray, with_slab: np.ndarray, slab_base: np.ndarray, slots: np.ndarray) -> dict:
    """Check: every row on an adapter differs from the base step by more than ADAPTER_MARGIN x the
    most any slot-0 row does (lora's slot-0 rows and all lora-base rows)."""
    on_adapter = relative_row_differences(with_slab, base)[slots > 0]
    on_slot0 = np.concatenate([relative_row_differences(with_slab, base)[slots == 0],
                               relative_row_differences(slab_base, base)])
    smallest, largest = float(on_adapter.min()), float(on_slot0.max())
    ok = smallest > 0 and smallest > ADAPTER_MARGIN * largest and np.isfinite(with_slab).all()
    return {"status": "ok" if ok else "differ", "adapter_rows": int(on_adapter.size),
            "smallest_adapter_row_difference": smallest, "largest_slot0_row_difference": largest,
            "margin": ADAPTER_MARGIN}


def lora_decode(report, size: dict, config: ModelConfig, params, families: dict[str, str]) -> None:
    rows = size["rows"]
    max_pages = -(-max(size["contexts"]) // PAGE_SIZE)
    num_pages = rows * max_pages + 1
    batch = decode_batch(rows, *size["contexts"], PAGE_SIZE, num_pages, max_pages, seed=rows)
    slots = {"lora": np.arange(rows, dtype=np.int32) % (MAX_LORAS + 1), "lora-base": np.zeros(rows, np.int32)}
    lora_batches = {kind: {**batch, "lora_slots": s} for kind, s in slots.items()}
    slab = random_slab(config)
    report.put("lora_decode_setup", {
        "model": report["lora_model"], "rows": rows, "contexts": list(size["contexts"]), "max_loras": MAX_LORAS,
        "rank": RANK, "slab_dtype": jnp.dtype(DTYPE).name, "families": families,
        "slab_bytes": lora.slab_bytes(config, MAX_LORAS, RANK, DTYPE),
        "kernel_takes": {family: kernel_takes(family, config, rows) for family in families}})
    with report.phase("lora_decode/compile"):
        compiled = compile_steps(config, params, slab, batch, lora_batches["lora"], families, report)
    caches = {key: cache for key, (_, cache) in compiled.items()}
    runs, logits = {}, {}

    def make(family, kind, arguments):
        step = compiled[family, "base" if kind == "base" else "lora"][0]
        key = (family, "base" if kind == "base" else "lora")

        def run():
            out, caches[key] = step(params, caches[key], *arguments)
            return out.block_until_ready()
        return run

    for family in families:
        if (family, "base") not in compiled or (family, "lora") not in compiled:
            continue
        with report.guard(f"adapters_applied/{family}"):
            family_runs = {"base": make(family, "base", (batch,)),
                           "lora": make(family, "lora", (lora_batches["lora"], slab)),
                           "lora-base": make(family, "lora-base", (lora_batches["lora-base"], slab))}
            for kind, run in family_runs.items():  # the first calls: their logits checked, untimed
                logits[family, kind] = np.asarray(run(), np.float32)
            report.check(f"adapters_applied/{family}", **adapters_applied(
                logits[family, "base"], logits[family, "lora"], logits[family, "lora-base"], slots["lora"]))
            runs.update({(family, kind): run for kind, run in family_runs.items()})
    if not runs:
        return
    with report.phase("lora_decode/timed"):
        samples = timed_in_turns(runs, size["repeats"], size["rounds"])
    for family in families:
        if (family, "base") not in runs:
            continue
        row = {"family": family, "backend": families[family], "repeats": size["repeats"] * size["rounds"]}
        for statistic, reduce in (("median", statistics.median), ("min", min)):
            ms = {kind: 1e3 * reduce(samples[family, kind]) for kind in ("base", "lora", "lora-base")}
            row[statistic] = {"base_ms": ms["base"], "lora_ms": ms["lora"], "lora_base_ms": ms["lora-base"],
                              "lora_over_base": ms["lora"] / ms["base"],
                              "lora_base_rows_over_base": ms["lora-base"] / ms["base"]}
        row["base_ms"], row["lora_ms"] = row["median"]["base_ms"], row["median"]["lora_ms"]
        row["lora_over_base"] = row["median"]["lora_over_base"]
        row["lora_base_rows_over_base"] = row["median"]["lora_base_rows_over_base"]
        row["within_target"] = row["lora_over_base"] <= TARGETS["lora_over_base"]
        report.append("lora_decode", row)
    for key in list(caches):
        caches[key] = None
    del compiled, caches, runs, slab


# ---- 2. embeddings: jaxserve's pooling engine against transformers --------------------------------

def matmul_tflop_per_s(n: int, repeats: int = 10) -> float:
    """A bfloat16 n x n x n matmul's FLOP/s (float32 accumulation): the compute ceiling, measured here."""
    key_a, key_b = jax.random.split(jax.random.key(3))
    a, b = (jax.random.normal(k, (n, n), jnp.bfloat16) for k in (key_a, key_b))
    matmul = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32).astype(jnp.bfloat16))
    matmul(a, b).block_until_ready()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        matmul(a, b).block_until_ready()
        times.append(time.perf_counter() - start)
    return 2 * n**3 / statistics.median(times) / 1e12


def embedding_flops(config: ModelConfig, inputs: int, tokens: int) -> int:
    """FLOPs of embedding `inputs` prompts of `tokens` tokens: every token through the linear layers
    (no lm_head: a pooled step computes no logits), and causal attention (QK^T and PV, the
    position-i token seeing i keys)."""
    d, q, kv, f = config.hidden_size, config.q_size, config.kv_size, config.intermediate_size
    linear = d * q + 2 * d * kv + q * d + 3 * d * f
    attention = 4 * q * tokens * (tokens + 1) // 2  # per sequence and layer
    return inputs * config.num_layers * (2 * linear * tokens + attention)


def embedding_params(config: ModelConfig, seed: int = 2) -> dict:
    """Random bfloat16 weights, the norms drawn around 1 (bench/gpu_agreement.model_params)."""
    from bench.gpu_agreement import model_params
    return model_params(config, seed=seed)


def engine_embeddings(engine, inputs: np.ndarray) -> tuple[np.ndarray, float]:
    """bench/pooling.py's in-process side: every input submitted at once, embeddings on the host."""
    start = time.perf_counter()
    results = engine.generate([list(map(int, ids)) for ids in inputs], pooling_params())
    seconds = time.perf_counter() - start
    return np.stack([finish_embedding(r.pooled, True) for r in results]), seconds


def transformers_model(config: ModelConfig, params: dict):
    """transformers' Llama on the same weights in bfloat16, on the GPU when torch sees one."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from bench.gpu_agreement import hf_state_dict
    device = "cuda" if torch.cuda.is_available() else "cpu"
    hf_config = LlamaConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers, num_attention_heads=config.num_q_heads,
        num_key_value_heads=config.num_kv_heads, head_dim=config.head_dim,
        max_position_embeddings=config.max_position_embeddings, rms_norm_eps=config.rms_norm_eps,
        rope_theta=config.rope_theta, tie_word_embeddings=config.tie_word_embeddings)
    with torch.device(device):
        model = LlamaForCausalLM(hf_config).to(torch.bfloat16).eval()
    missing, unexpected = model.load_state_dict(hf_state_dict(config, params, torch), strict=False)
    if [m for m in missing if "rotary" not in m and not (config.tie_word_embeddings and m == "lm_head.weight")] \
            or unexpected:
        raise ValueError(f"transformers' weights: missing {missing}, unexpected {unexpected}")
    return model, device


def transformers_embeddings(model, device: str, inputs: np.ndarray, batch: int) -> tuple[np.ndarray, float]:
    """bench/pooling.py's transformers side: static batches, the last row of last_hidden_state
    normalized; the ids' copy to the device and the embeddings' to the host timed."""
    import torch
    out, start = [], time.perf_counter()
    with torch.no_grad():
        for i in range(0, len(inputs), batch):
            ids = torch.as_tensor(inputs[i:i + batch], device=device)
            hidden = model.model(ids).last_hidden_state[:, -1].float()
            out.append(torch.nn.functional.normalize(hidden, dim=-1))
        vectors = torch.cat(out).cpu().numpy()  # waits for the device
    return vectors, time.perf_counter() - start


def lowest_cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.min(np.sum(a * b, -1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))))


def embeddings(report, size: dict) -> None:
    config, n, tokens = size["embed_model"], size["inputs"], size["input_tokens"]
    limits = size["embed_limits"]
    with report.guard("matmul"):
        report.put("matmul_tflop_per_s", matmul_tflop_per_s(size["matmul"]))
    params = embedding_params(config)
    pages = limits["max_num_seqs"] * -(-limits["max_model_len"] // PAGE_SIZE) + 1
    engine = Engine(config, params, None, EngineConfig(runner="pooling", dtype="bfloat16", page_size=PAGE_SIZE,
                                                       num_pages=pages, warmup=False, **limits),
                    model_name="smollm2-shaped embeddings")
    row = report.put("embeddings", {"model": report["embed_model"], "inputs": n, "input_tokens": tokens,
                                    "hf_batch": size["hf_batch"], "dtype": "bfloat16", "limits": limits,
                                    "attention_backend": engine.runner.backend,
                                    "flops": embedding_flops(config, n, tokens)})
    inputs = lambda r: np.random.default_rng([SEED, r]).integers(10, config.vocab_size, (n, tokens))  # noqa: E731
    sides = {"jaxserve": lambda ids: engine_embeddings(engine, ids)}
    if importlib.util.find_spec("torch") is None:
        missing = "no torch here: transformers not run"
    else:
        missing = "transformers failed (see its check)"
        with report.guard("transformers"):
            model, device = transformers_model(config, params)
            row["transformers_device"] = device
            sides["transformers"] = lambda ids: transformers_embeddings(model, device, ids, size["hf_batch"])
    with report.phase("embeddings/warm"):  # an untimed pass each: every shape jaxserve's steps use compiled
        for name, side in list(sides.items()):
            with report.guard(f"embeddings/{name}"):
                side(inputs(size["embed_rounds"]))  # inputs no timed round uses
            if f"embeddings/{name}" in report["checks"]:  # failed: its check says why
                del sides[name]
    if "jaxserve" not in sides:
        return
    seconds, vectors = {name: [] for name in sides}, {}
    with report.phase("embeddings/timed"):
        for r in range(size["embed_rounds"]):  # fresh inputs each round: no prefix-cache hit on an earlier one
            names = list(sides)[r % len(sides):] + list(sides)[:r % len(sides)]
            ids = inputs(r)
            for name in names:
                vectors[name], taken = sides[name](ids)
                seconds[name].append(taken)
    row["seconds"] = seconds
    ours = statistics.median(seconds["jaxserve"])
    row.update(jaxserve_s=ours, tokens_per_s=n * tokens / ours)
    if report.get("matmul_tflop_per_s"):
        row["roofline_s"] = row["flops"] / (report["matmul_tflop_per_s"] * 1e12)
        row["fraction_of_roofline"] = row["roofline_s"] / ours
    norms = np.linalg.norm(vectors["jaxserve"], axis=-1)
    row["largest_norm_error"] = float(np.abs(norms - 1).max())
    if "transformers" in seconds:
        theirs = statistics.median(seconds["transformers"])
        cosine = lowest_cosine(vectors["jaxserve"], vectors["transformers"])
        row.update(transformers_s=theirs, transformers_tokens_per_s=n * tokens / theirs,
                   over_transformers=ours / theirs, round_ratios=[a / b for a, b in zip(seconds["jaxserve"],
                                                                                        seconds["transformers"])],
                   within_target=ours / theirs <= TARGETS["embeddings_over_transformers"], lowest_cosine=cosine)
        report.check("embeddings_vs_transformers", "ok" if cosine >= MIN_COSINE else "differ",
                     lowest_cosine=cosine, bound=MIN_COSINE)
    else:
        report.check("embeddings_vs_transformers", "unknown", reason=missing)
    report.write()
    del engine, sides
    gc.collect()


# ---- 3. an adapter loaded at run time: from the load call to its first token ------------------------

async def first_token(engine, request_id: str, prompt: list[int], params: SamplingParams,
                      start: float) -> tuple[float | None, int]:
    """(seconds from `start` to the first token, tokens) of one streamed request."""
    first, count = None, 0
    async for out in engine.generate(request_id, prompt, params):
        count += len(out.new_token_ids)
        if first is None and out.new_token_ids:
            first = time.perf_counter() - start
    return first, count


def load_summary(rows: list[dict]) -> dict:
    """Medians and maxima of the repeats after the first (whose slot write compiles: kept apart)."""
    rest = rows[1:]
    summary = {key: {"median": statistics.median(r[key] for r in rest), "max": max(r[key] for r in rest)}
               for key in ("load_s", "first_token_s", "base_first_token_s")}
    summary["first_repeat"] = {k: rows[0][k] for k in ("load_s", "first_token_s")}
    summary["within_target"] = summary["first_token_s"]["max"] <= TARGETS["first_token_s"]
    return summary


def lora_load(report, size: dict, config: ModelConfig, params) -> None:
    from jaxserve.async_engine import AsyncEngine
    tokens = 1  # the figure is the first token, the prefill's: no decode shape to compile
    max_model_len = 64
    # One request at a time: the shapes it uses (a 16-token prefill and its sampler) compiled on
    # demand by an untimed base request, not the warm-up's every bucket.
    engine = Engine(config, params, None, EngineConfig(
        dtype="bfloat16", page_size=PAGE_SIZE, num_pages=max_model_len // PAGE_SIZE + 1, warmup=False,
        enable_lora=True, max_loras=MAX_LORAS, max_lora_rank=RANK, max_num_seqs=1, max_num_batched_tokens=16,
        max_num_prefill_seqs=1, max_model_len=max_model_len), model_name="llama-3-8b-shaped lora")
    setup = report.put("lora_load_setup", {"model": report["lora_model"], "rank": RANK, "max_loras": MAX_LORAS,
                                           "attention_backend": engine.runner.backend,
                                           "num_step_shapes": len(engine.runner.all_buckets()),
                                           "prompt_tokens": size["prompt_tokens"]})
    rng = np.random.default_rng(SEED)
    prompt = lambda: rng.integers(10, config.vocab_size, size["prompt_tokens"]).tolist()  # noqa: E731
    sampling = dict(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    produced, expected = 0, 0

    async def run(folder):
        nonlocal produced, expected
        client = AsyncEngine(engine)
        await client.start()
        try:
            setup["warm_request_s"], _ = await first_token(client, "warm", prompt(), SamplingParams(**sampling),
                                                           time.perf_counter())
            tensors = adapter_tensors(config, RANK, seed=0)
            for i in range(size["load_repeats"] + 1):
                path = os.path.join(folder, f"adapter{i}")
                setup["adapter_bytes"] = save_adapter(path, tensors, RANK)
                start = time.perf_counter()
                await client.load_lora_adapter(f"a{i}", path)
                loaded = time.perf_counter() - start
                first, count = await first_token(client, f"lora-{i}", prompt(),
                                                 SamplingParams(**sampling, lora_name=f"a{i}"), start)
                base_first, base_count = await first_token(client, f"base-{i}", prompt(), SamplingParams(**sampling),
                                                           time.perf_counter())
                produced, expected = produced + count + base_count, expected + 2 * tokens
                report.append("lora_load", {"repeat": i, "load_s": loaded, "first_token_s": first,
                                            "base_first_token_s": base_first})
                await client.unload_lora_adapter(f"a{i}")
                if i:
                    report.put("lora_load_summary", load_summary(report["lora_load"]))
        finally:
            await client.shutdown()

    with tempfile.TemporaryDirectory() as folder:
        asyncio.run(run(folder))
    report.check("lora_load", "ok" if produced == expected else "differ", tokens=produced, expected=expected)
    del engine
    gc.collect()


# ---- the figures, the table ---------------------------------------------------------------------------

def every_figure(report: dict, families) -> dict:
    """ok when every figure was measured and is positive and finite, else unknown naming the missing."""
    figures = {}
    rows = {r["family"]: r for r in report.get("lora_decode", [])}
    for family in families:
        for key in ("base_ms", "lora_ms", "lora_over_base", "lora_base_rows_over_base"):
            figures[f"lora_decode/{family}/{key}"] = rows.get(family, {}).get(key)
    embed = report.get("embeddings", {})
    for key in ("jaxserve_s", "tokens_per_s", "roofline_s", "fraction_of_roofline"):
        figures[f"embeddings/{key}"] = embed.get(key)
    if importlib.util.find_spec("torch") is not None:  # transformers' figures too where it can run
        for key in ("transformers_s", "over_transformers"):
            figures[f"embeddings/{key}"] = embed.get(key)
    load = report.get("lora_load_summary", {})
    for key in ("load_s", "first_token_s", "base_first_token_s"):
        figures[f"lora_load/{key}"] = load.get(key, {}).get("median")
    missing = [k for k, v in figures.items()
               if not (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0)]
    if missing:
        return {"status": "unknown", "reason": f"not measured: {', '.join(missing)}"}
    return {"status": "ok", "figures": len(figures)}


def print_table(report: dict) -> None:
    print(f"lora_pooling: {report['machine']}")
    for r in report.get("lora_decode", []):
        print(f"lora decode {r['family']:<7} base {r['base_ms']:.2f} ms, 4 adapters {r['lora_ms']:.2f} ms: "
              f"{r['lora_over_base']:.2f}x (slab, rows on slot 0: {r['lora_base_rows_over_base']:.2f}x; "
              f"target {TARGETS['lora_over_base']}x)")
    embed = report.get("embeddings", {})
    if "jaxserve_s" in embed:
        theirs = (f", transformers {embed['transformers_s']:.3f} s: {embed['over_transformers']:.2f}x "
                  f"(target {TARGETS['embeddings_over_transformers']}x)") if "transformers_s" in embed else ""
        print(f"embeddings {embed['inputs']} x {embed['input_tokens']}: jaxserve {embed['jaxserve_s']:.3f} s "
              f"({embed['tokens_per_s']:.0f} tok/s, {100 * (embed.get('fraction_of_roofline') or 0):.1f}% of "
              f"roofline){theirs}")
    load = report.get("lora_load_summary")
    if load:
        print(f"lora load: call {load['load_s']['median']:.3f} s, first token {load['first_token_s']['median']:.3f}"
              f" s (max {load['first_token_s']['max']:.3f}; target {TARGETS['first_token_s']} s), base first token "
              f"{load['base_first_token_s']['median']:.3f} s")
    for name, check in report["checks"].items():
        print(f"{name}: {check['status']} " + ", ".join(f"{k}={v}" for k, v in check.items() if k != "status"))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="the JSON report (written after every figure)")
    parser.add_argument("--small", action="store_true", help="tiny models and loads, the same code path (CPU dry run)")
    args = parser.parse_args(argv)
    require_gpu()
    size = SMALL if args.small else FULL
    on_gpu = jax.default_backend() == "gpu"
    families = kernel_families(on_gpu)
    device = jax.devices()[0]
    kind = getattr(device, "device_kind", str(device))
    report = StepReport(args.out, machine=f"{kind}, jax {jax.__version__} ({jax.default_backend()})", device=kind,
                        jax_version=jax.__version__, small=args.small, targets=TARGETS,
                        lora_model=f"{'tiny' if args.small else 'llama-3-8b-shaped'} random bf16",
                        embed_model=f"{'tiny' if args.small else 'smollm2-135m-shaped'} random bf16")
    config = size["lora_model"]
    with report.guard("lora_weights"), report.phase("lora_weights"):
        params = jax.block_until_ready(weights.random_params(config, dtype=DTYPE))
    if "lora_weights" not in report["checks"]:
        with report.guard("lora_decode"), report.phase("lora_decode"):
            lora_decode(report, size, config, params, families)
    with report.guard("embeddings"), report.phase("embeddings"):
        embeddings(report, size)
    if "lora_weights" not in report["checks"]:
        with report.guard("lora_load"), report.phase("lora_load"):
            lora_load(report, size, config, params)
    report.check("every_figure", **every_figure(report, families))
    print_table(report)
    return report.exit_status()


if __name__ == "__main__":
    sys.exit(main())
