"""How long decoding streams wait for their next token while a long prompt is prefilled beside them,
for each --long_prefill_token_threshold (EngineConfig.long_prefill_token_threshold), and what that
prompt's time to first token costs.

`--streams` requests decode (greedy, EOS ignored) on an engine with default flags; after their
decode-only steps are timed, one `--long_prompt`-token prompt arrives. Reported per threshold: the
decode-only step (median), the decoding streams' gaps between tokens while the long prompt is
prefilled (median and max, and max as a multiple of the decode-only step), and the long prompt's
TTFT. Warm-up compiles every shape first, as `serve` does, so no gap includes a compile.

  python bench/prefill_interference.py --thresholds=none,256,128,64 --out=bench/out/prefill_interference.json
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import common  # noqa: E402


def measure(engine, prompts, long_prompt, decode_steps: int) -> dict:
    """One run: the decode-only step, the gaps of the decoding streams beside the long prefill, its TTFT."""
    from jaxserve.core.request import SamplingParams

    params = SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True)  # more than the run takes
    for i, prompt in enumerate(prompts):
        engine.add_request(f"stream-{i}", prompt, params)
    while any(r.num_output_tokens == 0 for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    decode_only = []
    for _ in range(decode_steps):
        start = time.perf_counter()
        engine.step()
        decode_only.append(time.perf_counter() - start)
    arrival = time.perf_counter()
    engine.add_request("long", long_prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    gaps, ttft = [], None
    while ttft is None:
        start = time.perf_counter()
        outputs = engine.step()
        now = time.perf_counter()
        if any(o.request_id.startswith("stream-") and o.new_token_ids for o in outputs):
            gaps.append(now - start)
        if any(o.request_id == "long" and o.new_token_ids for o in outputs):
            ttft = now - arrival
    for request_id in [f"stream-{i}" for i in range(len(prompts))]:
        engine.abort(request_id)
    while engine.has_unfinished():
        engine.step()
    step = statistics.median(decode_only)
    return {"decode_step_ms": step * 1e3, "gap_median_ms": statistics.median(gaps) * 1e3,
            "gap_max_ms": max(gaps) * 1e3, "gap_max_over_decode_step": max(gaps) / step,
            "long_prompt_ttft_ms": ttft * 1e3, "prefill_steps": len(gaps)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--thresholds", default="none,512,256,128,64",
                        help="comma list of long_prefill_token_threshold values; none: off")
    parser.add_argument("--streams", type=int, default=8, help="decoding streams beside the long prompt")
    parser.add_argument("--stream_prompt_len", type=int, default=64)
    parser.add_argument("--long_prompt", type=int, default=2000, help="tokens of the long prompt")
    parser.add_argument("--decode_steps", type=int, default=10, help="decode-only steps timed first")
    parser.add_argument("--repeats", type=int, default=2, help="runs per threshold (medians reported)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)

    from checkpoints.default_model import resolve_model
    from jaxserve.config import EngineConfig
    from jaxserve.engine import Engine

    model_dir = resolve_model(args.model)
    rng = np.random.default_rng(args.seed)
    info = common.machine_info(with_jax=True)
    rows = []
    for text in [t.strip() for t in args.thresholds.split(",") if t.strip()]:
        threshold = None if text == "none" else int(text)
        start = time.perf_counter()
        engine = Engine.from_model(model_dir, EngineConfig(long_prefill_token_threshold=threshold,
                                                           enable_prefix_caching=False))
        print(f"threshold {text}: engine built and warmed up in {time.perf_counter() - start:.0f} s", file=sys.stderr)
        vocab = engine.model_config.vocab_size
        runs = []
        for _ in range(args.repeats):
            prompts = [rng.integers(100, vocab, args.stream_prompt_len).tolist() for _ in range(args.streams)]
            runs.append(measure(engine, prompts, rng.integers(100, vocab, args.long_prompt).tolist(),
                                args.decode_steps))
        row = {"threshold": text, **{k: statistics.median(r[k] for r in runs) for k in runs[0]}}
        rows.append(row)
        print(common.format_table([row], COLUMNS), file=sys.stderr)
        del engine
    print(common.machine_line(info))
    print(common.format_table(rows, COLUMNS))
    common.write_json(args.out, {"machine": info, "args": vars(args), "rows": rows})
    return 0


COLUMNS = [("threshold", "threshold", "s"), ("decode_step_ms", "decode step ms", ".1f"),
           ("gap_median_ms", "gap median ms", ".1f"), ("gap_max_ms", "gap max ms", ".1f"),
           ("gap_max_over_decode_step", "max / decode", ".1f"), ("long_prompt_ttft_ms", "long TTFT ms", ".0f"),
           ("prefill_steps", "prefill steps", ".0f")]

if __name__ == "__main__":
    sys.exit(main())
