"""`jaxserve bench serve|throughput|latency`: the user benchmarks (jaxserve/benchmarks/).

Each mode is a module with `define_flags(fv)` and `run(fv) -> int`, as the other commands are;
`jaxserve.commands.cli` picks the mode from the word after `bench`.
"""
from __future__ import annotations

MODES = {
    "serve": ("jaxserve.benchmarks.serve", "load an OpenAI-compatible server: TTFT, TPOT, ITL, goodput, sweeps"),
    "throughput": ("jaxserve.benchmarks.throughput", "offline throughput of an in-process engine"),
    "latency": ("jaxserve.benchmarks.latency", "latency of one batch over iterations, in process"),
}
