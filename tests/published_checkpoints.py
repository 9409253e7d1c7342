"""Quantized checkpoints as they are published, made on the CPU from a float Hugging Face model.

- compressed-tensors (what llm-compressor saves): the compressed-tensors package's own code
  attaches the scheme, computes the min-max scales and zero points (`calculate_qparams`, what
  llm-compressor's QuantizationModifier does with its default min-max observer), packs the codes
  and writes the config (`ModelCompressor`).
- GPTQ (AutoGPTQ / GPTQModel layout) and AWQ (AutoAWQ GEMM layout): written here, tensor for
  tensor as those libraries pack them (their packers need CUDA builds or another torch); the
  tests check the packing against compressed-tensors' `unpack_from_int32` and, for AWQ, its
  AutoAWQ converter.

Every writer quantizes the decoder's linear modules as the checkpoint names them
(`linear_modules`): a dense Llama's attention and MLP projections; a mixture of experts' attention,
each routed expert's own modules (`mlp.experts.M.gate_proj`, Mixtral's `block_sparse_moe.experts.M.w1`)
and Qwen2-MoE's shared expert, the routers left float as the published checkpoints leave them
(ROUTERS, in `ignore`).

`reference_model` dequantizes any of them with compressed-tensors (its converters and
dequantizer) into a float folder that transformers loads: the reference the tests compare with.
"""
from __future__ import annotations

import json
import os
import re

import numpy as np

# the routers (and Qwen2-MoE's shared-expert gate), in compressed-tensors' target syntax
ROUTERS = (r"re:.*(mlp|block_sparse_moe)\.gate$", r"re:.*shared_expert_gate$")


def checkpoint_tensors(model) -> dict:
    """{name: torch tensor} of `model` as save_pretrained writes it, in its dtype (a mixture of
    experts: one tensor per expert's linear module, not transformers' fused in-memory experts)."""
    import tempfile

    from safetensors.torch import load_file
    tensors = {}
    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder, safe_serialization=True)
        for name in sorted(n for n in os.listdir(folder) if n.endswith(".safetensors")):
            tensors.update(load_file(os.path.join(folder, name)))
    return tensors


def _matches(module: str, patterns) -> bool:
    """Whether a compressed-tensors target / ignore entry ("re:<regex>" or a name) names `module`."""
    return any(re.match(p[3:], module) if p.startswith("re:") else p == module for p in patterns)


def linear_modules(names) -> list[str]:
    """The decoder's linear modules among a checkpoint's tensor names: the module of every 2-D
    `model.layers.N.<module>.weight`, less the routers (ROUTERS)."""
    return [n.removesuffix(".weight") for n in names
            if re.fullmatch(r"model\.layers\.\d+\..+\.weight", n) and "norm" not in n
            and not _matches(n.removesuffix(".weight"), ROUTERS)]


def quantize_compressed_tensors(model, path: str, *, bits: int = 4, group: int | str | None = 128,
                                symmetric: bool = True, kind: str = "int", fmt: str | None = None,
                                ignore=("lm_head",)) -> None:
    """Quantizes `model` (a torch causal LM) with compressed-tensors and saves it compressed under
    `path`. `group`: a group size, None (per output channel) or "tensor". The scheme targets
    every Linear of the checkpoint as saved (every 2-D weight but the embedding: a mixture of
    experts' per-expert modules too), less `ignore`."""
    import torch
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationScheme,
                                                 apply_quantization_config)
    from compressed_tensors.quantization.utils import calculate_qparams
    from safetensors.torch import save_file

    tensors = checkpoint_tensors(model)
    linears = torch.nn.Module()  # the checkpoint's Linear modules under their saved names
    for name in [n for n, t in tensors.items() if t.ndim == 2 and n.endswith(".weight") and "embed" not in n]:
        *parents, leaf = name.removesuffix(".weight").split(".")
        node = linears
        for part in parents:
            if not hasattr(node, part):
                node.add_module(part, torch.nn.Module())
            node = getattr(node, part)
        linear = torch.nn.Linear(tensors[name].shape[1], tensors[name].shape[0], bias=False, dtype=tensors[name].dtype)
        linear.weight.data.copy_(tensors.pop(name))
        node.add_module(leaf, linear)
    strategy = "group" if isinstance(group, int) else ("channel" if group is None else "tensor")
    args = QuantizationArgs(num_bits=bits, type=kind, symmetric=symmetric, strategy=strategy,
                            group_size=group if strategy == "group" else None)
    config = QuantizationConfig(config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=args)},
                                ignore=list(ignore), quantization_status="frozen")
    apply_quantization_config(linears, config)
    for module in linears.modules():
        if not hasattr(module, "weight_scale"):
            continue
        w = module.weight.data
        if strategy == "group":
            w = w.reshape(w.shape[0], -1, group)
        elif strategy == "tensor":
            w = w.reshape(1, -1)
        scale, zero = calculate_qparams(w.amin(-1), w.amax(-1), args)
        module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
        if getattr(module, "weight_zero_point", None) is not None:
            module.weight_zero_point.data.copy_(zero.reshape(module.weight_zero_point.shape))
    compressor = ModelCompressor.from_pretrained_model(linears, quantization_format=fmt)
    compressor.compress_model(linears)
    os.makedirs(path, exist_ok=True)
    model.config.save_pretrained(path)
    state = {**tensors, **{k: v.detach().contiguous() for k, v in linears.state_dict().items()}}
    save_file(state, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    compressor.update_config(path)


def _rtn_codes(w: np.ndarray, group_of_input: np.ndarray, num_groups: int, bits: int, symmetric: bool):
    """GPTQ's / AWQ's round-to-nearest quantizer: (u uint8 [out, in], scale float16 [out, G], zero
    int [out, G]) with w ~ (u - zero) * scale, scales rounded to float16 first."""
    maxq = (1 << bits) - 1
    out = w.shape[0]
    scale = np.zeros((out, num_groups), np.float16)
    zero = np.zeros((out, num_groups), np.int64)
    for g in range(num_groups):
        cols = w[:, group_of_input == g]
        low, high = np.minimum(cols.min(1), 0), np.maximum(cols.max(1), 0)
        if symmetric:
            high = np.maximum(-low, high)
            low = -high
        s = np.where(high > low, (high - low) / maxq, 1.0).astype(np.float16)
        scale[:, g] = s
        zero[:, g] = (maxq + 1) // 2 if symmetric else np.clip(np.round(-low / s.astype(np.float32)), 0, maxq)
    s = scale.astype(np.float32)[:, group_of_input]
    u = np.clip(np.round(w / s) + zero[:, group_of_input], 0, maxq).astype(np.uint8)
    return u, scale, zero


def _pack(codes: np.ndarray, bits: int, order=None) -> np.ndarray:
    """uint codes [rows, n] -> int32 [rows, n * bits / 32], code k of each word at bits k*bits
    (`order`: which of each word's columns goes to slot k; AWQ's interleave)."""
    per_word = 32 // bits
    rows, n = codes.shape
    grouped = codes.astype(np.uint32).reshape(rows, n // per_word, per_word)
    if order is not None:
        grouped = grouped[:, :, list(order)]
    words = np.zeros((rows, n // per_word), np.uint32)
    for k in range(per_word):
        words |= (grouped[:, :, k] & ((1 << bits) - 1)) << np.uint32(bits * k)
    return words.view(np.int32)


def _quantized_state(model, make) -> dict:
    """The model's saved tensors as numpy, each decoder linear weight (`linear_modules`) replaced
    by make(name, w [out, in])."""
    state = {k: v.float().numpy() for k, v in checkpoint_tensors(model).items()}
    for name in linear_modules(list(state)):
        for suffix, tensor in make(name, state.pop(f"{name}.weight")).items():
            state[f"{name}.{suffix}"] = tensor
    return state


def _save(model, path: str, state: dict, quantization_config: dict) -> None:
    from safetensors.numpy import save_file
    os.makedirs(path, exist_ok=True)
    model.config.save_pretrained(path)
    save_file({k: np.ascontiguousarray(v) for k, v in state.items()}, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = quantization_config
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)


def write_gptq(model, path: str, *, bits: int = 4, group: int = 32, symmetric: bool = True,
               act_order: bool = False, v1: bool = True, seed: int = 0) -> None:
    """A GPTQ checkpoint (qweight [in*bits/32, out], qzeros [G, out*bits/32] holding zero - 1 in the
    v1 "gptq" format, scales float16 [G, out], g_idx [in]) of `model`'s decoder linears. With
    `act_order` the inputs go into groups in a random order, as GPTQ's desc_act does: input
    perm[k] is the k-th quantized, so g_idx[perm[k]] = k // group."""
    rng = np.random.default_rng(seed)

    def make(name, w):
        inp = w.shape[1]
        size = inp if group == -1 else group
        order = rng.permutation(inp) if act_order else np.arange(inp)
        g_idx = np.empty(inp, np.int32)
        g_idx[order] = np.arange(inp) // size
        u, scale, zero = _rtn_codes(w, g_idx, inp // size, bits, symmetric)
        stored_zero = (zero - 1) if v1 else zero
        return {"qweight": _pack(u, bits).T.copy(),
                "qzeros": _pack(stored_zero.T.copy(), bits), "scales": scale.T.copy(), "g_idx": g_idx}

    state = _quantized_state(model, make)
    _save(model, path, state, {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": act_order,
                               "sym": symmetric, "checkpoint_format": "gptq" if v1 else "gptq_v2",
                               "true_sequential": True, "damp_percent": 0.01, "static_groups": False})


AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ GEMM: slot k of each int32 holds column AWQ_ORDER[k]


def write_awq(model, path: str, *, group: int = 32) -> None:
    """An AutoAWQ GEMM checkpoint (qweight [in, out/8] and qzeros [G, out/8] packed along the
    output in AWQ's order, scales float16 [G, out]; asymmetric, zero_point=True)."""
    def make(name, w):
        inp = w.shape[1]
        u, scale, zero = _rtn_codes(w, np.arange(inp) // group, inp // group, 4, symmetric=False)
        return {"qweight": _pack(u.T.copy(), 4, AWQ_ORDER), "qzeros": _pack(zero.T.copy(), 4, AWQ_ORDER),
                "scales": scale.T.copy()}

    state = _quantized_state(model, make)
    _save(model, path, state, {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
                               "version": "gemm", "modules_to_not_convert": None})


def gptq_dequantize(qweight, qzeros, scales, g_idx, bits: int, v1: bool = True) -> np.ndarray:
    """[out, in] float32 of one GPTQ weight, as AutoGPTQ's reference kernel computes it: codes and
    zeros shifted out of their int32 words, zero = (stored + 1) & maxq in the v1 format,
    w = scales[g_idx] * (q - zeros[g_idx])."""
    import torch
    qweight, qzeros = torch.as_tensor(qweight), torch.as_tensor(qzeros)
    scales, g_idx = torch.as_tensor(scales).float(), torch.as_tensor(g_idx).long()
    wf = torch.arange(0, 32, bits, dtype=torch.int32)
    maxq = (1 << bits) - 1
    zeros = torch.bitwise_right_shift(qzeros.unsqueeze(2), wf.view(1, 1, -1)).to(torch.int16)
    zeros = torch.bitwise_and(zeros + (1 if v1 else 0), maxq).reshape(qzeros.shape[0], -1)
    weight = torch.bitwise_right_shift(qweight.unsqueeze(1), wf.view(1, -1, 1)).to(torch.int16)
    weight = torch.bitwise_and(weight, maxq).reshape(-1, qweight.shape[1])  # [in, out]
    return (scales[g_idx] * (weight - zeros[g_idx]).float()).T.contiguous().numpy()


def reference_model(path: str, work_dir: str):
    """(transformers model, {tensor name: float32 weight}) of the checkpoint at `path`, dequantized
    in float32: compressed-tensors checkpoints by compressed-tensors (its decompressors, the scales
    first cast to float32, exactly, so that (q - zero) * scale is not rounded to their dtype), AWQ
    converted to compressed-tensors first by its AutoAWQ converter, GPTQ by AutoGPTQ's formula
    (gptq_dequantize)."""
    import torch
    from compressed_tensors.entrypoints.convert import convert_checkpoint
    from compressed_tensors.entrypoints.convert.converters import AutoAWQConverter, CompressedTensorsDequantizer
    from safetensors.numpy import load_file, save_file
    from safetensors.torch import load_file as load_torch
    from transformers import AutoModelForCausalLM

    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    qconfig = config.pop("quantization_config")
    if qconfig["quant_method"] == "gptq":
        state = load_file(os.path.join(path, "model.safetensors"))
        v1 = qconfig.get("checkpoint_format", "gptq") == "gptq"
        for name in [n for n in state if n.endswith(".qweight")]:
            module = name.removesuffix(".qweight")
            state[f"{module}.weight"] = gptq_dequantize(
                state.pop(name), state.pop(f"{module}.qzeros"), state.pop(f"{module}.scales"),
                state.pop(f"{module}.g_idx"), qconfig["bits"], v1)
    else:
        if qconfig["quant_method"] == "awq":
            ct_dir = os.path.join(work_dir, "awq_as_compressed_tensors")
            convert_checkpoint(path, ct_dir, AutoAWQConverter.from_autoawq_config(qconfig), device="cpu")
            path = ct_dir
            with open(os.path.join(path, "config.json")) as f:
                qconfig = json.load(f)["quantization_config"]
        tensors = {}
        for file in sorted(f for f in os.listdir(path) if f.endswith(".safetensors")):
            tensors.update(load_torch(os.path.join(path, file)))
        tensors = {k: v.float() if k.endswith("weight_scale") else v for k, v in tensors.items()}
        dequantizer = CompressedTensorsDequantizer(path, dtype=torch.float32)
        for name, scheme in dequantizer.quant_config.config_groups.items():
            scheme.format = qconfig["config_groups"][name].get("format") or qconfig["format"]  # not inferred
            # by tensor names alone, "Linear" would also take the embedding's "weight": the Linears
            # of Llama, Qwen and Mixtral's experts (w1, w2, w3)
            scheme.targets = [r"re:.*(_proj|lm_head|\.w[123])$" if t == "Linear" else t for t in scheme.targets]
        state = {k: (v.float() if v.is_floating_point() else v).numpy()
                 for k, v in dequantizer.process(tensors).items()}
    float_dir = os.path.join(work_dir, "dequantized")
    os.makedirs(float_dir)
    with open(os.path.join(float_dir, "config.json"), "w") as f:
        json.dump(config, f)
    save_file(state, os.path.join(float_dir, "model.safetensors"))
    model = AutoModelForCausalLM.from_pretrained(float_dir, torch_dtype=torch.float32).eval()
    return model, {k: v.astype(np.float32) for k, v in state.items()}
