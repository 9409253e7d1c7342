"""Prompt compute in int8 and bfloat16 on the CPU: the speed of a prompt and what it costs in accuracy.

For each mode (the same SmolLM2 weights served as):
  float32        the default: float32 weights and compute;
  bf16           --dtype=bfloat16: bfloat16 weights, prompt matmuls in bfloat16 (float32 sums);
  int8           --quantization=int8 (per output channel), --cpu_prompt_dtype=auto: prompt chunks
                 in the C++ VNNI kernel on CPUs without AMX, else in bfloat16 on the weights
                 dequantized to bfloat16; decode steps in the C++ kernel (activations in int8 per
                 32 inputs);
  int8+int8_prompts / int8+bf16_prompts   --cpu_prompt_dtype=int8 / bfloat16: prompt chunks in
                 the C++ kernel (int8 activations per 32 inputs, as decode steps') / in bfloat16;
  int8+float_activations   the same int8 weights, XLA's float32 matmuls on them dequantized
                 (--cpu_int8_activations=false);
  int4 / int4+int8_prompts / int4+float_activations   --quantization=int4 (groups of 32, zero
                 point): prompt chunks in bfloat16, in the C++ kernel, or float32 without int8
                 activations;
it measures, interleaved with transformers (float32) on the same prompts so both share the load:
  prompt speed   TTFT of `--prompt_len` random tokens (one request, max_tokens 1; fresh prompt
                 per repeat, medians), the matmul GFLOP/s it implies, and that rate as a fraction
                 of the probed matmul peak of the mode's compute dtype (jaxserve.planning.probe at
                 the prompt's rows: float32, bfloat16 or int8);
  accuracy       against the float32 model, and against transformers on the mode's own weights
                 (dequantized, or bfloat16-rounded, multiplied in float32), so the compute's error
                 shows apart from the weights': on a held-out English text (CPython's license,
                 `--text_tokens` tokens) the perplexity, and the share of positions whose most
                 likely next token is the same; on `--chat_prompts` chat prompts, greedy
                 completions of `--output_len` tokens: how many equal, and the mean first
                 position where they part.

  python bench/prompt_compute.py --out=bench/out/prompt_compute.json
  python bench/prompt_compute.py --modes=float32,int8 --repeats=1 --chat_prompts=2   # smoke
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import sysconfig
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import common  # noqa: E402

MODES = ("float32", "bf16", "int8", "int8+int8_prompts", "int8+bf16_prompts", "int8+float_activations", "int4",
         "int4+int8_prompts", "int4+float_activations")
CHAT = ["What is the capital of France?", "Write a haiku about the sea.", "Explain photosynthesis in two sentences.",
        "List three prime numbers.", "How do I reverse a list in Python?", "What causes rain?",
        "Give me a tip for learning a new language.", "Summarize the plot of Cinderella."]
HF_LINEAR = {"wq": "self_attn.q_proj", "wk": "self_attn.k_proj", "wv": "self_attn.v_proj", "wo": "self_attn.o_proj",
             "w_gate": "mlp.gate_proj", "w_up": "mlp.up_proj", "w_down": "mlp.down_proj"}


def mode_weights(mode, params, config):
    """(engine params, EngineConfig overrides, compute dtype of a prompt's matmuls, the float32
    params transformers gets for the same weights) of a mode."""
    import jax
    import jax.numpy as jnp

    from jaxserve.models import cpu_layout
    from jaxserve.models import quantization as qz

    name, _, suffix = mode.partition("+")
    float_acts = suffix == "float_activations"
    if name == "float32":
        return params, {}, "float32", params
    if name == "bf16":
        bf16 = jax.tree.map(lambda a: a.astype(jnp.bfloat16), params)
        return (bf16, {"dtype": "bfloat16"}, cpu_layout.prompt_compute_dtype("bfloat16", True),
                jax.tree.map(lambda a: a.astype(jnp.float32), bf16))
    quantized = qz.quantize_params(params, name, config)
    same = qz.dequantize_params(quantized)
    prompt_dtype = {"int8_prompts": "int8", "bf16_prompts": "bfloat16"}.get(suffix, "auto")
    compute = cpu_layout.prompt_compute_dtype(name, not float_acts, prompt_dtype)
    return quantized, {"quantization": name, "cpu_int8_activations": not float_acts,
                       "cpu_prompt_dtype": prompt_dtype}, compute, same


def matmul_flops(config, tokens: int) -> float:
    """FLOP of a prompt's matmuls: the decoder's matrices over every token, the lm_head over one."""
    from jaxserve.models import weights
    linear = sum(math.prod(info.shape) for info in weights.weight_infos(config).values() if info.role == "linear")
    return 2.0 * tokens * linear + 2.0 * config.hidden_size * config.vocab_size


def hf_model_with(hf_model, params):
    """A copy of the transformers model with the decoder matrices and embedding of `params`."""
    import copy

    import torch

    model = copy.deepcopy(hf_model)
    with torch.no_grad():
        for name, module_path in HF_LINEAR.items():
            stack = np.asarray(params["layers"][name], np.float32)  # [L, in, out]
            for i, layer in enumerate(model.model.layers):
                layer.get_submodule(module_path).weight.copy_(torch.from_numpy(stack[i].T.copy()))
        model.model.embed_tokens.weight.copy_(torch.from_numpy(np.asarray(params["embed"], np.float32)))
    return model


def hf_prompt_scores(model, tokens):
    """(log-probability of each next token [T-1], argmax at each position [T-1]) in transformers."""
    import torch
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([tokens])).logits[0, :-1].float()
    logprobs = torch.log_softmax(logits, -1)
    return logprobs[torch.arange(len(tokens) - 1), torch.tensor(tokens[1:])].numpy(), logits.argmax(-1).numpy()


def engine_prompt_scores(engine, tokens):
    from jaxserve.core.request import SamplingParams
    result = engine.generate([tokens], SamplingParams(max_tokens=0, prompt_logprobs=1, temperature=0.0))[0]
    entries = result.prompt_logprobs
    return np.array([e.logprob for e in entries]), np.array([e.top[0][0] for e in entries])


def first_difference(a, b) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def compare_greedy(ours, theirs) -> dict:
    firsts = [first_difference(a, b) for a, b in zip(ours, theirs)]
    return dict(equal=sum(a == b for a, b in zip(ours, theirs)), of=len(ours),
                mean_first_difference=float(np.mean(firsts)))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--prompt_len", type=int, default=500)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--text_tokens", type=int, default=1000)
    parser.add_argument("--chat_prompts", type=int, default=8)
    parser.add_argument("--output_len", type=int, default=48)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if unknown := [m for m in modes if m not in MODES]:
        print(f"prompt_compute: unknown modes {unknown}; choose from {', '.join(MODES)}", file=sys.stderr)
        return 2

    import jax.numpy as jnp
    import torch

    from bench.hf_baseline import load_hf_model, torch_generate
    from checkpoints import default_model, load
    from jaxserve.core.request import SamplingParams
    from jaxserve.engine import Engine, EngineConfig
    from jaxserve.planning import probe

    model_dir = default_model.resolve_model(args.model) if args.model == "smollm2" else args.model
    config = load.load_config(model_dir)
    params = load.load_params(model_dir, jnp.float32)
    tokenizer = load.load_tokenizer(model_dir)
    info = common.machine_info(with_jax=True)
    info["torch"] = torch.__version__
    hf_float, _ = load_hf_model(model_dir)
    with open(os.path.join(sysconfig.get_paths()["stdlib"], "LICENSE.txt")) as f:
        text = tokenizer.encode(f.read())[:args.text_tokens]
    chats = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": c}], tokenize=False,
                                                            add_generation_prompt=True), add_special_tokens=False)
             for c in (CHAT * 4)[:args.chat_prompts]]
    rng = np.random.default_rng(args.seed)
    prompts = [rng.integers(100, config.vocab_size, args.prompt_len).tolist() for _ in range(args.repeats)]
    flops = matmul_flops(config, args.prompt_len)
    greedy = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)

    peaks, results, float_scores, float_greedy = {}, {}, None, None
    for mode in modes:
        engine_params, overrides, compute, same_weights = mode_weights(mode, params, config)
        if compute not in peaks:
            peaks[compute] = probe.matmul_rates(config.hidden_size, config.intermediate_size, args.prompt_len,
                                                compute)[1]
        engine = Engine(config, engine_params, None, EngineConfig(
            max_model_len=max(2048, args.text_tokens + 8), enable_prefix_caching=False, warmup=False, **overrides))
        start = time.perf_counter()
        engine.generate([prompts[0][:16]], SamplingParams(max_tokens=2, temperature=0.0))  # compiles
        ttfts, hf_ttft = [], []
        for prompt in prompts:  # interleaved with transformers: both share whatever load there is
            begin = time.perf_counter()
            engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
            ttfts.append(time.perf_counter() - begin)
            begin = time.perf_counter()
            with torch.inference_mode():
                hf_float(input_ids=torch.tensor([prompt]))
            hf_ttft.append(time.perf_counter() - begin)
        logprobs, argmax = engine_prompt_scores(engine, text)
        outputs = [r.token_ids for r in engine.generate(chats, greedy)]
        hf_same = hf_model_with(hf_float, same_weights)
        hf_logprobs, hf_argmax = hf_prompt_scores(hf_same, text)
        hf_outputs = [torch_generate(hf_same, [c], args.output_len, 0)[0] for c in chats]
        if mode == "float32":
            float_scores, float_greedy = (logprobs, argmax), outputs
        ttft, hf = float(np.median(ttfts)), float(np.median(hf_ttft))
        row = dict(mode=mode, compute_dtype=compute, ttft_ms=1e3 * ttft, ttft_ms_all=[1e3 * t for t in ttfts],
                   transformers_ttft_ms=1e3 * hf, ttft_vs_transformers=ttft / hf,
                   matmul_gflops=flops / ttft / 1e9, probe_peak_gflops=peaks[compute] / 1e9,
                   fraction_of_peak=flops / ttft / peaks[compute], perplexity=float(np.exp(-logprobs.mean())),
                   hf_same_weights_perplexity=float(np.exp(-hf_logprobs.mean())),
                   top1_vs_hf_same_weights=float(np.mean(argmax == hf_argmax)),
                   max_logprob_diff_vs_hf_same_weights=float(np.max(np.abs(logprobs - hf_logprobs))),
                   greedy_vs_hf_same_weights=compare_greedy(outputs, hf_outputs),
                   seconds=time.perf_counter() - start)
        if float_scores is not None:
            row.update(top1_vs_float32=float(np.mean(argmax == float_scores[1])),
                       greedy_vs_float32=compare_greedy(outputs, float_greedy))
        results[mode] = row
        print(f"{mode}: TTFT {row['ttft_ms']:.0f} ms, ppl {row['perplexity']:.3f} (load {common.load_average()})",
              file=sys.stderr)
        del engine, hf_same
    info["load_average_end"] = common.load_average()

    print(common.machine_line(info))
    print(f"{args.prompt_len}-token prompts ({flops / 1e9:.0f} GFLOP of matmuls), {args.repeats} each, medians; "
          f"TTFT / tf: against transformers float32 on the same prompts, run beside each mode")
    table = [dict(r, greedy_f32=(f"{r['greedy_vs_float32']['equal']}/{r['greedy_vs_float32']['of']}"
                                 if "greedy_vs_float32" in r else "-"),
                  greedy_hf=f"{r['greedy_vs_hf_same_weights']['equal']}/{r['greedy_vs_hf_same_weights']['of']}",
                  top1_f32=r.get("top1_vs_float32", float("nan"))) for r in results.values()]
    print(common.format_table(table, [
        ("mode", "mode", "s"), ("compute_dtype", "compute", "s"), ("ttft_ms", "TTFT ms", ".0f"),
        ("transformers_ttft_ms", "tf TTFT ms", ".0f"), ("ttft_vs_transformers", "TTFT / tf", ".2f"), ("matmul_gflops", "GFLOP/s", ".0f"),
        ("probe_peak_gflops", "peak GFLOP/s", ".0f"), ("fraction_of_peak", "of peak", ".2f"),
        ("perplexity", "ppl", ".3f"), ("hf_same_weights_perplexity", "ppl tf same w", ".3f"),
        ("top1_f32", "top1 = f32", ".3f"), ("top1_vs_hf_same_weights", "top1 = tf same w", ".3f"),
        ("greedy_f32", "greedy = f32", "s"), ("greedy_hf", "greedy = tf same w", "s")]))
    common.write_json(args.out, dict(machine=info, args=vars(args), results=results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
