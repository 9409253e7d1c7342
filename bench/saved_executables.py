"""Executables compiled for a GPU on a machine without one, then loaded and run on the GPU: the
question bench/gpu_check.sh asks a lent GPU (`jaxserve plan --target=... --compile
--save_executables=DIR`, then `jaxserve serve --executables=DIR` there).

    # here, in an environment with the GPU machine's jax (.venv-gpu-rehearsal: `make gpu-executables`):
    JAX_PLATFORMS=cpu python3 bench/saved_executables.py save --dir=bench/out/gpu_executables --target=h200
    # on the GPU (bench/gpu_check.sh, the folder carried with the working tree):
    python3 bench/saved_executables.py check --dir=bench/out/gpu_executables --out=executables.json
    # the dry run on a CPU: a folder saved by an engine here, loaded and compared; the H200's refused
    python3 bench/saved_executables.py save --dir=/tmp/here --target=here
    python3 bench/saved_executables.py check --dir=/tmp/here --refused_elsewhere=/tmp/h200 --out=e.json

The engine is a tiny random bf16 Llama with small limits and a fixed page pool (the description
of the saved folder names them all). `check` builds it from the folder (every shape loaded, none
compiled), then, once that engine is released, one that compiles its own, and compares their
greedy tokens up to the compiled engine's near-ties (bench/gpu_check_report.compare_greedy: a
deviceless compile may choose other kernels than the device's own). Checks: "loaded" (a folder
the engine refuses, another jax, device or source, is a failure with the reason),
"greedy_vs_compiled"; a missing folder makes the report "skipped", never ok. Exit status 1 when a
check failed or differs.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
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
from bench.gpu_check_report import StepReport, compare_greedy, require_gpu, top2_gap  # noqa: E402
from jaxserve.core.request import SamplingParams  # noqa: E402
from jaxserve.engine import Engine, EngineConfig  # noqa: E402
from jaxserve.executor import executables  # noqa: E402
from jaxserve.models import weights  # noqa: E402

ENGINE = EngineConfig(dtype="bfloat16", max_num_seqs=8, max_num_batched_tokens=64, max_num_prefill_seqs=2,
                      max_model_len=256, num_pages=512, warmup=True)
PROMPT_LENGTHS = (5, 40, 130, 17, 77, 3)


def save(directory: str, target: str) -> dict:
    """Saves the engine's executables to `directory`: compiled deviceless for `target` (a GPU
    preset), or by an engine warming up on this machine (`target` "here")."""
    if target == "here":
        start = time.perf_counter()
        engine, _ = _engine(weights.random_params(TINY, dtype=jnp.bfloat16, seed=3),
                            dataclasses.replace(ENGINE, save_executables=directory))
        saved = _store(engine).saved
        del engine
        gc.collect()
        files = len([name for name in os.listdir(directory) if name.endswith(".exe")])
        return {"failed": [], "saved": saved, "shapes": files, "wall_seconds": time.perf_counter() - start}
    from jaxserve.planning import gpu_compile  # the gpu-compile extra: only here, not on the GPU
    report = gpu_compile.compile_for_gpu(TINY, ENGINE, target=target, save_executables=directory)["compile"]
    failed = [s["bucket"] for s in report["buckets"] + report["sampler"] + report["prompt_logprobs"] if not s["ok"]]
    return {"failed": failed, **report["executables"], "wall_seconds": report["wall_seconds"]}


def _engine(params, config: EngineConfig):
    start = time.perf_counter()
    engine = Engine(TINY, params, None, config, model_name="saved-executables")
    return engine, time.perf_counter() - start


def _store(engine) -> executables.ExecutableStore:
    """The engine's executable store (its runner's executable cache holds it)."""
    return engine.runner.executables.store


def _greedy(engine) -> dict:
    """Greedy tokens of the prompts, with the top-2 gap at each position (the near-tie rule's)."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, TINY.vocab_size, n).tolist() for n in PROMPT_LENGTHS]
    results = engine.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2))
    return {"tokens": [list(r.token_ids) for r in results],
            "gaps": [[top2_gap(dict(p.top)) for p in r.logprobs] for r in results]}


def check(directory: str, report: StepReport, refused_elsewhere: str | None = None) -> None:
    """Loads `directory`'s executables into an engine (none compiled), then an engine that compiles
    its own (the reference), one after the other; their greedy tokens compared up to near-ties.
    `refused_elsewhere`: a folder saved for another platform, which the engine must refuse naming it."""
    report.update(device=jax.devices()[0].device_kind, jax=jax.__version__, directory=directory)
    if refused_elsewhere:
        refused_check(refused_elsewhere, report)
    if not os.path.isfile(os.path.join(directory, "manifest.json")):
        report.update(status="skipped", reason=f"no saved executables in {directory}: run `make gpu-executables` "
                      "on the CPU machine and carry the folder")
        report.write()
        return
    params = weights.random_params(TINY, dtype=jnp.bfloat16, seed=3)
    try:
        loaded, startup = _engine(params, dataclasses.replace(ENGINE, executables=directory))
    except executables.ExecutablesMismatch as e:
        report.update(status="refused", reason=str(e))
        report.check("loaded", "failed", reason=str(e))
        return
    report.update(status="loaded", startup_loaded_s=startup, shapes_loaded=_store(loaded).loaded)
    report.check("loaded", "ok", shapes_loaded=report["shapes_loaded"])
    report.put("loaded_run", _greedy(loaded))
    del loaded
    gc.collect()
    os.environ["JAXSERVE_EXECUTABLES_CACHE"] = "0"  # the engine to compare with compiles every shape itself
    compiled, report["startup_compiled_s"] = _engine(params, ENGINE)
    reference = report.put("compiled_run", _greedy(compiled))
    report.check("greedy_vs_compiled", **compare_greedy(report["loaded_run"]["tokens"], reference["tokens"],
                                                        reference["gaps"]))


def refused_check(directory: str, report: StepReport) -> None:
    """Check "refused_elsewhere": this machine's engine refuses `directory` (saved for a GPU), naming the platform."""
    params = weights.random_params(TINY, dtype=jnp.bfloat16, seed=3)
    try:
        engine, _ = _engine(params, dataclasses.replace(ENGINE, executables=directory))
    except executables.ExecutablesMismatch as e:
        here, text = jax.devices()[0].platform, str(e)
        named = f"here {here}" in text
        # The platform's difference first: the other differences (the step's params, its cache) can be long.
        platform = [part.strip("()") for part in text.split("; ") if part.startswith("platform: ")]
        report.check("refused_elsewhere", "ok" if named else "differ", reason="; ".join([*platform, text])[:600])
        return
    del engine
    gc.collect()
    report.check("refused_elsewhere", "differ", reason=f"the engine loaded {directory}, saved for another platform")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=("save", "check"))
    parser.add_argument("--dir", required=True, help="the folder of saved executables")
    parser.add_argument("--target", default="h200",
                        help="save: the GPU to compile for (h100, h200, a100), or 'here' (an engine on this machine)")
    parser.add_argument("--out", help="check: the JSON report (written after every figure)")
    parser.add_argument("--refused_elsewhere", help="check: a folder saved for another platform, to be refused")
    args = parser.parse_args(argv)
    if args.mode == "save":
        result = save(args.dir, args.target)
        print(json.dumps(result, indent=2))
        return 1 if result["failed"] or result["saved"] != result["shapes"] else 0
    require_gpu()
    report = StepReport(args.out or os.devnull + ".json")
    check(args.dir, report, args.refused_elsewhere)
    print(json.dumps(report, indent=2, default=str))
    return report.exit_status()


if __name__ == "__main__":
    sys.exit(main())
