"""Published-style quantized checkpoints of SmolLM2 next to float and the GGUF Q4_1 path: size and
tokens/s on this machine.

SmolLM2 is available offline only as the Q4_1 GGUF, so its float conversion (float32) is written
out as a Hugging Face folder, cast to bfloat16 (as published checkpoints are) and quantized with
compressed-tensors the way llm-compressor's QuantizationModifier does (min-max, round to
nearest): W8A16 (int8 per output channel) and W4A16 (int4, symmetric, groups of 64: SmolLM2's
hidden size 576 has no groups of 128, the preset's), saved compressed (pack-quantized).
`jaxserve convert` reads each as stored. Needs the test extra (torch, compressed-tensors). Variants:

  float      the GGUF converted to float32 (the reference jaxserve serves by default)
  q4_1       the GGUF converted with --quantization=int4 (its Q4_1 blocks copied: int4_g32)
  w8a16      the compressed-tensors W8A16 folder  -> int8_bf16
  w4a16      the compressed-tensors W4A16 folder  -> int4_g64_sym_bf16

Each runs bench/quantized.py's workload (random-token prompts, greedy, ignore_eos) through
`Engine.generate`: a warm pass compiles, then `--repeats` timed passes; the report gives the
median (and the spread) of output tokens/s and of the decode-step time, the weights' bytes in
memory and the checkpoint's bytes on disk.

  python bench/published_quant.py --out bench/out/published_quant.json
  python bench/published_quant.py --num_prompts=2 --output_len=4 --repeats=1 --variants=float,w4a16   # smoke
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import common  # noqa: E402
from bench.quantized import record_steps, workload  # noqa: E402

VARIANTS = ("float", "q4_1", "w8a16", "w4a16")
SCHEMES = {"w8a16": dict(bits=8, group=None), "w4a16": dict(bits=4, group=64)}  # 576 inputs: no groups of 128


def dir_bytes(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files)


def write_hf_folder(params: dict, config, path: str) -> None:
    """A float Hugging Face folder (config.json + model.safetensors) of jaxserve parameters."""
    from safetensors.numpy import save_file

    from jaxserve.models import weights
    tensors = {}
    for info in weights.weight_infos(config).values():
        node = params["layers"] if info.per_layer else params
        value = np.asarray(node[info.name], np.float32)
        if info.per_layer:
            for layer in range(config.num_layers):
                tensors[f"model.layers.{layer}.{info.hf}"] = np.ascontiguousarray(
                    value[layer].T if info.transposed else value[layer])
        else:
            tensors[info.hf] = np.ascontiguousarray(value.T if info.transposed else value)
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({**config.to_hf_dict(), "torch_dtype": "float32"}, f)


def prepare(variant: str, work: str) -> tuple[str, str]:
    """(source path, converted model directory) of a variant."""
    import torch
    from transformers import LlamaForCausalLM

    from checkpoints import default_model, load
    from checkpoints.convert import convert_checkpoint
    from tests.published_checkpoints import quantize_compressed_tensors

    gguf = default_model.smollm2_gguf_path()
    if variant == "float":
        return gguf, default_model.resolve_model("smollm2")
    out = os.path.join(work, variant)
    if variant == "q4_1":
        convert_checkpoint(gguf, out, quantization="int4")
        return gguf, out
    float_hf = os.path.join(work, "float_hf")
    if not os.path.exists(float_hf):
        source = load.ModelSource.open(default_model.resolve_model("smollm2"))
        write_hf_folder(source.load_params("float32"), source.config, float_hf)
    model = LlamaForCausalLM.from_pretrained(float_hf, torch_dtype=torch.float32).to(torch.bfloat16)
    published = os.path.join(work, f"{variant}_published")
    quantize_compressed_tensors(model, published, **SCHEMES[variant])
    convert_checkpoint(published, out)
    return published, out


def run(variant: str, source_path: str, model_dir: str, args) -> dict:
    import jax.numpy as jnp

    from checkpoints import load
    from jaxserve.core.request import SamplingParams
    from jaxserve.engine import Engine, EngineConfig
    from jaxserve.models import quantization
    from jaxserve.models import weights

    source = load.ModelSource.open(model_dir)
    params = source.load_params(jnp.float32)
    config = source.config
    cfg = EngineConfig(max_num_seqs=args.num_prompts, max_num_batched_tokens=args.max_num_batched_tokens,
                       max_num_prefill_seqs=1, max_model_len=args.input_len + args.output_len + 16,
                       warmup=False, enable_prefix_caching=False)
    engine = Engine(config, params, None, cfg)
    prompts = workload(args.num_prompts, args.input_len, config.vocab_size, args.seed)
    engine.generate(prompts, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))  # compiles
    steps = record_steps(engine)
    rates, step_ms = [], []
    for _ in range(args.repeats):
        steps.clear()
        start = time.perf_counter()
        results = engine.generate(prompts, SamplingParams(max_tokens=args.output_len, temperature=0.0,
                                                          ignore_eos=True))
        elapsed = time.perf_counter() - start
        rates.append(sum(len(r.token_ids) for r in results) / elapsed)
        decode = [s for rows, prefill, s in steps if prefill == 0]
        step_ms.append(1000 * statistics.median(decode))
    layers = engine.runner.params["layers"]
    row = {
        "variant": variant, "formats": sorted(set(quantization.params_formats(engine.runner.params).values())),
        "source_bytes": dir_bytes(source_path), "converted_bytes": dir_bytes(os.path.join(model_dir, "params")),
        "weights_bytes": engine.stats().weights_bytes,
        "linear_bytes": quantization.tree_bytes({k: layers[k] for k in weights.linear_leaves(config)}),
        "output_tok_s_median": statistics.median(rates), "output_tok_s_all": rates,
        "decode_step_ms_median": statistics.median(step_ms), "decode_step_ms_all": step_ms,
        "first_answer": results[0].token_ids[:8],
    }
    print(f"{variant}: {row['output_tok_s_median']:.1f} output tok/s (median of {rates}), "
          f"weights {row['weights_bytes'] / 2**20:.1f} MiB", file=sys.stderr, flush=True)
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of {', '.join(VARIANTS)}")
    parser.add_argument("--num_prompts", type=int, default=16)
    parser.add_argument("--input_len", type=int, default=64)
    parser.add_argument("--output_len", type=int, default=64)
    parser.add_argument("--max_num_batched_tokens", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=5, help="timed passes per variant (median reported)")
    parser.add_argument("--out", default=None, help="JSON report path")
    args = parser.parse_args(argv)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if not variants or any(v not in VARIANTS for v in variants):
        print(f"published_quant.py: choose variants from {', '.join(VARIANTS)}", file=sys.stderr)
        return 2
    rows = []
    with tempfile.TemporaryDirectory(prefix="published_quant-") as work:
        for variant in variants:
            source_path, model_dir = prepare(variant, work)
            rows.append(run(variant, source_path, model_dir, args))
    report = {"machine": common.machine_info(with_jax=True), "load_average_at_start": os.getloadavg(),
              "args": vars(args), "rows": rows}
    text = json.dumps(report, indent=2)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
