"""KV offload on multi-turn chats: time to first token per turn, with and without the host tier.

Two `jaxserve serve` processes in turn over the same model and device pool, one with
--kv_offloading_size, one without, each sent the same round-robin conversations by
`jaxserve bench serve --dataset_name=multiturn` (each turn's prompt is the whole history). The
pool holds about half the conversations, so without offload every later turn computes its
history again; with it the history's pages come back from host memory. Reports TTFT by turn,
the mean of turns 2..T and its ratio (offload / none), and the server's offload counters.

    python bench/kv_offload.py --out bench/out/kv_offload.json
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

COUNTERS = ("jaxserve_prefix_cache_hits_total", "jaxserve_external_prefix_cache_queries_total",
            "jaxserve_external_prefix_cache_hits_total", "jaxserve_num_preemptions_total")


def scrape(url: str) -> dict[str, float]:
    """The server's offload and prefix-cache counters (summed over labels)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in COUNTERS or sample.name.startswith("jaxserve_kv_offload_bytes"):
                key = sample.name + "".join(f"{{{v}}}" for k, v in sorted(sample.labels.items()) if k != "model_name")
                values[key] = values.get(key, 0.0) + sample.value
    return values


def run_bench(args, url: str, result_path: str) -> dict:
    command = [sys.executable, "-m", "jaxserve.commands.cli", "bench", "serve", f"--base_url={url}",
               "--dataset_name=multiturn", f"--multiturn_conversations={args.conversations}",
               f"--multiturn_turns={args.turns}", f"--random_input_len={args.first_turn_len}",
               f"--multiturn_turn_input_len={args.turn_input_len}", f"--random_output_len={args.output_len}",
               f"--seed={args.seed}", f"--tokenizer={args.model}", "--num_warmups=1", "--disable_tqdm",
               f"--result_json={result_path}", "--metric_percentiles=50,99"]
    run = subprocess.run(command, cwd=common.REPO_ROOT, capture_output=True, text=True)
    sys.stderr.write(run.stderr[-3000:])
    if run.returncode != 0 or not os.path.isfile(result_path):
        raise RuntimeError(f"jaxserve bench serve exited {run.returncode}:\n{run.stdout[-2000:]}{run.stderr[-2000:]}")
    print(run.stdout)
    with open(result_path) as f:
        return json.load(f)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--conversations", type=int, default=12)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--first_turn_len", type=int, default=300)
    parser.add_argument("--turn_input_len", type=int, default=60)
    parser.add_argument("--output_len", type=int, default=32)
    parser.add_argument("--num_pages", type=int, default=257, help="the device pool, null page included")
    parser.add_argument("--offloading_size", type=float, default=1.0, help="GiB of the host tier")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--server_args", default="", help="more `jaxserve serve` flags for both servers")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    base = [f"--num_pages={args.num_pages}", "--max_model_len=2048", *args.server_args.split()]
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, extra in (("none", []), ("offload", [f"--kv_offloading_size={args.offloading_size}"])):
            with common.ServerProcess(args.model, base + extra, log_path=os.path.join(tmp, f"{name}.log")) as server:
                result = run_bench(args, server.url, os.path.join(tmp, f"{name}.json"))
                runs[name] = {"start_seconds": server.start_seconds, "server_counters": scrape(server.url),
                              "ttft_by_turn_ms": result["ttft_by_turn_ms"],
                              "mean_ttft_later_turns_ms": result["mean_ttft_later_turns_ms"],
                              "completed": result.get("completed"),
                              "history_source": result.get("multiturn_history_source")}
    ratio = runs["offload"]["mean_ttft_later_turns_ms"] / runs["none"]["mean_ttft_later_turns_ms"]
    rows = [{"turn": none["turn"], "none": none["mean_ttft_ms"], "offload": off["mean_ttft_ms"],
             "ratio": off["mean_ttft_ms"] / none["mean_ttft_ms"], "none_p99": none["p99_ttft_ms"],
             "offload_p99": off["p99_ttft_ms"]}
            for none, off in zip(runs["none"]["ttft_by_turn_ms"], runs["offload"]["ttft_by_turn_ms"])]
    print(common.format_table(rows, [("turn", "turn", "d"), ("none", "TTFT none (ms)", ".1f"),
                                     ("offload", "TTFT offload (ms)", ".1f"), ("ratio", "offload/none", ".2f"),
                                     ("none_p99", "P99 none", ".1f"), ("offload_p99", "P99 offload", ".1f")]))
    print(f"mean TTFT of turns 2..{args.turns}: none {runs['none']['mean_ttft_later_turns_ms']:.1f} ms, offload "
          f"{runs['offload']['mean_ttft_later_turns_ms']:.1f} ms, ratio {ratio:.2f}")
    for name in runs:
        print(f"{name}: {json.dumps(runs[name]['server_counters'])}; "
              f"server ready in {runs[name]['start_seconds']:.1f} s")
    machine = common.machine_info()
    print(common.machine_line(machine))
    common.write_json(args.out, {"machine": machine, "args": vars(args), "runs": runs, "by_turn": rows,
                                 "later_turns_ratio": ratio})
    return 0


if __name__ == "__main__":
    sys.exit(main())
