"""Executables compiled for a GPU on a machine without one, then loaded and run on the GPU: the
question bench/gpu_check.sh asks a lent GPU (`jaxserve plan --target=... --compile
--save_executables=DIR`, then `jaxserve serve --executables=DIR` there).

    # here, in an environment with the GPU machine's jax (.venv-gpu-rehearsal: `make gpu-executables`):
    JAX_PLATFORMS=cpu python bench/saved_executables.py save --dir=bench/out/gpu_executables --target=h200
    # on the GPU (bench/gpu_check.sh, the folder carried with the working tree):
    python bench/saved_executables.py check --dir=bench/out/gpu_executables --out=executables.json

The engine is a tiny random bf16 Llama with small limits and a fixed page pool (the description
of the saved folder names them all). `check` builds it from the folder (every shape loaded, none
compiled), times that against an engine that compiles its own, and compares their greedy tokens;
a folder the engine refuses (another jax, device or source) is reported with the reason, a
missing folder as skipped. Exit status 1 only when loaded executables give other tokens.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jaxserve import platforms  # noqa: E402

platforms.default_to_cpu_without_gpu()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench.e2e_gpu import TINY  # noqa: E402
from jaxserve.core.request import SamplingParams  # noqa: E402
from jaxserve.engine import Engine, EngineConfig  # noqa: E402
from jaxserve.executor import executables  # noqa: E402
from jaxserve.models import weights  # noqa: E402

ENGINE = EngineConfig(dtype="bfloat16", max_num_seqs=8, max_num_batched_tokens=64, max_num_prefill_seqs=2,
                      max_model_len=256, num_pages=512, warmup=True)
PROMPT_LENGTHS = (5, 40, 130)


def save(directory: str, target: str) -> dict:
    from jaxserve.planning import gpu_compile  # the gpu-compile extra: only here, not on the GPU
    report = gpu_compile.compile_for_gpu(TINY, ENGINE, target=target, save_executables=directory)["compile"]
    failed = [s["bucket"] for s in report["buckets"] + report["sampler"] + report["prompt_logprobs"] if not s["ok"]]
    return {"failed": failed, **report["executables"], "wall_seconds": report["wall_seconds"]}


def _engine(params, executables_dir: str | None):
    start = time.perf_counter()
    engine = Engine(TINY, params, None, dataclasses.replace(ENGINE, executables=executables_dir),
                    model_name="saved-executables")
    return engine, time.perf_counter() - start


def _greedy(engine) -> list[list[int]]:
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, TINY.vocab_size, n).tolist() for n in PROMPT_LENGTHS]
    results = engine.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    return [r.token_ids for r in results]


def check(directory: str) -> dict:
    report = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "directory": directory}
    if not os.path.isfile(os.path.join(directory, "manifest.json")):
        return {**report, "status": "skipped", "reason": f"no saved executables in {directory}: run "
                "`make gpu-executables` on the CPU machine and carry the folder"}
    params = weights.random_params(TINY, dtype=jnp.bfloat16, seed=3)
    try:
        loaded, report["startup_loaded_s"] = _engine(params, directory)
    except executables.ExecutablesMismatch as e:
        return {**report, "status": "refused", "reason": str(e)}
    report["shapes_loaded"] = loaded.runner._executable_store.loaded
    tokens_loaded = _greedy(loaded)
    del loaded
    os.environ["JAXSERVE_EXECUTABLES_CACHE"] = "0"  # the engine to compare with compiles every shape itself
    compiled, report["startup_compiled_s"] = _engine(params, None)
    tokens_compiled = _greedy(compiled)
    return {**report, "status": "loaded", "greedy_equal": tokens_loaded == tokens_compiled,
            "tokens_loaded": tokens_loaded, "tokens_compiled": tokens_compiled}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=("save", "check"))
    parser.add_argument("--dir", required=True, help="the folder of saved executables")
    parser.add_argument("--target", default="h200", help="save: the GPU to compile for (h100, h200, a100)")
    parser.add_argument("--out", help="check: the JSON report")
    args = parser.parse_args(argv)
    report = save(args.dir, args.target) if args.mode == "save" else check(args.dir)
    text = json.dumps(report, indent=2)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(text)
    if args.mode == "save":
        return 1 if report["failed"] or report["saved"] != report["shapes"] else 0
    return 1 if report["status"] == "loaded" and not report["greedy_equal"] else 0


if __name__ == "__main__":
    sys.exit(main())
