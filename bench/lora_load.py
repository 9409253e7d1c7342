"""A LoRA adapter loaded at run time: from the load call to its first streamed token, through a
running `jaxserve serve` (issue 50's target: within 1 s of the load call).

Starts `jaxserve serve` on the default model (SmolLM2-135M) with --enable_lora and run-time
updates on, waits for /health, then `--repeats` times: writes a fresh random PEFT adapter of rank
`--rank` on all seven projections (safetensors, as peft saves one), POSTs /v1/load_lora_adapter,
and at once streams a completion that names it; reports the seconds from the load call to its
200, to the first token, and the whole, with medians and the worst. Between repeats the adapter is
unloaded, so every load reads a new folder and every first request writes a slab slot. A base
request's first token is timed the same way beside them (no load) for comparison. The repeats
start once the background warm-up has compiled every shape (`--during_warmup`: right after
/health 200, when a step may wait for a shape and a load call waits for that step).

  python bench/lora_load.py --out bench/out/lora_load.json
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

MODULES = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def adapter_tensors(config, rank: int, seed: int) -> dict[str, np.ndarray]:
    """A random PEFT LoRA adapter of `rank` on every projection of every layer of `config`'s model,
    as peft names its tensors (float32, drawn as such: 42 M values at Llama-3-8B's shape)."""
    from checkpoints import lora_adapter
    shapes = lora_adapter.weight_shapes(config)
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(config.num_layers):
        for module, parent in MODULES.items():
            d_in, d_out = shapes[lora_adapter.PROJECTIONS[module][0]]
            prefix = f"base_model.model.model.layers.{layer}.{parent}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = 0.01 * rng.standard_normal((rank, d_in), np.float32)
            tensors[f"{prefix}.lora_B.weight"] = 0.01 * rng.standard_normal((d_out, rank), np.float32)
    return tensors


def save_adapter(folder: str, tensors: dict[str, np.ndarray], rank: int) -> int:
    """The adapter's folder as peft saves one; returns its weights' bytes."""
    from safetensors.numpy import save_file

    from checkpoints import lora_adapter
    os.makedirs(folder, exist_ok=True)
    save_file(tensors, os.path.join(folder, lora_adapter.WEIGHTS_FILE))
    with open(os.path.join(folder, lora_adapter.CONFIG_FILE), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(MODULES),
                   "bias": "none"}, f)
    return os.path.getsize(os.path.join(folder, lora_adapter.WEIGHTS_FILE))


def write_adapter(folder: str, config, rank: int, seed: int) -> None:
    """A random adapter (adapter_tensors) saved in `folder`."""
    save_adapter(folder, adapter_tensors(config, rank, seed), rank)


def first_token_seconds(url: str, model: str | None, start: float) -> tuple[float, float]:
    """(seconds from `start` to the first streamed token, to the end) of a 16-token completion of
    `model` (None: the base model)."""
    import requests
    first = None
    body = {"prompt": "The capital of France is", "max_tokens": 16, "temperature": 0, "stream": True,
            **({"model": model} if model else {})}
    with requests.post(url + "/v1/completions", json=body, stream=True, timeout=120) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith(b"data: {") and first is None:
                first = time.perf_counter() - start
    return first, time.perf_counter() - start


def wait_for_warmup(url: str, timeout_s: float = 1800) -> None:
    """Until /health says the warm-up compiled every shape."""
    import requests
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        warmup = requests.get(url + "/health", timeout=10).json().get("warmup")
        if warmup is None or warmup["compiled"] == warmup["total"]:
            return
        time.sleep(1)
    raise RuntimeError(f"the warm-up did not end within {timeout_s:.0f}s")


def main() -> int:
    import requests

    from checkpoints import default_model, load
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--during_warmup", action="store_true", help="start right after /health 200")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    model_dir = default_model.resolve_model("smollm2")
    config = load.load_config(model_dir)
    rows = []
    flags = ["--enable_lora", "--max_loras=4", f"--max_lora_rank={args.rank}", "--allow_runtime_lora_updating"]
    with common.ServerProcess(model_dir, flags, wait_for_warmup=False) as server, \
            tempfile.TemporaryDirectory() as folder:  # (ready when it answers: the warm-up is waited for below)
        url = server.url
        if not args.during_warmup:
            wait_for_warmup(url)
        first_token_seconds(url, None, time.perf_counter())  # a first request off the clock
        for i in range(args.repeats):
            path = os.path.join(folder, f"adapter{i}")
            write_adapter(path, config, args.rank, seed=i)
            start = time.perf_counter()
            response = requests.post(url + "/v1/load_lora_adapter", json={"lora_name": f"a{i}", "lora_path": path},
                                     timeout=60)
            response.raise_for_status()
            loaded = time.perf_counter() - start
            first, whole = first_token_seconds(url, f"a{i}", start)
            base_first, _ = first_token_seconds(url, None, time.perf_counter())
            rows.append({"load_s": loaded, "first_token_s": first, "whole_s": whole,
                         "base_first_token_s": base_first})
            requests.post(url + "/v1/unload_lora_adapter", json={"lora_name": f"a{i}"}, timeout=60).raise_for_status()
        ready = server.start_seconds
    summary = {key: {"median": statistics.median(r[key] for r in rows), "max": max(r[key] for r in rows)}
               for key in rows[0]}
    report = {"machine": common.machine_line(common.machine_info()), "load_average": common.load_average(),
              "rank": args.rank, "ready_s": ready, "during_warmup": args.during_warmup, "repeats": rows,
              "summary": summary}
    print(json.dumps(summary, indent=1))
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
