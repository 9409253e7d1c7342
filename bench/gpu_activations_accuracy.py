"""What 8-bit activations for prompt chunks (--gpu_prompt_dtype=int8 / fp8, issue 54) cost in
accuracy, on the real model, measured here on the CPU through the same XLA computation the GPU
step runs (jaxserve.models.prompt_matmul.quantized_activations_linear; the CPU kernels off so
that nothing else takes the rows: --cpu_int8_activations=false).

Modes: int8 and fp8 weights (--quantization=int8 / fp8, per output channel) with the prompt's
activations in float32 (the weights dequantized: the reference for the mode's weights) and
quantized to 8 bits per row. For each, as bench/prompt_compute.py measures: on a held-out English
text (CPython's license, `--text_tokens` tokens: one prompt of several chunks, its logprobs) the
perplexity and the share of positions whose most likely next token equals the float32 model's
and the same weights' with float activations; on `--chat_prompts` chat prompts, greedy completions
of `--output_len` tokens (their prompts are chunks of more than 64 rows too): how many equal the
same weights' completions. Speed is not measured here (the CPU converts float8 for its dots); the
GPU check's kernels step times the matmuls (bench/kernel_speed.py, prompt_matmul).

  python bench/gpu_activations_accuracy.py --out=bench/out/gpu_activations_accuracy.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import sysconfig

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import common  # noqa: E402
from bench.prompt_compute import CHAT, compare_greedy, engine_prompt_scores  # noqa: E402

MODES = ("float32", "int8", "int8+int8_activations", "fp8", "fp8+fp8_activations")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--text_tokens", type=int, default=1000)
    parser.add_argument("--chat_prompts", type=int, default=8)
    parser.add_argument("--output_len", type=int, default=48)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)

    import jax.numpy as jnp

    from checkpoints import default_model, load
    from jaxserve.core.request import SamplingParams
    from jaxserve.engine import Engine, EngineConfig

    model_dir = default_model.resolve_model(args.model) if args.model == "smollm2" else args.model
    config = load.load_config(model_dir)
    params = load.load_params(model_dir, jnp.float32)
    tokenizer = load.load_tokenizer(model_dir)
    info = common.machine_info(with_jax=True)
    with open(os.path.join(sysconfig.get_paths()["stdlib"], "LICENSE.txt")) as f:
        text = tokenizer.encode(f.read())[:args.text_tokens]
    chats = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": c}], tokenize=False,
                                                            add_generation_prompt=True), add_special_tokens=False)
             for c in (CHAT * 4)[:args.chat_prompts]]
    greedy = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)

    results, scores, completions = {}, {}, {}
    for mode in MODES:
        weights, _, activations = mode.partition("+")
        overrides = {} if weights == "float32" else {"quantization": weights, "cpu_int8_activations": False}
        if activations:
            overrides["gpu_prompt_dtype"] = activations.split("_")[0]
        engine = Engine(config, params, None, EngineConfig(
            max_model_len=max(2048, args.text_tokens + 8), enable_prefix_caching=False, warmup=False, **overrides))
        logprobs, argmax = engine_prompt_scores(engine, text)
        scores[mode], completions[mode] = (logprobs, argmax), [r.token_ids for r in engine.generate(chats, greedy)]
        row = dict(mode=mode, flags=overrides, perplexity=float(np.exp(-logprobs.mean())),
                   top1_vs_float32=float(np.mean(argmax == scores["float32"][1])),
                   greedy_vs_float32=compare_greedy(completions[mode], completions["float32"]))
        if activations:  # against the same weights with float activations
            same = scores[weights]
            row.update(top1_vs_same_weights=float(np.mean(argmax == same[1])),
                       max_logprob_diff_vs_same_weights=float(np.max(np.abs(logprobs - same[0]))),
                       greedy_vs_same_weights=compare_greedy(completions[mode], completions[weights]))
        results[mode] = row
        print(f"{mode}: ppl {row['perplexity']:.3f} (load {common.load_average()})", file=sys.stderr)
        del engine

    print(common.machine_line(info))
    print("| mode | perplexity | top1 = f32 | top1 = same weights | greedy = f32 | greedy = same weights |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for row in results.values():
        same = row.get("greedy_vs_same_weights")
        print(f"| {row['mode']} | {row['perplexity']:.3f} | {row['top1_vs_float32']:.3f} | "
              f"{row.get('top1_vs_same_weights', float('nan')):.3f} | "
              f"{row['greedy_vs_float32']['equal']}/{row['greedy_vs_float32']['of']} | "
              f"{'' if same is None else str(same['equal']) + '/' + str(same['of'])} |")
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"machine": info, "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
