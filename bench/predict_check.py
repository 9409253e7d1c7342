"""`plan --predict` against measured decode steps on this machine.

Probes the machine's ceilings (jaxserve.planning.probe, as `plan --predict` does without flags),
starts the engine on the model, prefills `--max_batch` requests of `--prompt_len` random tokens
(seeded, no prefix sharing), then decodes at each batch size from the largest down (aborting
requests in between, so one prefill serves every size) and compares the roofline's TPOT at the
steps' mean context with the measured decode steps' device time (and whole step time), from
`engine.step_records`. The first `--skip` steps of each size are left out (they compile).

  python bench/predict_check.py --batch_sizes=1,8,32 --quantization=int8
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import common  # noqa: E402
from jaxserve.config import EngineConfig  # noqa: E402
from jaxserve.core.request import SamplingParams  # noqa: E402
from jaxserve.engine import Engine  # noqa: E402
from jaxserve.executor.step_pricing import StepPricer  # noqa: E402
from jaxserve.planning import predict, probe  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--quantization", default=None)
    parser.add_argument("--batch_sizes", default="1,8,32")
    parser.add_argument("--prompt_len", type=int, default=500)
    parser.add_argument("--steps", type=int, default=8, help="decode steps measured per batch size")
    parser.add_argument("--skip", type=int, default=2, help="decode steps left out first at each size")
    parser.add_argument("--json", default=None, help="also write the table here")
    args = parser.parse_args()
    sizes = sorted({int(s) for s in args.batch_sizes.split(",")}, reverse=True)
    cfg = EngineConfig(max_num_seqs=sizes[0], max_num_batched_tokens=512, max_model_len=args.prompt_len + 256,
                       quantization=args.quantization, warmup=False)
    engine = Engine.from_model(args.model, cfg)
    model = engine.model_config
    bandwidth, peak, operators = probe.probe(model, sizes, args.prompt_len + (args.skip + args.steps) // 2,
                                             cfg.page_size)
    ceilings = predict.Ceilings(bandwidth, peak, None, "cpu probe", tuple(operators))
    costs = StepPricer.for_engine(engine).costs
    rng = np.random.default_rng(0)
    greedy = SamplingParams(max_tokens=250, temperature=0.0, ignore_eos=True)
    ids = [f"r{i}" for i in range(sizes[0])]
    for request_id in ids:
        engine.add_request(request_id, rng.integers(100, model.vocab_size, args.prompt_len).tolist(), greedy)
    while any(r.kind != "decode" for r in list(engine.step_records)[-1:]) or not engine.step_records:
        engine.step()  # the prefill chunks, up to the first pure decode step
    rows = []
    for size in sizes:
        for request_id in ids[size:]:
            engine.abort(request_id)
        ids = ids[:size]
        start = len(engine.step_records)
        for _ in range(args.skip + args.steps):
            engine.step()
        steps = [r for r in list(engine.step_records)[start + args.skip:] if r.kind == "decode"]
        context = round(statistics.mean(r.num_attention_pairs / r.num_decode_rows for r in steps)) - 1
        seconds, bound = costs.decode(size, context).seconds_and_bound(ceilings)
        device = statistics.median(r.device_seconds for r in steps)
        whole = statistics.median(r.seconds for r in steps)
        fastest = min(r.device_seconds for r in steps)
        rows.append({"batch_size": size, "context_len": context, "predicted_ms": seconds * 1e3, "bound": bound,
                     "device_ms": device * 1e3, "device_min_ms": fastest * 1e3, "step_ms": whole * 1e3, "device_over_predicted": device / seconds,
                     "step_over_predicted": whole / seconds, "steps": len(steps)})
    print(f"{args.model} {args.quantization or 'float32'}; ceilings (probe): {bandwidth / 1e9:.1f} GB/s, "
          f"{peak / 1e9:.1f} GFLOP/s; load average {common.load_average()}")
    for o in operators:
        print(f"  at {o.rows} rows: matmul {o.matmul_bandwidth / 1e9:.1f} GB/s, {o.matmul_flops / 1e9:.1f} GFLOP/s; "
              f"decode attention {o.attention_bandwidth / 1e9:.1f} GB/s")
    print(f"{'batch':>5} {'context':>7} {'predicted ms':>12} {'bound':>10} {'device ms':>9} {'min ms':>7} "
          f"{'step ms':>8} {'device/pred':>11} {'min/pred':>8} {'step/pred':>9}")
    for r in rows:
        print(f"{r['batch_size']:>5} {r['context_len']:>7} {r['predicted_ms']:>12.2f} {r['bound']:>10} "
              f"{r['device_ms']:>9.2f} {r['device_min_ms']:>7.2f} {r['step_ms']:>8.2f} "
              f"{r['device_over_predicted']:>11.2f} {r['device_min_ms'] / r['predicted_ms']:>8.2f} "
              f"{r['step_over_predicted']:>9.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ceilings": ceilings.to_dict(), "rows": rows, "quantization": args.quantization}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
