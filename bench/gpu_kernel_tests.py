"""The kernel tests bench/gpu_check.sh runs on the GPU: the subset that matters on hardware, sized
to the step's limit from a measured compile time per item.

    python3 bench/gpu_kernel_tests.py run --mode=gpu         # pytest -v on them (bench/gpu_check.sh's kernel_tests)
    python3 bench/gpu_kernel_tests.py run --mode=dry-run     # every GPU item collected, the dry run's few run
    python3 bench/gpu_kernel_tests.py list --mode=gpu        # the node IDs, in the order they run
    python3 bench/gpu_kernel_tests.py list --mode=dry-run    # the few the dry run runs interpreted
    python3 bench/gpu_kernel_tests.py budget                 # the estimate against the step's limit
    python3 bench/gpu_kernel_tests.py measure                # compile seconds per program, again (needs ptxas)

CI runs all of tests/test_kernels.py, tests/test_mosaic_kernels.py and tests/test_grouped_matmul.py
(about 150 items, 200 compiles) in the interpreters; a GPU call cannot. On the GPU each kernel,
head layout and dtype runs once: the Triton kernels (decode and ragged, each with the XLA path and
the reference beside them) at Llama-3-8B's layout in bfloat16, and in float32 (decode at page size
32 and group 3 over int8 pages with a window, ragged at page size 8 and group 4 with a window,
soft-cap and scale); the Mosaic kernels at the layouts of Llama-3 / Mistral, SmolLM2, Gemma-2
(head_dim 256) and float16 with a group of 8, with a window, soft-cap and scale, over int8 pages
(fp8 pages: the kernels step, at Llama-3-8B's shape), and their independence of the block table's
order (Qwen2.5's group of 7 stays in CI: SmolLM2's group of 3 pads the same way); the grouped
matmul in bfloat16 and float32 and its empty groups; the multi-LoRA kernel at SmolLM2's decode
shape in bfloat16; an engine serving with the Triton backend
hidden (tests/test_dispatch_fallback.py); last, the Mosaic GPU multi-LoRA kernel at the same decode
shape (tests/test_mosaic_lora.py; bench/kernel_speed.py also checks and times it on the GPU, so a
step cut short loses little there). The rest (other page sizes and splits of the same
layouts, the XLA path's own cases, host-side checks, CPU-only invariants) stays in CI.

Each item's estimate is the deviceless compile time for an H200 of the programs it compiles
(COMPILE_S, measured by `measure` on the 2-core development machine, 2026-12-05), the float64
numpy oracle and the run itself being small beside it; the items run most valuable first, so a
step cut short by its limit keeps what matters most (pytest's -v lines are counted as they come).
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import time

# Seconds to compile one program for an H200 without a GPU (jax 0.11.2, `measure`, 2026-12-05, a
# 2-core machine under load): a Triton / Mosaic / XLA-path / reference program at a test's shapes.
COMPILE_S = {"triton decode": 1.43, "triton ragged": 2.35, "mosaic decode": 2.49, "mosaic ragged": 3.99,
             "xla decode": 2.96, "xla ragged": 3.67, "reference decode": 1.48, "reference ragged": 2.23,
             "grouped": 1.40, "engine shape": 2.5,
             "lora": 0.40, "lora reference": 0.44,  # the LoRA pair measured 2026-12-05 06:55 UTC
             # 1.24 s beside the Triton LoRA program's 0.76 s in one run on the loaded machine, scaled to
             # the 0.40 above
             "mosaic lora": 0.65}
# What an item compiles: tests/test_kernels.py's checks compile the Triton kernel, the reference and
# the XLA path; the Mosaic decode test two split counts; the engine test, on its 2 engines, 4 step shapes
# and 3 sampler shapes (counted with jax_log_compiles: 6 at an engine shape's cost in all).
TRITON_DECODE = ("triton decode", "reference decode", "xla decode")
TRITON_RAGGED = ("triton ragged", "reference ragged", "xla ragged")
K, M, G = "tests/test_kernels.py::", "tests/test_mosaic_kernels.py::", "tests/test_grouped_matmul.py::"
LORA = "tests/test_lora_kernels.py::"
MOSAIC_LORA = "tests/test_mosaic_lora.py::"
GPU_TESTS = [
    (K + "test_paged_decode_matches_oracle[ps16-d128-g4-kv1-bfloat16]", TRITON_DECODE),
    (K + "test_ragged_matches_oracle[ps16-d128-g4-kv1-bfloat16]", TRITON_RAGGED),
    (M + "test_mosaic_decode_matches_oracle[ps16-d128-g4-kv2-bfloat16]", ("mosaic decode",) * 2),
    (M + "test_mosaic_ragged_matches_oracle[ps16-d128-g4-kv2-bfloat16]", ("mosaic ragged",)),
    (K + "test_sliding_window_on_int8_pages[decode]", TRITON_DECODE),  # float32 queries, page 32, group 3
    (M + "test_mosaic_decode_matches_oracle[ps16-d64-g3-kv3-bfloat16]", ("mosaic decode",) * 2),  # SmolLM2
    (M + "test_mosaic_decode_matches_oracle[ps16-d256-g2-kv1-bfloat16]", ("mosaic decode",) * 2),  # Gemma-2
    (M + "test_mosaic_ragged_matches_oracle[ps8-d64-g8-kv1-float16]", ("mosaic ragged",)),
    (K + "test_soft_cap_and_scale_match_oracle[ragged-Options(window=11, scale=0.3, cap=5.0)]",
     TRITON_RAGGED),  # float32, page 8, group 4
    (M + "test_mosaic_soft_cap_and_scale_match_oracle[Options(window=11, scale=0.3, cap=5.0)]",
     ("mosaic decode", "mosaic ragged")),
    (M + "test_mosaic_kernels_on_quantized_pages_match_oracle[ps16-d128-g4-kv2-bfloat16-int8]",
     ("mosaic decode", "mosaic ragged") * 2),
    (M + "test_mosaic_results_do_not_depend_on_the_block_table_order", ("mosaic decode",)),
    (G + "test_kernel_matches_ragged_dot[prefill-default-tiles-bfloat16]", ("grouped",) * 2),
    (G + "test_the_matrices_of_empty_groups_are_never_read[kernel]", ("grouped",) * 2),  # float32
    (LORA + "test_update_matches_the_reference[kernel-decode-smollm2-k-bfloat16]", ("lora", "lora reference")),
    ("tests/test_dispatch_fallback.py::test_an_engine_serves_with_the_triton_backend_hidden", ("engine shape",) * 6),
    (MOSAIC_LORA + "test_kernel_matches_the_reference[decode-smollm2-k]", ("mosaic lora", "lora reference")),
]
# The dry run, interpreted on the CPU: one decode and one ragged case of each kernel family at 8B-like heads.
DRY_RUN_TESTS = [K + "test_paged_decode_matches_oracle[ps16-d128-g4-kv1-bfloat16]",
                 K + "test_ragged_matches_oracle[ps16-d128-g4-kv1-bfloat16]",
                 M + "test_mosaic_decode_matches_oracle[ps16-d128-g4-kv2-bfloat16]",
                 M + "test_mosaic_ragged_matches_oracle[ps16-d128-g4-kv2-bfloat16]"]
STEP_LIMIT_S = 110  # bench/gpu_check.sh's kernel_tests limit on the GPU
START_S = 15  # pytest's start there: jax, CUDA, the test modules' imports


def estimate_s(programs) -> float:
    return sum(COMPILE_S[p] for p in programs)


def budget() -> dict:
    """The items' estimated seconds against what the step leaves them."""
    items = sum(estimate_s(programs) for _, programs in GPU_TESTS)
    return {"items": len(GPU_TESTS), "estimated_s": round(items, 1), "available_s": STEP_LIMIT_S - START_S}


def measure() -> dict:
    """Compiles each kind of program of COMPILE_S (but the engine's) for an H200 without a GPU, at
    a test's shapes (6 sequences of Llama-3-8B's head layout, 20 pages of 16), and times it."""
    import jax
    import jax.numpy as jnp

    from jaxserve.planning import gpu_compile
    from pallas_kernels import grouped_matmul, lora_bgmv, mosaic_decode, mosaic_lora, mosaic_ragged, paged_decode
    from pallas_kernels import ragged_prefill
    from pallas_kernels import reference, xla_paged

    mesh = gpu_compile.gpu_mesh("h200", 1)
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

    def spec(shape, dtype=jnp.bfloat16):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=replicated)

    pages, table, lens = spec((20, 16, 1, 128)), spec((6, 10), jnp.int32), spec((6,), jnp.int32)
    decode = (spec((6, 4, 128)), pages, pages, table, lens)
    ragged = (spec((40, 4, 128)), pages, pages, table, lens, spec((7,), jnp.int32))
    grouped = (spec((200, 128)), spec((7, 128, 256)), spec((7,), jnp.int32))
    lora = (spec((32, 576)), spec((5, 576, 16)), spec((5, 16, 192)), spec((32,), jnp.int32))  # SmolLM2's k, decode
    programs = {"triton decode": (paged_decode.paged_decode_attention, decode),
                "triton ragged": (ragged_prefill.ragged_paged_attention, ragged),
                "mosaic decode": (mosaic_decode.paged_decode_attention, decode),
                "mosaic ragged": (mosaic_ragged.ragged_paged_attention, ragged),
                "xla decode": (xla_paged.paged_decode_attention, decode),
                "xla ragged": (xla_paged.ragged_paged_attention, ragged),
                "reference decode": (reference.paged_decode_attention, decode),
                "reference ragged": (reference.ragged_paged_attention, ragged),
                "grouped": (grouped_matmul.grouped_matmul, grouped),
                "lora": (lora_bgmv.lora_update, lora), "lora reference": (reference.lora_update, lora),
                "mosaic lora": (mosaic_lora.lora_update, lora)}
    seconds = {}
    for name, (function, args) in programs.items():
        start = time.perf_counter()
        gpu_compile._compile(jax.jit(function), args, mesh)
        seconds[name] = round(time.perf_counter() - start, 2)
        print(f"{name:<18}{seconds[name]:>7.2f} s", flush=True)
    return seconds


def run(mode: str) -> int:
    """pytest -v on the GPU items in their order; the dry run first collects every GPU item (an ID
    that no longer exists fails here, not on the GPU), then runs its few interpreted."""
    pytest = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider"]
    if mode == "dry-run":
        ids = [node for node, _ in GPU_TESTS]
        collected = subprocess.run(pytest + ["-q", "--collect-only", *ids], capture_output=True, text=True)
        found = [line for line in collected.stdout.splitlines() if "::" in line]
        print(f"collected {len(found)} of the {len(ids)} GPU items (exit {collected.returncode})", flush=True)
        if collected.returncode != 0 or len(found) != len(ids):
            print(collected.stdout[-4000:] + collected.stderr[-2000:], flush=True)
            return 4
        return subprocess.run(pytest + ["-v", *DRY_RUN_TESTS]).returncode
    # In the process that runs the tests, a GPU first (on a CPU they would pass interpreted); then
    # --durations=0: each item's seconds on the GPU, to size the next run's subset from.
    gate = ("import sys, jax, pytest; backend = jax.default_backend(); "
            "sys.exit(pytest.main(sys.argv[1:]) if backend == 'gpu' else "
            "f'no GPU found in the kernel tests\' process: jax\'s backend is {backend!r}')")
    args = ["-p", "no:cacheprovider", "-v", "--durations=0", *(node for node, _ in GPU_TESTS)]
    return subprocess.run([sys.executable, "-c", gate, *args]).returncode


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list").add_argument("--mode", choices=("gpu", "dry-run"), required=True)
    sub.add_parser("run").add_argument("--mode", choices=("gpu", "dry-run"), required=True)
    sub.add_parser("budget")
    sub.add_parser("measure")
    args = parser.parse_args(argv)
    if args.command == "run":
        return run(args.mode)
    if args.command == "list":
        print("\n".join(DRY_RUN_TESTS if args.mode == "dry-run" else [node for node, _ in GPU_TESTS]))
    elif args.command == "budget":
        print(budget())
    else:
        measure()
    return 0


if __name__ == "__main__":
    sys.exit(main())
