"""The Hugging Face transformers baseline of bench/throughput.py: the same weights, static batches.

`load_hf_model` loads the GGUF or Hugging Face folder a converted model directory was made from;
`run_hf` runs a workload of (prompt token ids, max_tokens) in static batches of arrival order with
greedy `generate`, left padded, each batch running to its longest member.
"""
from __future__ import annotations

import os
import time

from bench import common


def load_hf_model(model_dir):
    """The same weights in transformers (float32, eval): from the GGUF or HF folder the converted
    directory was made from. Returns (model, seconds)."""
    import json

    import torch
    from transformers import AutoModelForCausalLM

    with open(os.path.join(model_dir, "jaxserve.json")) as f:
        source = json.load(f)["source"]
    start = time.perf_counter()
    if source.endswith(".gguf"):
        model = AutoModelForCausalLM.from_pretrained(os.path.dirname(source), gguf_file=os.path.basename(source),
                                                     dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    model.eval()
    model.generation_config.eos_token_id = None  # ignore_eos: every request runs to its max_tokens
    return model, time.perf_counter() - start


def run_hf(model, workload, batch_size, budget_s, pad_token_id=0):
    """Static batches in arrival order, left padded; each batch runs to its longest max_tokens.

    Output tokens counted are the requested ones (the extra tokens a short request gets while its
    batch waits for the longest member are waste). With `budget_s`, stops after the batch that
    crosses it (`partial`)."""
    torch_generate(model, [workload[0][0][:4]], 2, pad_token_id)  # warm-up, not timed
    outputs, useful, generated, elapsed, cpu, others, num_done = [], 0, 0, 0.0, 0.0, 0.0, 0
    for first in range(0, len(workload), batch_size):
        batch = workload[first:first + batch_size]
        max_new = max(m for _, m in batch)
        with common.CpuMeter() as meter:
            tokens = torch_generate(model, [p for p, _ in batch], max_new, pad_token_id)
        elapsed, cpu = elapsed + meter.wall_s, cpu + meter.cpu_s
        others += (meter.other_cores or 0.0) * meter.wall_s
        outputs += [t[:m] for t, (_, m) in zip(tokens, batch)]
        useful += sum(m for _, m in batch)
        generated += max_new * len(batch)
        num_done += len(batch)
        if budget_s and elapsed > budget_s and num_done < len(workload):
            break
    return dict(batch_size=batch_size, wall_s=elapsed, output_tokens=useful, generated_tokens=generated,
                output_tokens_per_s=useful / elapsed, cpu_s=cpu, output_tokens_per_cpu_s=useful / cpu,
                other_processes_cores=others / elapsed, requests_done=num_done, partial=num_done < len(workload),
                outputs=outputs)


def torch_generate(model, prompts, max_new_tokens, pad_token_id):
    import torch

    length = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), length), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for i, p in enumerate(prompts):
        input_ids[i, length - len(p):] = torch.as_tensor(p)
        attention_mask[i, length - len(p):] = 1
    with torch.inference_mode():
        out = model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=max_new_tokens,
                             min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad_token_id)
    return out[:, length:].tolist()


def greedy_agreement(ours, theirs, k=16):
    """Fraction of requests whose first k greedy tokens are the same in both engines."""
    same = sum(a[:k] == b[:k] for a, b in zip(ours, theirs))
    return dict(first_16_tokens_equal=same / max(len(ours), 1), requests=len(ours))
