"""Single-stream latency: one request at a time, TTFT and TPOT, jaxserve next to transformers.

Each repeat draws a fresh random-token prompt (`--prompt_len` tokens, fixed seed per repeat) and
runs it, greedy with ignore_eos for `--output_len` tokens, through every engine in turn, so the
engines are interleaved and share whatever load the machine has; the medians over repeats are
reported. Engines:
  jaxserve <variant>  `Engine.step` on one request: float weights, int8 / int4 weights
                      (`--quantization`), "+embed" for the embedding and tied lm_head quantized too
                      (the variant name is the EngineConfig quantization, e.g. int8+embed);
                      "+float_activations": the quantized matmuls in XLA with float activations
                      (EngineConfig.cpu_int8_activations=False) instead of the CPU kernel;
                      TTFT = wall time from add_request to the step that returns the first token,
                      TPOT = wall time of each later step (host work, sampling and detokenizing
                      nothing included: no tokenizer), per token;
  transformers        the same weights in float32 (the GGUF the model was converted from), one
                      forward of the prompt then one forward per token with the KV cache;
  llama.cpp           optional (`--llama_cpp_python=PATH`: a Python with llama-cpp-python, run as
                      a subprocess on the same GGUF and prompts; SmolLM2's is Q4_1).

  python bench/single_stream.py --out=bench/out/single_stream.json
  python bench/single_stream.py --variants=float,int8,int4 --llama_cpp_python=/path/to/venv/bin/python
  python bench/single_stream.py --model=DIR --prompt_len=20 --output_len=4 --repeats=1 --skip_hf   # smoke
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import common  # noqa: E402


def prompts_for(args, vocab_size) -> list[list[int]]:
    rng = np.random.default_rng(args.seed)
    low = min(100, vocab_size // 2)  # clear of the special tokens at the start of the vocabulary
    return [rng.integers(low, vocab_size, args.prompt_len).tolist() for _ in range(args.repeats)]


# ---- jaxserve ----------------------------------------------------------------------------------
def build_engine(model_config, params, variant, args):
    from jaxserve.engine import Engine, EngineConfig

    float_activations = variant.endswith("+float_activations")  # EngineConfig.cpu_int8_activations=False
    variant = variant.removesuffix("+float_activations")
    dtype = "bfloat16" if variant == "bf16" else "float32"  # bf16: weights, activations and KV in bfloat16
    if dtype == "bfloat16":
        import jax
        import jax.numpy as jnp
        params = jax.tree.map(lambda a: a.astype(jnp.bfloat16) if a.dtype == jnp.float32 else a, params)
    quantization = None if variant in ("float", "bf16") else variant
    if variant.endswith("+embed"):  # the embedding and tied lm_head in int8 too
        from jaxserve.models import quantization as quantization_lib
        params = quantization_lib.quantize_embedding(params)
        quantization = None if variant == "float+embed" else variant[:-len("+embed")]
    max_model_len = args.max_model_len
    cfg = EngineConfig(max_model_len=max_model_len, enable_prefix_caching=False, warmup=False,
                       num_pages=2 * -(-max_model_len // 16) + 2, quantization=quantization,
                       cpu_int8_activations=not float_activations, dtype=dtype)
    return Engine(model_config, params, None, cfg)


def jaxserve_request(engine, prompt, output_len):
    """(TTFT seconds, [seconds of each later token], token ids) of one request run alone."""
    from jaxserve.core.request import SamplingParams

    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    tokens, token_times = [], []
    start = time.perf_counter()
    engine.add_request("single", prompt, params)
    last = None
    while engine.has_unfinished():
        for out in engine.step():
            tokens.extend(out.new_token_ids)
        now = time.perf_counter()
        if tokens and last is None:
            last = now
            ttft = now - start
        elif tokens:
            token_times.append(now - last)
            last = now
    return ttft, token_times, tokens


# ---- transformers ------------------------------------------------------------------------------
def hf_request(model, prompt, output_len):
    import torch

    tokens, token_times = [], []
    with torch.inference_mode():
        start = time.perf_counter()
        out = model(input_ids=torch.tensor([prompt]), use_cache=True)
        token = int(out.logits[0, -1].argmax())
        ttft = time.perf_counter() - start
        tokens.append(token)
        cache = out.past_key_values
        for _ in range(output_len - 1):
            start = time.perf_counter()
            out = model(input_ids=torch.tensor([[token]]), past_key_values=cache, use_cache=True)
            token = int(out.logits[0, -1].argmax())
            token_times.append(time.perf_counter() - start)
            tokens.append(token)
            cache = out.past_key_values
    return ttft, token_times, tokens


# ---- llama.cpp (a subprocess in an environment that has llama-cpp-python) -------------------------
LLAMA_CPP_SCRIPT = r"""
import json, sys, time
from llama_cpp import Llama
job = json.load(sys.stdin)
model = Llama(model_path=job["gguf"], n_ctx=job["n_ctx"], n_threads=job["threads"], n_batch=512, verbose=False)
model.eval(job["prompts"][0][:8]); model.reset()  # warm
results = []
for prompt in job["prompts"]:
    model.reset()
    start = time.perf_counter()
    model.eval(prompt)
    token = model.sample(temp=0.0)
    ttft = time.perf_counter() - start
    times, tokens = [], [int(token)]
    for _ in range(job["output_len"] - 1):
        start = time.perf_counter()
        model.eval([token])
        token = model.sample(temp=0.0)
        times.append(time.perf_counter() - start)
        tokens.append(int(token))
    results.append({"ttft": ttft, "token_times": times, "tokens": tokens})
print(json.dumps({"results": results, "system_info": __import__("llama_cpp").llama_print_system_info().decode()}))
"""


def llama_cpp_requests(python, gguf, prompts, args) -> dict:
    job = dict(gguf=gguf, prompts=prompts, output_len=args.output_len, n_ctx=args.max_model_len,
               threads=os.cpu_count() or 1)
    env = dict(os.environ)
    if _OMP_WAIT_POLICY_SET_HERE:  # llama.cpp's OpenMP threads at their default (spinning) wait policy:
        env.pop("OMP_WAIT_POLICY", None)  # passive waits between its many small ops tripled its TPOT here
    done = subprocess.run([python, "-c", LLAMA_CPP_SCRIPT], input=json.dumps(job), capture_output=True, text=True,
                          timeout=1800, env=env)
    if done.returncode:
        raise RuntimeError(f"llama.cpp run failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def summary(ttfts, token_times) -> dict:
    per_request_tpot = [float(np.median(t)) for t in token_times if t]
    return dict(ttft_ms=1e3 * float(np.median(ttfts)), tpot_ms=1e3 * float(np.median(per_request_tpot)),
                ttft_ms_all=[1e3 * t for t in ttfts], tpot_ms_per_request=[1e3 * t for t in per_request_tpot])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", help="'smollm2' or a converted model directory")
    parser.add_argument("--variants", default="float,int8,int4",
                        help="comma list: float or a --quantization value (int8, int4, int8+embed, ...)")
    parser.add_argument("--prompt_len", type=int, default=500)
    parser.add_argument("--output_len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5, help="requests per engine (fresh prompt each)")
    parser.add_argument("--max_model_len", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip_hf", action="store_true", help="no transformers baseline")
    parser.add_argument("--llama_cpp_python", default=None,
                        help="a Python interpreter with llama-cpp-python: adds llama.cpp on the model's GGUF")
    parser.add_argument("--out", default=None, help="JSON report path")
    args = parser.parse_args(argv)
    if args.prompt_len < 1 or args.output_len < 2 or args.repeats < 1:
        print("single_stream: --prompt_len >= 1, --output_len >= 2 and --repeats >= 1", file=sys.stderr)
        return 2

    import jax.numpy as jnp

    from checkpoints import default_model, load

    model_dir = default_model.resolve_model(args.model) if args.model == "smollm2" else args.model
    model_config = load.load_config(model_dir)
    params = load.load_params(model_dir, jnp.float32)
    info = common.machine_info(with_jax=True)
    prompts = prompts_for(args, model_config.vocab_size)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]

    engines, decode_buckets = {}, {}
    for variant in variants:
        start = time.perf_counter()
        engine = build_engine(model_config, params, variant, args)
        buckets = decode_buckets.setdefault(f"jaxserve {variant}", set())
        engine.add_step_listener(lambda record, buckets=buckets: buckets.add(record.bucket_decode_rows)
                                 if record.kind == "decode" else None)
        for _ in range(2):  # compiles the shapes a single stream uses (the second request: those
            jaxserve_request(engine, prompts[0][:8], 2)  # called with a KV cache a step returned)
        engines[f"jaxserve {variant}"] = engine
        print(f"jaxserve {variant}: built and compiled in {time.perf_counter() - start:.1f}s", file=sys.stderr)
    hf_model = None
    if not args.skip_hf:
        from bench.hf_baseline import load_hf_model
        import torch
        hf_model, _ = load_hf_model(model_dir)
        info["torch"] = torch.__version__
        hf_request(hf_model, prompts[0][:8], 2)  # warm

    samples = {name: ([], [], []) for name in [*engines, *(["transformers"] if hf_model is not None else [])]}
    for prompt in prompts:  # interleaved: every engine runs each prompt before the next prompt
        for name, engine in engines.items():
            ttft, times, tokens = jaxserve_request(engine, prompt, args.output_len)
            samples[name][0].append(ttft), samples[name][1].append(times), samples[name][2].append(tokens)
        if hf_model is not None:
            ttft, times, tokens = hf_request(hf_model, prompt, args.output_len)
            samples["transformers"][0].append(ttft), samples["transformers"][1].append(times)
            samples["transformers"][2].append(tokens)
        print(f"prompt {len(samples[next(iter(samples))][0])}/{len(prompts)} done (load {common.load_average()})",
              file=sys.stderr)
    results = {name: summary(ttfts, times) for name, (ttfts, times, _) in samples.items()}
    for name, buckets in decode_buckets.items():
        results[name]["decode_bucket_rows"] = sorted(buckets)
        results[name]["weights_bytes"] = engines[name].weights_bytes
    if "transformers" in samples and "jaxserve float" in samples:
        ours, theirs = samples["jaxserve float"][2], samples["transformers"][2]
        results["jaxserve float"]["greedy_equal_to_transformers"] = sum(a == b for a, b in zip(ours, theirs))
    if args.llama_cpp_python:
        import json as json_lib
        with open(os.path.join(model_dir, "jaxserve.json")) as f:
            source = json_lib.load(f)["source"]
        run = llama_cpp_requests(args.llama_cpp_python, source, prompts, args)
        results["llama.cpp"] = summary([r["ttft"] for r in run["results"]], [r["token_times"] for r in run["results"]])
        results["llama.cpp"]["system_info"] = run["system_info"]
        results["llama.cpp"]["gguf"] = os.path.basename(source)
    info["load_average_end"] = common.load_average()

    rows = []
    base = results.get("transformers")
    for name, r in results.items():
        rows.append(dict(engine=name, ttft=r["ttft_ms"], tpot=r["tpot_ms"],
                         ttft_vs=r["ttft_ms"] / base["ttft_ms"] if base else float("nan"),
                         tpot_vs=r["tpot_ms"] / base["tpot_ms"] if base else float("nan"),
                         tpot_vs_cpp=(r["tpot_ms"] / results["llama.cpp"]["tpot_ms"]) if "llama.cpp" in results
                         else float("nan")))
    print(common.machine_line(info))
    print(f"one request at a time: {args.prompt_len}-token prompts, {args.output_len} greedy tokens, "
          f"{args.repeats} prompts, medians")
    print(common.format_table(rows, [
        ("engine", "engine", "s"), ("ttft", "TTFT ms", ".0f"), ("tpot", "TPOT ms", ".1f"),
        ("ttft_vs", "TTFT / transformers", ".2f"), ("tpot_vs", "TPOT / transformers", ".2f"),
        ("tpot_vs_cpp", "TPOT / llama.cpp", ".2f")]))
    common.write_json(args.out, dict(machine=info, args=vars(args), results=results))
    return 0


_OMP_WAIT_POLICY_SET_HERE = False

if __name__ == "__main__":
    # Spinning OpenMP threads make torch's small matmuls far slower on a shared machine (see
    # bench/throughput.py); set before torch loads (for torch only, see llama_cpp_requests).
    if "OMP_WAIT_POLICY" not in os.environ:
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
        _OMP_WAIT_POLICY_SET_HERE = True
    sys.exit(main())
