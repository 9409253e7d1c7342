"""Speculative decoding (issue #17): TPOT with and without it, acceptance, and where it stops paying.

Single stream (one request at a time, `Engine.step`), greedy, chat-templated real prompts of two
classes:
  copy  copy-heavy: repeat / quote a given text, fix a typo in or rename a variable of given code,
        rewrite an e-mail changing one name (the answer re-uses long stretches of the prompt);
  chat  open questions (little of the answer is in the prompt).
Variants, each its own Engine (warmup=True; warm-up and a first short request are timed apart):
  none        no speculation;
  ngram k=K   prompt lookup (speculative_method="ngram"), num_speculative_tokens K for each of
              `--ks`, prompt_lookup_min / max at the EngineConfig defaults;
  draft k=K   the target as its own draft (speculative_method="draft", the same weights): every
              proposal the target would have drawn, so the acceptance upper bound, at the price of
              K draft forwards per step.
Every prompt runs through every variant in turn before the next prompt (the variants share the
machine's load), the whole sequence `--repeats` times; medians. Per request: TTFT (add_request to
the step with the first token), TPOT = (time of the last token - time of the first) / (tokens - 1),
the engine's speculation counters (stats() deltas), and the steps' StepRecords; the greedy token
ids are compared with the no-speculation run of the same prompt.

Concurrency: a fixed workload of `--num_requests` requests submitted at once (`Engine.generate`;
the copy prompts cycled, then the chat prompts cycled), greedy, with max_num_seqs = each of
`--concurrency`, without speculation and with ngram k = `--conc_k` (and, for the largest
max_num_seqs, with speculative_disable_by_batch_size = each of `--disable_by_batch_size`):
output tokens per second of wall time and per CPU second of this process (on a shared machine the
latter moves far less with other jobs' load), interleaved likewise within each max_num_seqs (one
level's engines at a time: all of them at once come close to the kernel's limit on memory
mappings, see memory_maps).

  python bench/speculative.py --out=bench/out/speculative.json        # SmolLM2, ~25 min on 2 cores
  python bench/speculative.py --skip_single --conc_repeats=3 --out=bench/out/speculative_concurrency.json
  python bench/speculative.py --smoke --model=DIR --out=/tmp/spec.json  # tiny model, under a minute
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import common  # noqa: E402

# ---- prompts (written for this benchmark) ------------------------------------------------------
PARAGRAPH = (
    "The ferry to Harrow Island leaves the mainland twice a day, once at seven in the morning and once "
    "at half past four. In winter the afternoon crossing is often cancelled, because the wind comes "
    "straight down the channel and the small boat rolls badly in the swell. Most of the two hundred "
    "people who live on the island keep a spare week of food in their cupboards for that reason. The "
    "school has eleven pupils and one teacher, who also runs the library on Saturday mornings. There "
    "is a single shop, which sells bread, tinned fish, batteries, wool and newspapers that are always "
    "a day late. Visitors come in summer to walk the cliff path and count the puffins, and a few of "
    "them stay for good. They say it is the quiet that keeps them, and the way the light changes over "
    "the water in the evening.")

PYTHON_FUNCTION = '''def average_temperature(readings, skip_missing=True):
    """Mean of a list of temperature readings in degrees Celsius."""
    total = 0.0
    count = 0
    for value in readings:
        if value is None:
            if skip_missing:
                continue
            raise ValueError("missing reading")
        total += value
        count += 1
    if count == 0:
        retrun None
    return total / count'''

JS_CODE = '''function cartTotal(items, taxRate) {
  let tmp = 0;
  for (const item of items) {
    const price = item.price * item.quantity;
    tmp += price;
  }
  if (item.discount) {
    tmp -= item.discount;
  }
  tmp = tmp * (1 + taxRate);
  return Math.round(tmp * 100) / 100;
}'''

MEETING_NOTES = (
    "Minutes of the Elm Street community garden meeting, 4 March. Present: nine members. The water "
    "tank by the shed is leaking again; Tom will ask the hardware store for a new tap before the end "
    "of the month. The compost bins are full, so nobody should add kitchen scraps until the first "
    "bin has been turned. Plot 6 is free from April and will go to the next family on the waiting "
    "list. The spring seed swap will be held on the last Sunday of March from ten until noon, and "
    "members are asked to bring labelled envelopes. The next meeting is on 1 April at the library.")

EMAIL = (
    "Hi team,\n\nDaniel will be leading the project review on Thursday at 2 pm in room B. Please send "
    "Daniel your slides by Wednesday evening so they can be merged into one deck. If you cannot attend, "
    "let Daniel know and add a short written update to the shared folder instead. We will go through "
    "the budget first, then the schedule, then open questions. Coffee and biscuits will be provided.\n\n"
    "Thanks,\nSara")

COPY_PROMPTS = [
    "Repeat the following paragraph exactly, word for word:\n\n" + PARAGRAPH,
    "Fix the typo in this Python function and return the whole function:\n\n```python\n" + PYTHON_FUNCTION
    + "\n```",
    "Quote the following text in full, then add one sentence saying what it is about:\n\n" + MEETING_NOTES,
    "Rename the variable `tmp` to `total` in this JavaScript function and return the complete function:\n\n"
    "```javascript\n" + JS_CODE + "\n```",
    "Rewrite the following email, replacing the name Daniel with Priya everywhere and changing nothing "
    "else:\n\n" + EMAIL,
]

CHAT_PROMPTS = [
    "What are some good ways to stay focused while studying at home?",
    "Explain how a refrigerator keeps food cold.",
    "Can you suggest a simple dinner recipe using chickpeas?",
    "What is the difference between weather and climate?",
    "Write a short poem about autumn leaves.",
]

# (max_num_batched_tokens=32: one prefill bucket, so each of the seven warmed-up engines compiles
# two step shapes fewer; the prompts are prefilled in more chunks, which every part still covers.)
SMOKE = dict(prompts_per_class=1, repeats=1, max_tokens=8, ks="2", draft_k=2, single_max_num_seqs=1,
             concurrency="2", num_requests=3, conc_k=2, disable_by_batch_size="1", max_num_batched_tokens=32,
             max_model_len=512, conc_repeats=1)


def chat_prompt_ids(tokenizer, text: str) -> list[int]:
    from serve.prompts import encode_chat  # the server's encoding: template text, then its tokens

    return encode_chat(tokenizer, [{"role": "user", "content": text}])


# ---- engines -----------------------------------------------------------------------------------
def engine_config(args, *, max_num_seqs, method=None, k=4, disable_by_batch_size=None, num_pages):
    from jaxserve.engine import EngineConfig

    return EngineConfig(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens, max_num_prefill_seqs=1,
        max_model_len=args.max_model_len, num_pages=num_pages, enable_prefix_caching=False, warmup=True,
        speculative_method=method, num_speculative_tokens=k,
        speculative_model=args.model_dir if method == "draft" else None,
        speculative_disable_by_batch_size=disable_by_batch_size)


class Recorded:
    """An engine and every StepRecord it leaves (a step listener), with its build timings."""

    def __init__(self, name, model, cfg, warm_prompt):
        from jaxserve.engine import Engine

        model_config, params, tokenizer = model
        start = time.perf_counter()
        self.engine = Engine(model_config, params, tokenizer, cfg, model_name="bench",
                             draft_model=(model_config, params) if cfg.speculative_method == "draft" else None)
        self.warmup_s = time.perf_counter() - start
        self.name, self.cfg = name, cfg
        self.records = []
        self.engine.add_step_listener(self.records.append)
        start = time.perf_counter()  # a first short request: whatever warm-up did not reach
        single_request(self, warm_prompt, 16)
        self.first_request_s = time.perf_counter() - start
        print(f"  {name}: warm-up {self.warmup_s:.1f}s, first request {self.first_request_s:.1f}s",
              file=sys.stderr, flush=True)


def spec_counters(engine):
    s = engine.stats()
    return (s.spec_verify_steps, s.spec_proposed_tokens, s.spec_accepted_tokens,
            tuple(s.spec_accepted_per_position))


def single_request(rec: Recorded, prompt, max_tokens) -> dict:
    """One request alone through `Engine.step`: timings, tokens, speculation deltas, its steps."""
    from jaxserve.core.request import SamplingParams

    engine = rec.engine
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    before = spec_counters(engine)
    first_record = len(rec.records)
    tokens, token_times = [], []  # token_times: wall time at which each step's tokens arrived
    start = time.perf_counter()
    engine.add_request(f"r{time.monotonic_ns()}", prompt, params)
    while engine.has_unfinished():
        for out in engine.step():
            if out.new_token_ids:
                tokens.extend(out.new_token_ids)
                token_times.append((time.perf_counter(), len(out.new_token_ids)))
    after = spec_counters(engine)
    steps = rec.records[first_record:]
    n = len(tokens)
    t_first, t_last = token_times[0][0], token_times[-1][0]
    return dict(
        tokens=tokens, num_tokens=n, ttft_s=t_first - start,
        tpot_s=(t_last - t_first) / (n - 1) if n > 1 else None,
        verify_steps=after[0] - before[0], proposed=after[1] - before[1], accepted=after[2] - before[2],
        accepted_per_position=[a - b for a, b in zip(after[3], before[3])],
        steps_after_first=len(token_times) - 1,
        steps=[dict(kind=r.kind, device_s=r.device_seconds, host_s=r.host_seconds, out=r.num_output_tokens,
                    tokens=r.num_tokens) for r in steps])


def memory_maps() -> int | None:
    """Memory mappings of this process: every compiled executable takes hundreds, and past the
    kernel's vm.max_map_count (65530 here) LLVM cannot map the next one (the process then dies)."""
    try:
        with open("/proc/self/maps") as f:
            return sum(1 for _ in f)
    except OSError:
        return None


def release(engines) -> None:
    """Drops the engines and their compiled executables (their memory mappings with them)."""
    import gc

    import jax

    for rec in engines.values():
        del rec.engine
    gc.collect()
    jax.clear_caches()
    gc.collect()


def median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else float("nan")


# ---- the two parts -----------------------------------------------------------------------------
def run_single_stream(args, model, prompts, info):
    ks = [int(k) for k in args.ks.split(",") if k.strip()]
    variants = [("none", None, 4)] + [(f"ngram k={k}", "ngram", k) for k in ks]
    if args.draft_k:
        variants.append((f"draft=target k={args.draft_k}", "draft", args.draft_k))
    longest = max(len(p) for _, _, p in prompts)
    pages = -(-(longest + args.max_tokens + 17) // 16) + 2
    engines = {}
    print(f"single stream: building {len(variants)} engines", file=sys.stderr, flush=True)
    for name, method, k in variants:
        cfg = engine_config(args, max_num_seqs=args.single_max_num_seqs, method=method, k=k, num_pages=pages)
        engines[name] = Recorded(name, model, cfg, prompts[0][2][:64])
    info["memory_maps_single_stream"] = memory_maps()
    runs = {name: [] for name in engines}  # one dict per (repeat, prompt)
    start = time.perf_counter()
    for repeat in range(args.repeats):
        for i, (cls, label, prompt) in enumerate(prompts):
            for name, rec in engines.items():
                run = single_request(rec, prompt, args.max_tokens)
                run.update(repeat=repeat, prompt=i, cls=cls, label=label, prompt_tokens=len(prompt))
                runs[name].append(run)
            base = runs["none"][-1]
            line = "  ".join(f"{name}: {1000 * runs[name][-1]['tpot_s']:.1f}" for name in engines
                             if runs[name][-1]["tpot_s"] is not None)
            print(f"[{time.perf_counter() - start:5.0f}s] repeat {repeat + 1} {cls} prompt {i} "
                  f"({len(prompt)} + {base['num_tokens']} tokens) TPOT ms  {line}  (load {common.load_average()})",
                  file=sys.stderr, flush=True)

    results = {}
    for name, rec in engines.items():
        per_class = {}
        for cls in ("copy", "chat", "all"):
            rs = [r for r in runs[name] if cls in ("all", r["cls"])]
            base = [r for r in runs["none"] if cls in ("all", r["cls"])]
            verify = [s for r in rs for s in r["steps"] if s["kind"] == "verify"]
            proposed, accepted = sum(r["proposed"] for r in rs), sum(r["accepted"] for r in rs)
            paired = [r["tpot_s"] / b["tpot_s"] for r, b in zip(rs, base) if r["tpot_s"] and b["tpot_s"]]
            per_position = [sum(col) for col in zip(*[r["accepted_per_position"] for r in rs])] if rs else []
            per_class[cls] = dict(
                tpot_ms=1000 * median([r["tpot_s"] for r in rs]),
                ttft_ms=1000 * median([r["ttft_s"] for r in rs]),
                tpot_ratio=median([r["tpot_s"] for r in rs]) / median([b["tpot_s"] for b in base]),
                tpot_ratio_paired_median=median(paired),
                acceptance_rate=accepted / proposed if proposed else None,
                proposed=proposed, accepted=accepted, verify_steps=sum(r["verify_steps"] for r in rs),
                accepted_per_position=per_position,
                tokens_per_verify_step=(sum(s["out"] for s in verify) / len(verify)) if verify else None,
                tokens_per_step_after_first=(sum(r["num_tokens"] - 1 for r in rs)
                                             / max(1, sum(r["steps_after_first"] for r in rs))),
                output_tokens=[r["num_tokens"] for r in rs],
                greedy_identical=sum(r["tokens"] == b["tokens"] for r, b in zip(rs, base)),
                num_requests=len(rs),
                differing=[dict(prompt=r["prompt"], repeat=r["repeat"],
                                first_difference=next((j for j, (x, y) in enumerate(zip(r["tokens"], b["tokens"]))
                                                       if x != y), min(len(r["tokens"]), len(b["tokens"]))))
                           for r, b in zip(rs, base) if r["tokens"] != b["tokens"]])
        steps = [s for r in runs[name] for s in r["steps"]]
        by_kind = {}
        for kind in ("prefill", "decode", "verify", "mixed"):
            ks_ = [s for s in steps if s["kind"] == kind]
            if ks_:
                by_kind[kind] = dict(steps=len(ks_), median_device_ms=1000 * median([s["device_s"] for s in ks_]),
                                     median_host_ms=1000 * median([s["host_s"] for s in ks_]),
                                     median_step_ms=1000 * median([s["device_s"] + s["host_s"] for s in ks_]),
                                     median_tokens_out=median([s["out"] for s in ks_]))
        results[name] = dict(per_class=per_class, step_kinds=by_kind, warmup_s=rec.warmup_s,
                             first_request_s=rec.first_request_s,
                             config=dict(method=rec.cfg.speculative_method,
                                         num_speculative_tokens=rec.cfg.num_speculative_tokens
                                         if rec.cfg.speculative_method else 0,
                                         prompt_lookup_min=rec.cfg.prompt_lookup_min,
                                         prompt_lookup_max=rec.cfg.prompt_lookup_max),
                             runs=[{k: v for k, v in r.items() if k not in ("steps",)} for r in runs[name]])
    release(engines)
    return results


def run_concurrency(args, model, prompts, info):
    from jaxserve.core.request import SamplingParams

    levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    disables = [int(d) for d in args.disable_by_batch_size.split(",") if d.strip()]
    copy = [p for cls, _, p in prompts if cls == "copy"]
    chat = [p for cls, _, p in prompts if cls == "chat"]
    workloads = {"copy": [copy[i % len(copy)] for i in range(args.num_requests)],
                 "chat": [chat[i % len(chat)] for i in range(args.num_requests)]}
    longest = max(len(p) for p in copy + chat)
    pages_per_seq = -(-(longest + args.max_tokens + 17) // 16) + 1
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    runs, warmups = {}, {}
    start = time.perf_counter()
    # One level at a time (its engines interleaved, then released): every compiled shape takes
    # memory mappings, and all five engines at once came within 2% of vm.max_map_count.
    for level, c in enumerate(levels):
        setups = [(f"max_num_seqs={c} none", None), (f"max_num_seqs={c} ngram k={args.conc_k}", None)]
        if level == len(levels) - 1:
            setups += [(f"max_num_seqs={c} ngram k={args.conc_k} disable>{d}", d) for d in disables]
        print(f"concurrency {c}: building {len(setups)} engines", file=sys.stderr, flush=True)
        engines = {}
        for i, (name, d) in enumerate(setups):
            cfg = engine_config(args, max_num_seqs=c, method="ngram" if i else None, k=args.conc_k,
                                disable_by_batch_size=d, num_pages=c * pages_per_seq + 4)
            engines[name] = Recorded(name, model, cfg, copy[0][:64])
            warmups[name] = engines[name].warmup_s
        info[f"memory_maps_concurrency_{c}"] = memory_maps()
        for repeat in range(args.conc_repeats):
            for mix, workload in workloads.items():
                for name, rec in engines.items():
                    engine = rec.engine
                    before = spec_counters(engine)
                    first_record = len(rec.records)
                    with common.CpuMeter() as meter:
                        results = engine.generate(workload, params)
                    after = spec_counters(engine)
                    steps = rec.records[first_record:]
                    out_tokens = sum(len(r.token_ids) for r in results)
                    runs.setdefault((name, mix), []).append(dict(
                        wall_s=meter.wall_s, output_tokens=out_tokens, output_tokens_per_s=out_tokens / meter.wall_s,
                        cpu_s=meter.cpu_s, output_tokens_per_cpu_s=out_tokens / meter.cpu_s,
                        other_processes_cores=meter.other_cores, num_steps=len(steps),
                        verify_steps=after[0] - before[0], proposed=after[1] - before[1],
                        accepted=after[2] - before[2], tokens=[list(r.token_ids) for r in results],
                        step_kinds={kind: sum(s.kind == kind for s in steps)
                                    for kind in ("prefill", "decode", "verify", "mixed")},
                        verify_median_device_ms=1000 * median([s.device_seconds for s in steps if s.kind == "verify"]),
                        decode_median_device_ms=1000 * median([s.device_seconds for s in steps if s.kind == "decode"])))
                    print(f"[{time.perf_counter() - start:5.0f}s] repeat {repeat + 1} {mix} {name}: {out_tokens} "
                          f"tokens in {meter.wall_s:.1f}s = {out_tokens / meter.wall_s:.1f} tok/s "
                          f"({out_tokens / meter.cpu_s:.1f} per CPU second; load {common.load_average()})",
                          file=sys.stderr, flush=True)
        release(engines)
    results = {}
    for (name, mix), rs in runs.items():
        base_name = name.split(" ")[0] + " none"
        base = runs[base_name, mix]
        proposed, accepted = sum(r["proposed"] for r in rs), sum(r["accepted"] for r in rs)
        tps = median([r["output_tokens_per_s"] for r in rs])
        per_cpu_s = median([r["output_tokens_per_cpu_s"] for r in rs])
        results.setdefault(name, dict(warmup_s=warmups[name]))[mix] = dict(
            output_tokens_per_s=tps, ratio=tps / median([r["output_tokens_per_s"] for r in base]),
            output_tokens_per_cpu_s=per_cpu_s,
            ratio_per_cpu_s=per_cpu_s / median([r["output_tokens_per_cpu_s"] for r in base]),
            acceptance_rate=accepted / proposed if proposed else None,
            greedy_identical=sum(a == b for r, rb in zip(rs, base) for a, b in zip(r["tokens"], rb["tokens"])),
            num_requests=sum(len(r["tokens"]) for r in rs),
            runs=[{k: v for k, v in r.items() if k != "tokens"} for r in rs])
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", help="'smollm2' or a converted model directory")
    parser.add_argument("--smoke", action="store_true", help="a tiny run of every part (for tests): " + str(SMOKE))
    parser.add_argument("--prompts_per_class", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=2, help="single stream: passes over all prompts")
    parser.add_argument("--max_tokens", type=int, default=128)
    parser.add_argument("--ks", default="2,4,8", help="ngram num_speculative_tokens values")
    parser.add_argument("--draft_k", type=int, default=4, help="draft=target's K (0: no draft variant)")
    parser.add_argument("--single_max_num_seqs", type=int, default=1,
                        help="max_num_seqs of the single-stream engines (1: the fewest compiled shapes)")
    parser.add_argument("--concurrency", default="8,32", help="max_num_seqs values ('' : skip that part)")
    parser.add_argument("--num_requests", type=int, default=32)
    parser.add_argument("--conc_k", type=int, default=4)
    parser.add_argument("--conc_repeats", type=int, default=2)
    parser.add_argument("--disable_by_batch_size", default="8",
                        help="speculative_disable_by_batch_size values tried at the largest max_num_seqs")
    parser.add_argument("--max_num_batched_tokens", type=int, default=256)
    parser.add_argument("--max_model_len", type=int, default=1024)
    parser.add_argument("--skip_single", action="store_true", help="only the concurrency part")
    parser.add_argument("--out", default=None, help="JSON report path")
    args = parser.parse_args(argv)
    if args.smoke:
        for key, value in SMOKE.items():
            setattr(args, key, value)

    import jax.numpy as jnp

    from checkpoints import default_model, load

    wall_start = time.perf_counter()
    args.model_dir = default_model.resolve_model(args.model) if args.model == "smollm2" else args.model
    source = load.open_model(args.model_dir)
    tokenizer = source.load_tokenizer()
    model = (source.config, source.load_params(jnp.float32, None), tokenizer)
    info = common.machine_info(with_jax=True)
    prompts = ([("copy", t[:40], chat_prompt_ids(tokenizer, t)) for t in COPY_PROMPTS[:args.prompts_per_class]]
               + [("chat", t[:40], chat_prompt_ids(tokenizer, t)) for t in CHAT_PROMPTS[:args.prompts_per_class]])
    print(common.machine_line(info), file=sys.stderr, flush=True)
    print("prompt tokens: " + ", ".join(f"{cls} {len(p)}" for cls, _, p in prompts), file=sys.stderr, flush=True)

    single = {} if args.skip_single else run_single_stream(args, model, prompts, info)
    concurrency = run_concurrency(args, model, prompts, info) if args.concurrency.strip() else {}
    info["load_average_end"] = common.load_average()

    # ---- report ----
    from jaxserve.config import EngineConfig
    defaults = EngineConfig()
    print(common.machine_line(info))
    if single:
        print(f"single stream, greedy, max_tokens {args.max_tokens}, {args.prompts_per_class} prompts per class x "
              f"{args.repeats} repeats, medians; ngram prompt_lookup_min {defaults.prompt_lookup_min} / max "
              f"{defaults.prompt_lookup_max}")
        rows = []
        for name, r in single.items():
            for cls in ("copy", "chat"):
                c = r["per_class"][cls]
                rows.append(dict(variant=name, cls=cls, tpot=c["tpot_ms"], ratio=c["tpot_ratio"],
                                 paired=c["tpot_ratio_paired_median"], ttft=c["ttft_ms"],
                                 acc=c["acceptance_rate"], per_verify=c["tokens_per_verify_step"],
                                 per_step=c["tokens_per_step_after_first"],
                                 same=f"{c['greedy_identical']}/{c['num_requests']}",
                                 tokens=f"{min(c['output_tokens'])}-{max(c['output_tokens'])}"))
        print(common.format_table(rows, [
            ("variant", "variant", "s"), ("cls", "prompts", "s"), ("tpot", "TPOT ms", ".1f"),
            ("ratio", "/ none", ".2f"), ("paired", "paired / none", ".2f"), ("ttft", "TTFT ms", ".0f"),
            ("acc", "acceptance", ".2f"), ("per_verify", "tok/verify step", ".2f"),
            ("per_step", "tok/step", ".2f"), ("same", "greedy = none", "s"), ("tokens", "tokens out", "s")]))
        kinds = []
        for name, r in single.items():
            for kind, s in r["step_kinds"].items():
                kinds.append(dict(variant=name, kind=kind, steps=s["steps"], device=s["median_device_ms"],
                                  host=s["median_host_ms"], out=s["median_tokens_out"]))
        print(common.format_table(kinds, [("variant", "variant", "s"), ("kind", "step kind", "s"),
                                          ("steps", "steps", "d"), ("device", "median device ms", ".1f"),
                                          ("host", "median host ms", ".1f"), ("out", "median tokens out", ".0f")]))
    if concurrency:
        rows = []
        for name, r in concurrency.items():
            for mix in ("copy", "chat"):
                m = r[mix]
                rows.append(dict(setup=name, mix=mix, tps=m["output_tokens_per_s"], ratio=m["ratio"],
                                 cpu=m["output_tokens_per_cpu_s"], cpu_ratio=m["ratio_per_cpu_s"],
                                 acc=m["acceptance_rate"], same=f"{m['greedy_identical']}/{m['num_requests']}",
                                 verify=sum(x["step_kinds"]["verify"] for x in m["runs"]),
                                 steps=sum(x["num_steps"] for x in m["runs"])))
        print(f"concurrency: {args.num_requests} requests at once, max_tokens {args.max_tokens}, "
              f"{args.conc_repeats} repeat(s), medians")
        print(common.format_table(rows, [
            ("setup", "engine", "s"), ("mix", "prompts", "s"), ("tps", "output tok/s", ".1f"),
            ("ratio", "/ none", ".2f"), ("cpu", "tok/CPU s", ".1f"), ("cpu_ratio", "/ none", ".2f"),
            ("acc", "acceptance", ".2f"), ("verify", "verify steps", "d"),
            ("steps", "steps", "d"), ("same", "greedy = none", "s")]))
    info["wall_s"] = time.perf_counter() - wall_start
    print(f"total wall time {info['wall_s']:.0f}s")
    common.write_json(args.out, dict(machine=info, args=vars(args),
                                     prompt_lookup=dict(min=defaults.prompt_lookup_min, max=defaults.prompt_lookup_max),
                                     prompts=[dict(cls=c, start=label, prompt_tokens=len(p))
                                              for c, label, p in prompts],
                                     single_stream=single, concurrency=concurrency))
    return 0


if __name__ == "__main__":
    sys.exit(main())
