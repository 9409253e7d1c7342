"""The Mosaic GPU attention kernels (pallas_kernels.mosaic_decode, mosaic_ragged) in Mosaic GPU's
interpreter, against the float64 oracle of tests/test_kernels.py on the same random problems
(permuted block tables, lengths around page boundaries, NaN in every slot no sequence owns and
before each window, padding rows) over 16-bit, int8 and fp8 pages, with the interpreter's race
detector on; whole tiny models' greedy tokens through the engine; and the kernels compiled for sm_90a without a GPU (ptxas's
registers and spills).

The interpreter is in jax >= 0.11: this file runs in the environment shaped like the lent GPU
machine (.venv-gpu-rehearsal, Python 3.12, jax 0.11.2: `make test-gpu-rehearsal`) and skips on
the older jax of the main test environment.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import compat

if not compat.has_mosaic_gpu():
    pytest.skip(f"Mosaic GPU's interpreter needs jax >= 0.11 (this is {jax.__version__}); these tests run in "
                ".venv-gpu-rehearsal (make test-gpu-rehearsal)", allow_module_level=True)

from pallas_kernels import dispatch, kv_quant, mosaic_decode, mosaic_lora, mosaic_ragged  # noqa: E402
from tests.test_kernels import (  # noqa: E402
    CASES, SEED, SOFT_CAP_OPTIONS, WINDOWS, Case, Options, case_id, context_lengths, decode_problem,
    jitted, oracle, ragged_problem,
)
from tests.test_bidirectional_spans import SpanCase, span_problem  # noqa: E402
from tests.test_bidirectional_spans import case_id as span_case_id  # noqa: E402
from tests.test_bidirectional_spans import options_of as span_options  # noqa: E402
from tests.test_bidirectional_spans import dense_oracle as span_oracle  # noqa: E402

pytestmark = pytest.mark.slow  # the Mosaic GPU kernels in their interpreter: out of `make test-quick`

TOLERANCE = {jnp.bfloat16: 2e-2, jnp.float16: 1e-2}
# The interpreter on the CPU; on a GPU (bench/gpu_check.sh) the kernels run compiled.
INTERPRET = jax.default_backend() != "gpu"
MOSAIC_BACKEND = "mosaic_interpret" if INTERPRET else "mosaic"
# The Triton kernels' cases in 16-bit (the Mosaic kernels take bfloat16 and float16 queries; their
# quantized pages are tested below), then the head layouts of the models jaxserve serves: SmolLM2
# (9 query heads over 3 KV heads, head_dim 64), Llama-3 / Mistral (group 4, 128), Qwen2.5-7B
# (group 7, 128), Gemma-2 (group 2, head_dim 256), in float16 a group of 8.
MOSAIC_CASES = [dataclasses.replace(case, dtype=jnp.bfloat16, tiles={}) for case in CASES] + [
    Case(16, 64, 3, 3, jnp.bfloat16, {}),
    Case(16, 128, 4, 2, jnp.bfloat16, {}),
    Case(16, 128, 7, 1, jnp.bfloat16, {}),
    Case(16, 256, 2, 1, jnp.bfloat16, {}),
    Case(8, 64, 8, 1, jnp.float16, {}),
]


@pytest.fixture(autouse=True)
def no_races():
    """Every test here ends with the interpreter's race detector silent."""
    yield
    assert not compat.mosaic_races_found(), "Mosaic GPU's interpreter reported a data race (see RACE DETECTED above)"


def close(out, expected, case, label):
    """Finite, and within the 16-bit tolerance of the oracle relative to its largest value."""
    actual = np.asarray(out, np.float64)
    assert np.isfinite(actual).all(), f"{label}: non-finite output (seed {SEED})"
    error = np.abs(actual - expected).max() / np.abs(expected).max()
    assert error < TOLERANCE[case.dtype], f"{label}: relative error {error:.2e} (seed {SEED})"


def check_decode(case, rng, options=Options(), num_splits=None, kv_dtype=None, label="mosaic decode"):
    args, (k_pages, v_pages, block_table), seq_lens = decode_problem(case, rng, options.window, kv_dtype)
    q = np.asarray(args[0])
    expected = oracle(q[:, None], k_pages, v_pages, block_table, seq_lens, (seq_lens > 0).astype(int),
                      **options.oracle())[:, 0]
    function = jitted(mosaic_decode.paged_decode_attention, options, interpret=INTERPRET, num_splits=num_splits)
    out = function(*args, window=options.operand())
    assert out.shape == q.shape and out.dtype == q.dtype
    close(out, expected, case, f"{label} {case_id(case)} {options} splits={num_splits} kv={kv_dtype}")
    assert np.all(np.asarray(out, np.float32)[seq_lens == 0] == 0), f"padding row not zero (seed {SEED})"


def check_ragged(case, rng, options=Options(), kv_dtype=None, label="mosaic ragged"):
    args, expected_of = ragged_problem(case, rng, options.window, kv_dtype)
    q, query_start_loc = np.asarray(args[0]), np.asarray(args[5])
    out = jitted(mosaic_ragged.ragged_paged_attention, options, interpret=INTERPRET)(*args, window=options.operand())
    assert out.shape == q.shape and out.dtype == q.dtype
    close(out, expected_of(options), case, f"{label} {case_id(case)} {options} kv={kv_dtype}")
    assert np.all(np.asarray(out, np.float32)[query_start_loc[-1]:] == 0), f"padding tokens not zero (seed {SEED})"


@pytest.mark.parametrize("case", MOSAIC_CASES, ids=case_id)
def test_mosaic_decode_matches_oracle(case):
    """Default splits, then 3 splits (several programs per sequence, their partials merged)."""
    rng = np.random.default_rng([SEED, MOSAIC_CASES.index(case), 10])
    check_decode(case, rng)
    check_decode(case, rng, num_splits=3)


@pytest.mark.parametrize("window", [None, 35])
def test_mosaic_decode_over_a_table_far_wider_than_the_contexts(window):
    """As the Triton kernel's test: the engine's one table width (the longest context's) is 8x
    what this batch needs, the extra entries the NaN null page; every split count gives the oracle's result."""
    case = MOSAIC_CASES[1]
    args, (k_pages, v_pages, block_table), seq_lens = decode_problem(case, np.random.default_rng([SEED, 13]), window)
    wide = jnp.pad(args[3], ((0, 0), (0, 7 * args[3].shape[1])))
    q, options = np.asarray(args[0]), Options(window=window)
    expected = oracle(q[:, None], k_pages, v_pages, block_table, seq_lens, (seq_lens > 0).astype(int),
                      **options.oracle())[:, 0]
    for num_splits in (1, 3):
        function = jitted(mosaic_decode.paged_decode_attention, options, interpret=INTERPRET, num_splits=num_splits)
        out = function(args[0], args[1], args[2], wide, args[4], window=options.operand())
        close(out, expected, case, f"wide table, {num_splits} splits, window {window}")


@pytest.mark.parametrize("case", MOSAIC_CASES, ids=case_id)
def test_mosaic_ragged_matches_oracle(case):
    check_ragged(case, np.random.default_rng([SEED, MOSAIC_CASES.index(case), 11]))


@pytest.mark.parametrize("kind", WINDOWS)
def test_mosaic_sliding_window_matches_oracle(kind):
    """The Triton kernels' window kinds (one key, a few pages, exactly the longest sequence, longer
    than every sequence, the no-window sentinel) on their cases in bfloat16."""
    case, window_of = WINDOWS[kind]
    case = dataclasses.replace(case, dtype=jnp.bfloat16, tiles={})
    numbers = [SEED, 12, list(WINDOWS).index(kind)]
    window = window_of(case.page_size, int(context_lengths(case.page_size, np.random.default_rng(numbers)).max()))
    check_decode(case, np.random.default_rng(numbers), Options(window=window), num_splits=2)
    check_ragged(case, np.random.default_rng(numbers), Options(window=window))


@pytest.mark.parametrize("options", SOFT_CAP_OPTIONS, ids=str)
def test_mosaic_soft_cap_and_scale_match_oracle(options):
    case = Case(8, 128, 4, 2, jnp.bfloat16, {})
    numbers = [SEED, 13, SOFT_CAP_OPTIONS.index(options)]
    check_decode(case, np.random.default_rng(numbers), options)
    check_ragged(case, np.random.default_rng(numbers), options)


def test_mosaic_results_do_not_depend_on_the_block_table_order():
    """The same contexts through two different permutations of the free pages give the same output
    bit for bit: the kernel reads pages only through the table."""
    case = Case(16, 64, 4, 2, jnp.bfloat16, {})
    outputs = []
    for salt in (0, 1):
        rng = np.random.default_rng([SEED, 14])
        seq_lens = context_lengths(case.page_size, rng)
        contexts = rng.standard_normal((2, len(seq_lens), int(seq_lens.max()), case.num_kv_heads, case.head_dim))
        q = jnp.asarray(rng.standard_normal((len(seq_lens), case.group * case.num_kv_heads, case.head_dim)),
                        jnp.bfloat16)
        pages_needed = [-(-int(n) // case.page_size) for n in seq_lens]
        num_pages = sum(pages_needed) + 2
        order = 1 + np.random.default_rng([SEED, 15, salt]).permutation(num_pages - 1)
        k_pages = np.zeros((num_pages, case.page_size, case.num_kv_heads, case.head_dim))
        v_pages = np.zeros_like(k_pages)
        block_table = np.zeros((len(seq_lens), max(pages_needed) + 1), np.int32)
        for row, (length, count) in enumerate(zip(seq_lens, pages_needed)):
            block_table[row, :count], order = order[:count], order[count:]
            for position in range(int(length)):
                page, offset = block_table[row, position // case.page_size], position % case.page_size
                k_pages[page, offset], v_pages[page, offset] = contexts[0, row, position], contexts[1, row, position]
        outputs.append(np.asarray(mosaic_decode.paged_decode_attention(
            q, jnp.asarray(k_pages, jnp.bfloat16), jnp.asarray(v_pages, jnp.bfloat16), jnp.asarray(block_table),
            jnp.asarray(seq_lens), interpret=INTERPRET), np.float32))
    np.testing.assert_array_equal(outputs[0], outputs[1])


@pytest.mark.parametrize("pages, dtype, head_dim, page_size, reason", [
    ("float", jnp.float32, 64, 16, "float16 or bfloat16"),
    ("int8", jnp.float32, 64, 16, "float16 or bfloat16"),
    ("fp8", jnp.bfloat16, 96, 16, "head_dim 96"),
    ("float", jnp.bfloat16, 96, 16, "head_dim 96"),
    ("int8", jnp.bfloat16, 64, 128, "page_size 128"),
])
def test_mosaic_kernels_refuse_what_they_do_not_take(pages, dtype, head_dim, page_size, reason):
    """A clear ValueError (and the same reason from dispatch.unsupported_operands, which the
    engine asks before it builds a step), never a wrong answer or a lowering crash."""
    q = jnp.zeros((2, 4, head_dim), dtype)
    shape = (4, page_size, 2, head_dim)
    cache = {"float": lambda: jnp.zeros(shape, dtype), "int8": lambda: kv_quant.zeros(shape, jnp.int8),
             "fp8": lambda: kv_quant.zeros(shape, kv_quant.FP8)}[pages]()
    assert reason in dispatch.unsupported_operands("mosaic", q, cache)
    assert dispatch.unsupported_operands("pallas", q, cache) is None
    table, lens = jnp.ones((2, 2), jnp.int32), jnp.array([3, 1], jnp.int32)
    with pytest.raises(ValueError, match=reason):
        mosaic_decode.paged_decode_attention(q, cache, cache, table, lens, interpret=INTERPRET)
    with pytest.raises(ValueError, match=reason):
        mosaic_ragged.ragged_paged_attention(q, cache, cache, table, lens, jnp.array([0, 1, 2], jnp.int32),
                                             interpret=INTERPRET)


def test_dispatch_names_both_kernel_families():
    """"triton" is the Pallas Triton backend by its other name; "mosaic" and "mosaic_interpret"
    route decode and ragged attention to the Mosaic kernels (same answers as the oracle above)."""
    assert dispatch.attention_backend("Triton") == "pallas"
    assert dispatch.attention_backend("mosaic") == "mosaic"
    case = Case(16, 64, 2, 2, jnp.bfloat16, {})
    args, (k_pages, v_pages, block_table), seq_lens = decode_problem(case, np.random.default_rng([SEED, 16]))
    direct = mosaic_decode.paged_decode_attention(*args, interpret=INTERPRET)
    np.testing.assert_array_equal(np.asarray(dispatch.decode_attention(MOSAIC_BACKEND, *args), np.float32),
                                  np.asarray(direct, np.float32))


# Whole tiny models (random bfloat16 weights, head_dim 64): Llama-style GQA, and Gemma-2-style
# attention (alternating sliding-window and global layers, soft-capped scores, its own scale).
ENGINE_MODELS = {
    "llama": dict(num_q_heads=4, num_kv_heads=2),
    "gemma2-attention": dict(num_q_heads=4, num_kv_heads=1, sliding_window=12,
                             layer_types=("sliding_attention", "full_attention"), attn_logit_softcap=20.0,
                             query_pre_attn_scalar=48.0),
}


@pytest.mark.parametrize("model, kv_cache_dtype", [("llama", "auto"), ("gemma2-attention", "auto"), ("llama", "int8"),
                                                   ("gemma2-attention", "fp8")])
def test_engine_greedy_tokens_with_the_interpreted_mosaic_kernels(model, kv_cache_dtype, monkeypatch):
    """The engine's greedy tokens with --attention_backend=mosaic_interpret equal the XLA path's
    on the same weights and KV cache dtype: prompts of several pages prefilled in chunks next to
    decode rows, with prefix caching on, so both kernels run in one step. A random tiny model has
    near-ties (the int8 llama here: its top two tokens 0.006 nats apart at one step, where the
    Triton kernels, Mosaic's and XLA's each round differently): there a sequence may take the
    runner-up, and the rest of it is not compared."""
    traced = []  # the Mosaic kernels the engine's steps were traced with
    for module, name in ((mosaic_decode, "paged_decode_attention"), (mosaic_ragged, "ragged_paged_attention")):
        original = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _f=original, _n=name, **k: traced.append(_n) or _f(*a, **k))
    from jaxserve.config import ModelConfig
    from jaxserve.core.request import SamplingParams
    from jaxserve.engine import Engine, EngineConfig
    from jaxserve.models import weights

    config = ModelConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_layers=2, head_dim=64,
                         max_position_embeddings=256, **ENGINE_MODELS[model])
    params = weights.random_params(config, dtype=jnp.bfloat16, seed=SEED % 1000)
    rng = np.random.default_rng([SEED, 17])
    prompts = [rng.integers(0, 256, n).tolist() for n in (5, 37, 70)]
    prompts.append(prompts[1][:20] + [7, 8])  # shares a cached prefix with the second prompt
    tokens, logprobs = {}, {}
    for backend in (MOSAIC_BACKEND, "xla"):
        engine = Engine(config, params, None, EngineConfig(
            attention_backend=backend, dtype="bfloat16", kv_cache_dtype=kv_cache_dtype, page_size=16, max_num_seqs=4,
            num_pages=64, max_num_batched_tokens=32, max_model_len=128, warmup=False), model_name=f"tiny {model}")
        results = engine.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True,
                                                          logprobs=2))
        tokens[backend] = [r.token_ids for r in results]
        logprobs[backend] = [r.logprobs for r in results]
        if backend == MOSAIC_BACKEND:
            assert engine.runner.backend == backend and set(traced) == {"paged_decode_attention",
                                                                         "ragged_paged_attention"}
    for prompt, (mosaic, xla) in enumerate(zip(tokens[MOSAIC_BACKEND], tokens["xla"])):
        label = f"prompt {prompt}: {mosaic} vs {xla} (seed {SEED})"
        first, reference = logprobs[MOSAIC_BACKEND][prompt][0], logprobs["xla"][prompt][0]
        assert first.token_id == reference.token_id and abs(first.logprob - reference.logprob) < 0.05, label
        differ = [i for i, (a, b) in enumerate(zip(mosaic, xla)) if a != b]
        if differ:  # a near-tie: Mosaic took XLA's runner-up, within 0.05 nats of its choice
            top = dict(logprobs["xla"][prompt][differ[0]].top)
            assert mosaic[differ[0]] in top and top[xla[differ[0]]] - top[mosaic[differ[0]]] < 0.05, label


# Quantized pages under a 16-bit query (after the engine test: a GPU check cut short loses these
# first): SmolLM2's heads, Llama's, float16 with a group of 8, Gemma-2's head_dim 256; each with
# and without a window, soft-cap and scale.
QUANTIZED_CASES = [Case(16, 64, 3, 3, jnp.bfloat16, {}), Case(16, 128, 4, 2, jnp.bfloat16, {}),
                   Case(8, 64, 8, 1, jnp.float16, {}), Case(16, 256, 2, 1, jnp.bfloat16, {})]


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
@pytest.mark.parametrize("case", QUANTIZED_CASES, ids=case_id)
def test_mosaic_kernels_on_quantized_pages_match_oracle(case, kv_dtype):
    """int8 pages (per-token scales, kv_quant) and fp8 pages, widened in the kernel, against the
    oracle on the values the pages hold (NaN in every slot no sequence owns, permuted tables)."""
    numbers = [SEED, 18, QUANTIZED_CASES.index(case), ["int8", "fp8"].index(kv_dtype)]
    window = Options(window=case.page_size + 5, scale=0.3, cap=5.0)
    for options in (Options(), window):
        check_decode(case, np.random.default_rng(numbers), options, num_splits=2, kv_dtype=kv_dtype)
        check_ragged(case, np.random.default_rng(numbers), options, kv_dtype=kv_dtype)


# Bidirectional attention among an image's tokens (key_limit, tests/test_bidirectional_spans.py's
# problems: image spans at a chunk's start, middle and end, across page boundaries, GQA) against the
# dense-mask oracle, with and without a window; key_limit at the positions is the causal result bit for bit.
SPAN_CASES = [SpanCase(16, 64, 3, 2, jnp.bfloat16), SpanCase(8, 128, 4, 1, jnp.float16),
              SpanCase(32, 64, 8, 1, jnp.bfloat16)]


@pytest.mark.parametrize("window", [None, 5, 37], ids=lambda w: f"window{w}")
@pytest.mark.parametrize("case", SPAN_CASES, ids=span_case_id)
def test_mosaic_image_spans_match_the_oracle(case, window):
    rng = np.random.default_rng([SEED, 19, SPAN_CASES.index(case), window or 0])
    args, key_limit, positions, details = span_problem(case, rng, window)
    options = span_options(window)
    want = span_oracle(args, details["spans"], window)
    function = jax.jit(lambda *a, key_limit: mosaic_ragged.ragged_paged_attention(
        *a, key_limit=key_limit, interpret=INTERPRET, **options))
    out = function(*args, key_limit=key_limit)
    assert out.shape == args[0].shape and out.dtype == args[0].dtype
    close(out, want, case, f"mosaic image spans {span_case_id(case)} window {window}")
    assert np.all(np.asarray(out, np.float32)[int(details["query_start_loc"][-1]):] == 0), f"padding (seed {SEED})"
    if window is None:
        causal = jax.jit(lambda *a: mosaic_ragged.ragged_paged_attention(*a, interpret=INTERPRET))(*args)
        at_positions = function(*args, key_limit=positions)
        assert np.array_equal(np.asarray(causal, np.float32), np.asarray(at_positions, np.float32)), SEED
        through_dispatch = jax.jit(lambda *a, key_limit: dispatch.ragged_attention(
            MOSAIC_BACKEND, *a, key_limit=key_limit))(*args, key_limit=key_limit)
        np.testing.assert_array_equal(np.asarray(through_dispatch, np.float32), np.asarray(out, np.float32))


def test_mosaic_without_key_limit_the_program_is_the_causal_one():
    case = SPAN_CASES[0]
    args, key_limit, _, _ = span_problem(case, np.random.default_rng([SEED, 20]))
    plain = jax.jit(lambda *a: dispatch.ragged_attention(MOSAIC_BACKEND, *a)).lower(*args).as_text()
    with_none = jax.jit(lambda *a: dispatch.ragged_attention(MOSAIC_BACKEND, *a, key_limit=None)).lower(*args).as_text()
    limited = jax.jit(lambda *a, key_limit: dispatch.ragged_attention(MOSAIC_BACKEND, *a, key_limit=key_limit)).lower(
        *args, key_limit=key_limit).as_text()
    assert plain == with_none and plain != limited


# ---- compiled for Hopper without a GPU (deviceless XLA, down to ptxas) ----------------------------
# Per device: Llama-3-8B (32 query heads over 8 KV heads, head_dim 128), Llama-3-70B at TP 8 (8 over
# 1), Gemma-2-2B (8 over 4, head_dim 256, a window and soft-capping), SmolLM2 (9 over 3, 64).
COMPILE_SHAPES = {"llama-3-8b": (32, 8, 128, {}), "llama-3-70b-tp8": (8, 1, 128, {}),
                  "gemma-2-2b": (8, 4, 256, dict(scale=256**-0.5, logit_soft_cap=50.0)), "smollm2": (9, 3, 64, {})}
H100_SHARED_MEMORY = 232448  # bytes a block may use on sm_90


def _gpu_compile():
    from jaxserve.planning import gpu_compile
    if not INTERPRET:
        pytest.skip("on a GPU the kernels run compiled above; the deviceless compile is checked on the CPU")
    if not gpu_compile.is_available():
        pytest.skip(f"no CUDA plugin / ptxas here ({gpu_compile.INSTALL_HINT})")
    return gpu_compile


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "int8", "fp8"])
@pytest.mark.parametrize("shape", COMPILE_SHAPES)
def test_mosaic_kernels_compile_for_sm90a_without_spills(shape, kv_dtype):
    """Both kernels at a served model's head shapes (bfloat16 queries over bfloat16, int8 or fp8
    pages: 4096 pages of 16, 256 decode rows of 512 pages, a 2048-token ragged batch), with a window
    operand where the model has one: ptxas reports at most 255 registers and, up to head_dim 128
    (Llama, Mistral, Qwen, SmolLM2), no spills, and the shared memory fits a Hopper block. At
    head_dim 256 one warpgroup's float32 accumulator alone is 128 registers a thread: the kernels
    spill a few hundred bytes there (measured 164-388), bounded here so that a regression shows."""
    gpu_compile = _gpu_compile()
    heads, kv_heads, head_dim, options = COMPILE_SHAPES[shape]
    mesh = gpu_compile.gpu_mesh("h100", 1)
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

    def spec(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=replicated)

    page_shape = (4096, 16, kv_heads, head_dim)
    pages = {"bfloat16": lambda: spec(page_shape, jnp.bfloat16), "fp8": lambda: spec(page_shape, kv_quant.FP8_BITS),
             "int8": lambda: {"pages": spec(page_shape, jnp.int8),
                              "scales": spec(page_shape[:-1] + (1,), jnp.float32)}}[kv_dtype]()
    decode = [spec((256, heads, head_dim), jnp.bfloat16), pages, pages, spec((256, 512), jnp.int32),
              spec((256,), jnp.int32), spec((), jnp.int32)]
    ragged = [spec((2048, heads, head_dim), jnp.bfloat16), pages, pages, spec((4, 512), jnp.int32),
              spec((4,), jnp.int32), spec((5,), jnp.int32), spec((), jnp.int32)]
    window = bool(options)

    def jitted_kernel(function):
        return jax.jit(lambda *args: function(*args[:-1], sliding_window=args[-1] if window else None, **options))

    reports = (gpu_compile.kernel_reports(jitted_kernel(mosaic_decode.paged_decode_attention), decode, mesh, "h100")
               + gpu_compile.kernel_reports(jitted_kernel(mosaic_ragged.ragged_paged_attention), ragged, mesh, "h100"))
    assert sorted(r.name for r in reports) == ["paged_decode_attention_mosaic", "ragged_paged_attention_mosaic"]
    for r in reports:
        assert r.gpu == "sm_90a" and r.threads == 128, r
        assert 0 < r.registers <= 255, r
        if head_dim <= 128:
            assert r.spill_store_bytes == r.spill_load_bytes == 0, r
        else:
            assert r.spill_store_bytes <= 512 and r.spill_load_bytes <= 512, r
        print(f"{shape} {kv_dtype} {r.name}: {r.registers} registers, spills {r.spill_store_bytes} B stored "
              f"{r.spill_load_bytes} B loaded, {r.shared_memory_bytes} B shared memory")
        assert 0 < r.shared_memory_bytes <= H100_SHARED_MEMORY, r


@pytest.mark.parametrize("shape", ["smollm2", "llama-3-8b", "gemma-2-2b"])
def test_mosaic_ragged_kernel_with_key_limits_compiles_for_sm90a(shape):
    """The ragged kernel with image spans' key limits (and the window where the model has one), at a
    served model's heads over bfloat16 pages: the same register and shared-memory bounds as above."""
    gpu_compile = _gpu_compile()
    heads, kv_heads, head_dim, options = COMPILE_SHAPES[shape]
    mesh = gpu_compile.gpu_mesh("h100", 1)
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

    def spec(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=replicated)

    pages = spec((4096, 16, kv_heads, head_dim), jnp.bfloat16)
    ragged = [spec((2048, heads, head_dim), jnp.bfloat16), pages, pages, spec((4, 512), jnp.int32),
              spec((4,), jnp.int32), spec((5,), jnp.int32), spec((2048,), jnp.int32), spec((), jnp.int32)]
    window = bool(options)
    function = jax.jit(lambda *a: mosaic_ragged.ragged_paged_attention(
        *a[:6], key_limit=a[6], sliding_window=a[7] if window else None, **options))
    (r,) = gpu_compile.kernel_reports(function, ragged, mesh, "h100")
    assert r.name == "ragged_paged_attention_mosaic" and r.gpu == "sm_90a" and r.threads == 128, r
    assert 0 < r.registers <= 255, r
    if head_dim <= 128:
        assert r.spill_store_bytes == r.spill_load_bytes == 0, r
    else:
        assert r.spill_store_bytes <= 512 and r.spill_load_bytes <= 512, r
    assert 0 < r.shared_memory_bytes <= H100_SHARED_MEMORY, r
    print(f"{shape} key limits {r.name}: {r.registers} registers, spills {r.spill_store_bytes} B stored "
          f"{r.spill_load_bytes} B loaded, {r.shared_memory_bytes} B shared memory")


# The multi-LoRA kernel (tests/test_mosaic_lora.py) on a stacked [L, S, ...] bfloat16 slab at a layer
# index, as the model calls it: (rows, K, rank, N, slots) of a decode and a prefill projection.
MOSAIC_LORA_SHAPES = {"smollm2-decode-kv": (32, 576, 16, 192, 5), "llama-3-8b-prefill-gate": (512, 4096, 64, 14336, 9),
                      "rank-128-decode": (64, 4096, 128, 4096, 5)}


@pytest.mark.parametrize("shape", MOSAIC_LORA_SHAPES)
def test_mosaic_lora_kernel_compiles_for_sm90a_without_spills(shape):
    gpu_compile = _gpu_compile()
    assert "lora_bgmv_mosaic" in gpu_compile.KERNEL_NAMES  # the kernels kernel_reports reads
    rows, k, rank, n, slots = MOSAIC_LORA_SHAPES[shape]
    mesh = gpu_compile.gpu_mesh("h100", 1)
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    args = [jax.ShapeDtypeStruct(s, d, sharding=replicated) for s, d in (
        ((rows, k), jnp.bfloat16), ((2, slots, k, rank), jnp.bfloat16), ((2, slots, rank, n), jnp.bfloat16),
        ((rows,), jnp.int32), ((), jnp.int32))]
    (r,) = gpu_compile.kernel_reports(jax.jit(mosaic_lora.lora_update), args, mesh, "h100")
    assert r.name == "lora_bgmv_mosaic" and r.gpu == "sm_90a" and r.threads == 128, r
    assert 0 < r.registers <= 255 and r.spill_store_bytes == r.spill_load_bytes == 0, r
    assert 0 < r.shared_memory_bytes <= H100_SHARED_MEMORY, r
    print(f"{shape} {r.name}: {r.registers} registers, {r.shared_memory_bytes} B shared memory")


def test_engine_step_compiles_for_h100_with_the_mosaic_kernels():
    """`plan --target=h100 --compile --attention_backend=mosaic` on SmolLM2's shapes: every corner
    step bucket compiles with Mosaic kernel calls in it (a silent fallback to XLA attention shows
    as 0), and a model the kernels cannot take is refused before anything compiles."""
    gpu_compile = _gpu_compile()
    from jaxserve.config import EngineConfig, ModelConfig

    smollm2 = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_q_heads=9,
                          num_kv_heads=3, head_dim=64, max_position_embeddings=2048, tie_word_embeddings=True)
    engine_config = EngineConfig(attention_backend="mosaic", max_model_len=2048, max_num_seqs=64,
                                 max_num_batched_tokens=512)
    report = gpu_compile.compile_for_gpu(smollm2, engine_config, target="h100", which_buckets="ends")["compile"]
    assert report["buckets"] and all(b["ok"] for b in report["buckets"]), report["buckets"]
    assert all(b["pallas_kernels"] >= 1 for b in report["buckets"])
    assert all(s["ok"] for s in report["sampler"])
    with pytest.raises(ValueError, match="head_dim 96"):
        gpu_compile.compile_for_gpu(dataclasses.replace(smollm2, head_dim=96), engine_config, target="h100",
                                    which_buckets="ends")
