"""Greedy tokens of one random bfloat16 model through every attention backend, each compared with a
reference computed independently of it (bench/gpu_check.sh's `agreement` step).

    python3 bench/gpu_agreement.py --out=agreement.json            # on the GPU: Llama-3-8B's layers, 2 of them
    python3 bench/gpu_agreement.py --out=agreement.json --small    # anywhere: a tiny Llama (head_dim 64)

The model: Llama-3-8B's layer shapes (hidden 4096, 32 query heads over 8 KV heads, head_dim 128,
vocabulary 128256) with 2 layers, random bfloat16 weights and non-trivial norm weights (a norm
mapped wrongly shows). The jaxserve engines: the XLA path, the Triton kernels and the Mosaic GPU
kernels (where jax has them; on a CPU their interpreters), one engine at a time (released and
collected before the next), each with a KV pool sized to the prompts (`num_pages`), not to the
device. The references: transformers' LlamaForCausalLM in float32 on the same weights (torch, on
the GPU when torch sees one): an implementation independent of jaxserve, against which every
engine is compared; and the XLA path, against which both kernel families are compared. Each
comparison stops at the reference's first near-tie (bench/gpu_check_report.compare_greedy) and
reports how many positions it compared; the chosen tokens' logprobs there must agree within the
same bound (a larger difference is "differ" even when the tokens agree). Without torch the
comparisons with transformers are "unknown", never "ok".
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib.util
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jaxserve import platforms  # noqa: E402

platforms.default_to_cpu_without_gpu()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from bench.gpu_check_report import (  # noqa: E402
    NEAR_TIE_NATS, StepReport, compare_greedy, require_gpu, top2_gap,
)
from jaxserve.config import ModelConfig  # noqa: E402
from jaxserve.core.request import SamplingParams  # noqa: E402
from jaxserve.engine import Engine, EngineConfig  # noqa: E402
from jaxserve.models import weights  # noqa: E402
from pallas_kernels import compat  # noqa: E402

LLAMA3_8B_LAYERS = ModelConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=2,
                               num_q_heads=32, num_kv_heads=8, head_dim=128, rope_theta=500000.0,
                               max_position_embeddings=8192)
TINY = ModelConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2, num_q_heads=4,
                   num_kv_heads=2, head_dim=64, max_position_embeddings=1024)
# Prompt lengths and new tokens: several pages, prefilled in chunks beside decode rows.
FULL = dict(model=LLAMA3_8B_LAYERS, prompt_lengths=(7, 300, 1500, 64, 33, 700, 16, 129), max_tokens=16,
            batched_tokens=512, max_model_len=2048)
SMALL = dict(model=TINY, prompt_lengths=(5, 40, 90, 17, 63, 30), max_tokens=8, batched_tokens=64, max_model_len=128)
PAGE_SIZE = 16


def model_params(config: ModelConfig, seed: int = 1) -> dict:
    """Random bfloat16 weights, the norms' drawn around 1 (not all ones)."""
    params = weights.random_params(config, dtype=jnp.bfloat16, seed=seed)
    key = jax.random.key(seed + 1)
    for info in weights.weight_infos(config).values():
        if info.role == "norm":
            key, sub = jax.random.split(key)
            node = params["layers"] if info.per_layer else params
            node[info.name] = (1.0 + 0.1 * jax.random.normal(sub, info.shape, jnp.float32)).astype(jnp.bfloat16)
    return params


def engine_backends() -> dict[str, str]:
    """{family: attention backend}: the XLA path first (the kernels' reference), then the kernels,
    compiled on a GPU and interpreted elsewhere."""
    on_gpu = jax.default_backend() == "gpu"
    backends = {"xla": "xla", "triton": "pallas" if on_gpu else "interpret"}
    if compat.has_mosaic_gpu():
        backends["mosaic"] = "mosaic" if on_gpu else "mosaic_interpret"
    return backends


def run_engine(config, params, backend: str, prompts, size: dict) -> dict:
    """Greedy tokens, top-2 gaps and chosen logprobs of every prompt through one engine, which is
    released (and collected) before this returns."""
    pages = len(prompts) * -(-(max(map(len, prompts)) + size["max_tokens"]) // PAGE_SIZE) + 1
    engine = Engine(config, params, None, EngineConfig(
        attention_backend=backend, dtype="bfloat16", page_size=PAGE_SIZE, num_pages=pages,
        max_num_seqs=len(prompts), max_num_batched_tokens=size["batched_tokens"],
        max_model_len=size["max_model_len"], warmup=False), model_name=f"agreement-{backend}")
    try:
        results = engine.generate(prompts, SamplingParams(max_tokens=size["max_tokens"], temperature=0.0,
                                                          ignore_eos=True, logprobs=2))
        return {"backend": engine.runner.backend, "num_pages": pages,
                "tokens": [list(r.token_ids) for r in results],
                "gaps": [[top2_gap(dict(p.top)) for p in r.logprobs] for r in results],
                "logprobs": [[p.logprob for p in r.logprobs] for r in results]}
    finally:
        del engine
        gc.collect()


def hf_state_dict(config: ModelConfig, params: dict, torch) -> dict:
    """transformers' tensors of `params` (float32), named and laid out as its checkpoints are."""
    state = {}
    for info in weights.weight_infos(config).values():
        array = params["layers"][info.name] if info.per_layer else params[info.name]
        tensor = torch.from_numpy(np.array(array.astype(jnp.float32)))
        if not info.per_layer:
            state[info.hf] = tensor.T if info.transposed else tensor
            continue
        for layer in range(config.num_layers):
            row = tensor[info.row_of(layer)]
            state[f"model.layers.{layer}.{info.hf}"] = row.T if info.transposed else row
    return state


def run_transformers(config: ModelConfig, params: dict, prompts, max_tokens: int) -> dict:
    """Greedy tokens, top-2 logit gaps and chosen logprobs from transformers' Llama in float32 on
    the same weights (on the GPU when torch sees one); the model is freed before this returns."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.set_float32_matmul_precision("highest")  # float32 matmuls in float32, not TF32, on the GPU
    hf_config = LlamaConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers, num_attention_heads=config.num_q_heads,
        num_key_value_heads=config.num_kv_heads, head_dim=config.head_dim,
        max_position_embeddings=config.max_position_embeddings, rms_norm_eps=config.rms_norm_eps,
        rope_theta=config.rope_theta, tie_word_embeddings=False, torch_dtype="float32")
    with torch.device(device):  # built where it runs: its random initialisation is overwritten at once
        model = LlamaForCausalLM(hf_config).eval()
    missing, unexpected = model.load_state_dict(hf_state_dict(config, params, torch), strict=False)
    if [m for m in missing if "rotary" not in m] or unexpected:
        raise ValueError(f"transformers' weights: missing {missing}, unexpected {unexpected}")
    out = {"device": device, "tokens": [], "gaps": [], "logprobs": []}
    with torch.no_grad():
        for prompt in prompts:
            ids, gaps, logprobs = list(prompt), [], []
            for _ in range(max_tokens):  # the whole sequence each step: no cache API to depend on
                logits = model(input_ids=torch.tensor([ids], device=device), logits_to_keep=1).logits[0, -1].float()
                top = torch.topk(logits, 2)
                token = int(top.indices[0])
                ids.append(token)
                gaps.append(float(top.values[0] - top.values[1]))
                logprobs.append(float(torch.log_softmax(logits, -1)[token]))
            out["tokens"].append(ids[len(prompt):])
            out["gaps"].append(gaps)
            out["logprobs"].append(logprobs)
    del model
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return out


def compare(candidate: dict | None, reference: dict | None, missing: str) -> dict:
    """compare_greedy of two runs, with the largest |logprob difference| of the chosen tokens at
    the positions compared; "unknown" (with `missing`) when either run is absent."""
    if candidate is None or reference is None:
        return {"status": "unknown", "reason": missing}
    result = compare_greedy(candidate["tokens"], reference["tokens"], reference["gaps"])
    diffs = [abs(a - b) for seq, cand, ref in zip(result.get("sequences", []), candidate["logprobs"],
                                                  reference["logprobs"])
             for a, b in zip(cand[:seq["compared"]], ref[:seq["compared"]])]
    result["max_logprob_diff"] = max(diffs) if diffs else None
    if result["status"] == "ok" and result["max_logprob_diff"] > result["bound_nats"]:
        result.update(status="differ", reason="the chosen tokens' logprobs differ by more than the near-tie bound")
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="the JSON report (written after every run)")
    parser.add_argument("--small", action="store_true", help="a tiny Llama: the same code path anywhere")
    args = parser.parse_args(argv)
    require_gpu()
    size = SMALL if args.small else FULL
    config = size["model"]
    report = StepReport(args.out, device=jax.devices()[0].device_kind, jax=jax.__version__,
                        model=f"{'tiny' if args.small else 'llama-3-8b layers x2'} random bf16",
                        near_tie_bound_nats=NEAR_TIE_NATS, prompt_lengths=list(size["prompt_lengths"]),
                        max_tokens=size["max_tokens"], runs={})
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, config.vocab_size, n).tolist() for n in size["prompt_lengths"]]
    params = model_params(config)
    for family, backend in engine_backends().items():
        with report.guard(f"engine/{family}"):
            report["runs"][family] = run_engine(config, params, backend, prompts, size)
            report.write()
    runs = report["runs"]
    if importlib.util.find_spec("torch") is None:
        hf, missing = None, "no torch here: transformers' reference not run"
    else:
        hf, missing = None, "transformers' reference failed (see its check)"
        with report.guard("transformers"):
            hf = report.put("transformers", run_transformers(config, params, prompts, size["max_tokens"]))
    for family in engine_backends():
        absent = f"the {family} engine failed (see its check)"
        report.check(f"{family}_vs_transformers",
                     **compare(runs.get(family), hf, missing if family in runs else absent))
        if family != "xla":
            report.check(f"{family}_vs_xla", **compare(runs.get(family), runs.get("xla"),
                                                       "an engine failed (see its check)"))
    for family, run in runs.items():  # the engines ran: their checks say so (a failed one is already recorded)
        report.check(f"engine/{family}", "ok", backend=run["backend"])
    for name, check in report["checks"].items():
        print(f"{name:<26}{check['status']:>8}  compared {check.get('compared_positions', '-')}, "
              f"max logprob diff {check.get('max_logprob_diff', '-')} {check.get('reason', '')}")
    return report.exit_status()


if __name__ == "__main__":
    sys.exit(main())
