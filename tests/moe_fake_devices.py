"""What tests/test_moe_sharding.py and tests/test_moe_expert_parallel.py share: one prefill step of
a mixture-of-experts model through llama.forward on fake CPU devices, and the subprocess (started
with --xla_force_host_platform_device_count before jax is imported) that runs a test module's
`_worker` and hands its JSON back."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np

from jaxserve.parallel import sharding
from tests.test_sharding import FAKE_DEVICES_ENV, REPO


def prefill_logits(config, params, tp: int, *, expert_parallel: bool = False,
                   layout_names=("w_gate_exps", "w_down_exps", "router")):
    """One prefill step of three prompts on `tp` devices (one device for tp 1), experts split on
    their intermediate size or, with `expert_parallel`, spread whole -> (logits [T, V] as lists,
    {weight name: its per-device shapes (a quantized weight's: of its codes)} for the names the layers
    have, and "per_device_bytes")."""
    import jax
    import jax.numpy as jnp

    from jaxserve.models import llama
    from tests.tiny_models import prefill_batch
    batch, _, num_pages = prefill_batch([7, 12, 3], 4, 4, config.vocab_size, np.random.default_rng(5))
    batch = {k: jnp.asarray(v) for k, v in batch.items()}
    mesh = sharding.make_mesh(config, tp, expert_parallel=expert_parallel) if tp > 1 else None
    shardings = sharding.ModelShardings.create(config, mesh, expert_parallel=expert_parallel) if mesh else None
    run_config = shardings.model_config if shardings else config
    kv = llama.init_kv_cache(run_config, llama.KVCacheSpec(num_pages=num_pages, page_size=4), jnp.float32,
                             shardings.kv_cache if shardings else None)
    placed = shardings.place(params) if shardings else params
    step = jax.jit(lambda p, k, b: llama.forward(p, k, b, config=run_config, mesh=mesh)[0])
    layout = {}
    if shardings:
        layout = {name: sorted({tuple(s.data.shape) for s in jax.tree.leaves(placed["layers"][name])[0].addressable_shards})
                  for name in layout_names if name in placed["layers"]}
        layout["per_device_bytes"] = shardings.per_device_bytes(params)
    return np.asarray(step(placed, kv, batch)).tolist(), layout


def worker_results(module: str) -> dict:
    """Runs `module`'s `_worker()` on fake devices in a subprocess; the JSON it printed last."""
    code = f"from {module} import _worker; _worker()"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**os.environ, **FAKE_DEVICES_ENV})
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
