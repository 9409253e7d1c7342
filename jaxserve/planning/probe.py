"""A few-second probe of this machine's ceilings for the latency predictor (jaxserve.planning.predict).

It measures, each as the fastest of a few repeats:
  * the copy bandwidth of a buffer larger than the caches (the device-wide bandwidth);
  * at each row count the predictor will price, the rates of the step's two kinds of work:
    - a [rows, hidden] x [hidden, intermediate] matmul (float32; a prompt chunk's in its compute dtype), over a stack of such weight matrices
      larger than the caches, one after the other as the engine's layer scan reads its weights:
      the bytes/s at which it reads them and the FLOP/s it reaches at that many rows;
    - the engine's CPU decode attention (pallas_kernels.dispatch, "xla": the C++ kernel where it
      is built) of that many rows over a float32 paged cache of the model's heads, at the context
      asked, over as many layers as fit in PROBE_CACHE_BYTES: the bytes/s at which it reads K/V;
  * the device-wide peak: the best matmul rate of those row counts and of a prefill chunk,
    prompt chunks in the dtype their matmuls multiply in (float32, bfloat16 or int8).

It times single operations of the model's shapes, never the step it predicts, so the roofline
stays a roofline: what a step's parts would take at the rates the machine reaches for them.
"""
from __future__ import annotations

import math
import time
from typing import Sequence

import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.planning.predict import OperatorCeilings

COPY_BYTES = 256 << 20  # far past any last-level cache
WEIGHT_STACK_BYTES = 256 << 20  # the matmul probe's weights: also past the caches
PROBE_CACHE_BYTES = 512 << 20  # the attention probe's K and V pages, at most
ATTENTION_PROBE_MAX_ROWS = 64  # more rows (a prefill chunk) take the rate of this many
PREFILL_PROBE_ROWS = 512  # the default prefill chunk: the matmul's best rate
BUDGET_S = 0.3  # seconds of repeats per measurement (at least 3 calls)


def _best_seconds(fn, budget_s: float = BUDGET_S) -> float:
    """The fastest of repeated calls of `fn` within about `budget_s` (at least 3)."""
    best, spent, calls = float("inf"), 0.0, 0
    while calls < 3 or spent < budget_s:
        start = time.perf_counter()
        fn()
        took = time.perf_counter() - start
        best, spent, calls = min(best, took), spent + took, calls + 1
    return best


def copy_bandwidth(budget_s: float = 1.0) -> float:
    """Bytes/s of a large numpy copy (read + write counted)."""
    src = np.ones(COPY_BYTES // 4, np.float32)  # [n]
    dst = np.empty_like(src)
    return 2 * src.nbytes / _best_seconds(lambda: np.copyto(dst, src), budget_s)


def matmul_rates(hidden: int, intermediate: int, rows: int, dtype: str = "float32") -> tuple[float, float]:
    """(weight bytes/s, FLOP/s) of [rows, hidden] x [hidden, intermediate] matmuls over a stack of
    weight matrices larger than the caches, run one after the other, both operands in `dtype`:
    float32, bfloat16 (summed in float32) or int8 (summed in int32; operations/s), the compute
    dtypes of a prompt's matmuls (jaxserve.models.prompt_matmul). float32 runs in the C++ kernel
    (cpu_kernels.f32_matmul on the strips, at the layer index) where it is built, as the engine's
    float32 step does (jaxserve.models.cpu_layout.float32_views); int8 in the VNNI kernel there
    (cpu_kernels.quantized_matmul on per-channel int8 codes, float32 rows it quantizes per 32
    inputs), as the engine's int8 prompt chunks.

    Up to cpu_kernels.MAX_ROWS rows (a decode step's: reading the weights bounds it) the products
    are summed under one scan, so no call's dispatch is timed. A prompt chunk's rows are each
    product alone, one call per matrix: summing [rows, intermediate] outputs costs a bfloat16 or
    int8 product's own time again (SmolLM2's at 500 rows: 580 GFLOP/s summed under a scan, about
    1650 one by one, bfloat16 on the development CPU's AMX), which is not the matmul's peak."""
    import jax  # the probe alone needs jax: the predictor's arithmetic stays without it
    import jax.numpy as jnp
    element = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "int8": jnp.int8}[dtype]
    total_dtype = jnp.int32 if dtype == "int8" else jnp.float32
    matrix_bytes = hidden * intermediate * jnp.dtype(element).itemsize
    count = max(1, math.ceil(WEIGHT_STACK_BYTES / matrix_bytes))
    rng = np.random.default_rng(0)
    if dtype == "int8":
        x = jnp.asarray(rng.integers(-127, 128, (rows, hidden)), jnp.int8)  # [rows, hidden]
        stack = jnp.asarray(rng.integers(-127, 128, (count, hidden, intermediate)), jnp.int8)  # [n, hidden, inter]
    else:
        x = jnp.asarray(rng.standard_normal((rows, hidden), np.float32), element)
        stack = jnp.asarray(rng.standard_normal((count, hidden, intermediate), np.float32) * 0.01, element)

    import cpu_kernels  # as jax: only the probe needs the kernels
    if dtype == "float32" and cpu_kernels.available():  # as the engine's float32 step: the C++ kernel's strips
        stack = jax.jit(cpu_kernels.pack_f32)(stack)  # [n, strips, hidden, STRIP]
        product = lambda x, stack, i: cpu_kernels.f32_matmul(x, stack, intermediate, layer=i)  # noqa: E731
        apart = lambda: [(stack, jnp.int32(i)) for i in range(count)]  # noqa: E731 (matrix i read in place)
    elif dtype == "int8" and cpu_kernels.available():  # as the engine's int8 steps and prompts: the VNNI kernel
        x = jnp.asarray(rng.standard_normal((rows, hidden), np.float32))  # quantized per block by the kernel
        packed = jax.jit(lambda q: cpu_kernels.pack((q.astype(jnp.int32) + 128).astype(jnp.uint8), 8))(stack)
        strips = -(-intermediate // cpu_kernels.STRIP)
        scales = jnp.full((count, strips, 1, cpu_kernels.STRIP), 0.01, cpu_kernels.SCALE_DTYPE)  # one group
        stack, total_dtype = (packed, scales), jnp.float32  # the kernel's products are float32
        product = lambda x, stack, i: cpu_kernels.quantized_matmul(  # noqa: E731
            x, *stack, None, -128.0, intermediate, layer=i)
        apart = lambda: [(stack, jnp.int32(i)) for i in range(count)]  # noqa: E731 (matrix i read in place)
    else:
        product = lambda x, stack, i: jnp.matmul(x, stack[i], preferred_element_type=total_dtype)  # noqa: E731
        apart = lambda: [(w[None], jnp.int32(0)) for w in stack]  # noqa: E731 ([1, hidden, inter] each: no slice)

    if rows > cpu_kernels.MAX_ROWS:  # each product alone
        one, matrices = jax.jit(product), apart()

        def run():
            for matrix in matrices:
                out = one(x, *matrix)
            out.block_until_ready()
    else:  # summed under one scan
        @jax.jit
        def summed(x, stack):
            def step(total, i):  # total [rows, intermediate]
                return total + product(x, stack, i), None
            return jax.lax.scan(step, jnp.zeros((rows, intermediate), total_dtype), jnp.arange(count))[0]

        def run():
            summed(x, stack).block_until_ready()

    run()  # compile
    seconds = _best_seconds(run)
    return count * matrix_bytes / seconds, count * 2 * rows * hidden * intermediate / seconds


def attention_bandwidth(model: ModelConfig, rows: int, context_len: int, page_size: int) -> float:
    """Bytes/s at which the engine's CPU decode attention reads a float32 paged cache: `rows`
    sequences of `context_len` tokens, over as many of the model's layers as PROBE_CACHE_BYTES holds
    (each layer its own pages, as in the engine's cache)."""
    import jax  # as in matmul_rates: only the probe needs jax and the kernels
    import jax.numpy as jnp
    from pallas_kernels import dispatch
    heads, kv_heads, head_dim = model.num_q_heads, model.num_kv_heads, model.head_dim
    token_bytes = 2 * kv_heads * head_dim * 4  # K and V of one token of one layer
    context_len = max(1, min(context_len, PROBE_CACHE_BYTES // (rows * token_bytes)))
    pages_per_seq = math.ceil(context_len / page_size)
    layers = max(1, min(model.num_layers, PROBE_CACHE_BYTES // (rows * pages_per_seq * page_size * token_bytes)))
    pages_per_layer = rows * pages_per_seq
    rng = np.random.default_rng(0)
    shape = (1 + layers * pages_per_layer, page_size, kv_heads, head_dim)  # page 0: the null page
    k_pages = jnp.asarray(rng.standard_normal(shape, np.float32))
    v_pages = jnp.asarray(rng.standard_normal(shape, np.float32))
    q = jnp.asarray(rng.standard_normal((rows, heads, head_dim), np.float32))  # [rows, Hq, hd]
    table = jnp.asarray(1 + np.arange(pages_per_layer, dtype=np.int32).reshape(rows, pages_per_seq))  # [rows, pages]
    seq_lens = jnp.full((rows,), context_len, jnp.int32)  # [rows]

    @jax.jit
    def run(q, k_pages, v_pages):
        def layer(i, total):  # total [rows, Hq, hd]
            return total + dispatch.decode_attention("xla", q, k_pages, v_pages, table + i * pages_per_layer, seq_lens)
        return jax.lax.fori_loop(0, layers, layer, jnp.zeros_like(q))

    run(q, k_pages, v_pages).block_until_ready()  # compile
    seconds = _best_seconds(lambda: run(q, k_pages, v_pages).block_until_ready())
    return layers * rows * context_len * token_bytes / seconds


def probe(model: ModelConfig, rows: Sequence[int], context_len: int, page_size: int,
          prompt_dtype: str = "float32") -> tuple[float, float, list[OperatorCeilings]]:
    """(copy bytes/s, peak FLOP/s, the operators' ceilings at each of `rows`) of this machine, in
    a few seconds (about 2 x BUDGET_S and two compiles per row count, and a prefill chunk's matmul).
    Row counts past the decode kernel's (prompt chunks) are probed in `prompt_dtype`, what their
    matmuls multiply in (jaxserve.models.cpu_layout.prompt_compute_dtype), and so is the peak."""
    import cpu_kernels  # as in matmul_rates: only the probe needs jax and the kernels
    dtype_at = lambda count: prompt_dtype if count > cpu_kernels.MAX_ROWS else "float32"  # noqa: E731
    operators = []
    for count in sorted(set(rows)):
        bandwidth, flops = matmul_rates(model.hidden_size, model.intermediate_size, count, dtype_at(count))
        attention = attention_bandwidth(model, min(count, ATTENTION_PROBE_MAX_ROWS), context_len, page_size)
        operators.append(OperatorCeilings(count, bandwidth, flops, attention, dtype_at(count)))
    best_flops = max(o.matmul_flops for o in operators) if operators else 0.0
    if PREFILL_PROBE_ROWS not in rows:
        best_flops = max(best_flops, matmul_rates(model.hidden_size, model.intermediate_size, PREFILL_PROBE_ROWS,
                                                  prompt_dtype)[1])
    return copy_bandwidth(), best_flops, operators
