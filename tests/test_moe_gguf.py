"""Mixture-of-experts GGUF files (Mixtral as llama.cpp's arch "llama" with an expert count,
"qwen2moe", "qwen3moe") against transformers on the same weights (float32).

Each file is written here with gguf.GGUFWriter from a tiny random transformers model, the way
llama.cpp's converter lays it out: Q/K rows permuted for "llama", the experts of a layer as one
tensor each `ffn_{gate,up,down}_exps` [E, out, in], the router `ffn_gate_inp`, Qwen2-MoE's
shared expert `ffn_*_shexp` and its gate `ffn_gate_inp_shexp` (written [D], as llama.cpp
declares it). Converted by jaxserve, the logits must match transformers' within 1e-4.
"""
import dataclasses

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from checkpoints import ConversionError
from checkpoints.convert import convert_checkpoint
from checkpoints.load import load_config, load_params
from jaxserve.models import llama
from tests.test_convert import add_model_header, llama_cpp_permute
from tests.test_moe import SEED, make_moe_model
from tests.tiny_models import hf_logits, prefill_batch

pytestmark = pytest.mark.slow  # GGUF models against transformers: out of `make test-quick`

Q = gguf.GGMLQuantizationType
CASES = {  # name: (family, GGUF architecture, extra transformers config fields)
    "mixtral": ("mixtral", "llama", {"sliding_window": None}),
    "qwen2_moe": ("qwen2_moe", "qwen2moe", {}),
    "qwen3_moe": ("qwen3_moe", "qwen3moe", {}),
    "qwen3_moe-mlp_only0": ("qwen3_moe", "qwen3moe", {"mlp_only_layers": [0]}),
}
ATTENTION = {"input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
             "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
             "self_attn.o_proj.weight": "attn_output.weight", "self_attn.q_proj.bias": "attn_q.bias",
             "self_attn.k_proj.bias": "attn_k.bias", "self_attn.v_proj.bias": "attn_v.bias",
             "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
             "post_attention_layernorm.weight": "ffn_norm.weight",
             "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
             "mlp.down_proj.weight": "ffn_down.weight",
             "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
             "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
             "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight"}


def gguf_tensors(model, arch: str, qtype=Q.F32) -> dict[str, np.ndarray]:
    """The model's tensors under llama.cpp's names and layout (numpy [out, in] order)."""
    cfg = model.config
    state = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    out = {"token_embd.weight": state["model.embed_tokens.weight"], "output_norm.weight": state["model.norm.weight"],
           "output.weight": state["lm_head.weight"]}
    for i in range(cfg.num_hidden_layers):
        layer = lambda key: state.get(f"model.layers.{i}.{key}")
        for hf_key, name in ATTENTION.items():
            value = layer(hf_key)
            if value is None:
                continue
            if arch == "llama" and name.startswith(("attn_q.", "attn_k.")):
                value = llama_cpp_permute(value, cfg.num_attention_heads if name.startswith("attn_q.")
                                          else cfg.num_key_value_heads)
            out[f"blk.{i}.{name}"] = value
        gate_up = layer("mlp.experts.gate_up_proj")  # transformers 5's fused experts [E, 2F, D]
        if gate_up is not None:
            F = gate_up.shape[1] // 2
            out.update({f"blk.{i}.ffn_gate_inp.weight": layer("mlp.gate.weight"),  # [E, D]
                        f"blk.{i}.ffn_gate_exps.weight": gate_up[:, :F], f"blk.{i}.ffn_up_exps.weight": gate_up[:, F:],
                        f"blk.{i}.ffn_down_exps.weight": layer("mlp.experts.down_proj")})  # [E, D, F]
        if layer("mlp.shared_expert_gate.weight") is not None:
            out[f"blk.{i}.ffn_gate_inp_shexp.weight"] = layer("mlp.shared_expert_gate.weight")[0]  # [D]
    return out


def write_moe_gguf(path, model, arch: str, qtype=Q.F32, metadata: dict | None = None, drop=()) -> str:
    cfg = model.config
    writer = gguf.GGUFWriter(str(path), arch)
    add_model_header(writer, cfg, rope_theta=cfg.rope_parameters["rope_theta"])
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_expert_count(getattr(cfg, "num_local_experts", None) or cfg.num_experts)
    writer.add_expert_used_count(cfg.num_experts_per_tok)
    if arch != "llama":
        writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if arch == "qwen2moe":
        writer.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    for key, value in (metadata or {}).items():
        getattr(writer, f"add_{key}")(value)
    for name, value in gguf_tensors(model, arch).items():
        if name in drop:
            continue
        if value.ndim == 1 or qtype == Q.F32:
            writer.add_tensor(name, np.ascontiguousarray(value, np.float32))
        else:
            writer.add_tensor(name, gguf.quants.quantize(np.ascontiguousarray(value), qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def _forward_logits(converted: str, config=None) -> tuple[np.ndarray, list]:
    config = config or load_config(converted)
    params = load_params(converted, jnp.float32)
    batch, token_ids, num_pages = prefill_batch([11, 6, 3], 4, 4, config.vocab_size, np.random.default_rng(SEED))
    kv = llama.init_kv_cache(config, llama.KVCacheSpec(num_pages=num_pages, page_size=4), jnp.float32)
    batch = {k: jnp.asarray(v) for k, v in batch.items()}
    return np.asarray(jax.jit(lambda p, k, b: llama.forward(p, k, b, config=config)[0])(params, kv, batch)), token_ids


@pytest.mark.parametrize("case", list(CASES))
def test_moe_gguf_logits_match_transformers(tmp_path, case):
    family, arch, extra = CASES[case]
    model = make_moe_model(str(tmp_path / "hf"), family, **extra)
    config = convert_checkpoint(write_moe_gguf(tmp_path / "m.gguf", model, arch), str(tmp_path / "out"))
    hf = model.config
    assert config.architecture == type(model).__name__
    assert (config.num_experts, config.num_experts_per_tok) == (4, 2)
    assert config.norm_topk_prob == (family != "qwen2_moe")  # llama.cpp's default of each architecture
    assert config.mlp_only_layers == tuple(extra.get("mlp_only_layers", ()))
    assert config.shared_expert_intermediate_size == (hf.shared_expert_intermediate_size if arch == "qwen2moe" else 0)
    logits, token_ids = _forward_logits(str(tmp_path / "out"))
    expected = np.concatenate([hf_logits(model, ids[None])[0] for ids in token_ids])
    atol = 1e-4 * np.abs(expected).max()
    np.testing.assert_allclose(logits, expected, rtol=1e-4, atol=atol, err_msg=f"{case}, seed {SEED}")


def test_expert_weights_norm_in_the_file_overrides_the_family_default(tmp_path):
    """qwen2moe renormalises nothing by default; a file that says expert_weights_norm=true does."""
    model = make_moe_model(str(tmp_path / "hf"), "qwen2_moe")
    path = write_moe_gguf(tmp_path / "n.gguf", model, "qwen2moe", metadata={"expert_weights_norm": True})
    assert convert_checkpoint(path, str(tmp_path / "out")).norm_topk_prob is True


def test_quantized_experts_are_dequantized(tmp_path):
    """Q8_0 experts (and every other matrix) convert to their dequantized values (the dequantization
    every GGUF tensor goes through), not refused."""
    model = make_moe_model(str(tmp_path / "hf"), "qwen3_moe", moe_intermediate_size=32)  # Q8_0 rows: 32s
    path = write_moe_gguf(tmp_path / "q.gguf", model, "qwen3moe", Q.Q8_0)
    convert_checkpoint(path, str(tmp_path / "out"))
    params = load_params(str(tmp_path / "out"), jnp.float32)
    original = model.state_dict()["model.layers.1.mlp.experts.down_proj"].numpy()  # [E, D, F]
    got = np.swapaxes(np.asarray(params["layers"]["w_down_exps"][1]), -1, -2)  # [E, D, F]
    roundtrip = gguf.quants.dequantize(gguf.quants.quantize(original, Q.Q8_0), Q.Q8_0).reshape(original.shape)
    np.testing.assert_array_equal(got, roundtrip)
    assert np.abs(got - original).max() > 0  # the comparison tells the two apart


def test_q4_0_experts_are_copied_block_for_block_under_int4(tmp_path):
    """With --quantization=int4 a Q4_0 file's experts keep their blocks (int4_g32_sym, no float
    round trip): each expert's dequantized weight is gguf's dequantization of its tensor, and the
    model computes what the file's float conversion computes."""
    from jaxserve.models import quantization
    model = make_moe_model(str(tmp_path / "hf"), "qwen3_moe", moe_intermediate_size=32)  # Q4_0 rows: 32s
    path = write_moe_gguf(tmp_path / "q.gguf", model, "qwen3moe", Q.Q4_0)
    convert_checkpoint(path, str(tmp_path / "int4"), quantization="int4")
    convert_checkpoint(path, str(tmp_path / "float"))
    params = load_params(str(tmp_path / "int4"), jnp.float32)
    down = params["layers"]["w_down_exps"]
    assert quantization.weight_format(down).name == "int4_g32_sym"
    original = model.state_dict()["model.layers.1.mlp.experts.down_proj"].numpy()  # [E, D, F]
    expected = gguf.quants.dequantize(gguf.quants.quantize(original, Q.Q4_0), Q.Q4_0).reshape(original.shape)
    got = np.swapaxes(np.asarray(quantization.dequantize(down)[1]), -1, -2)  # [E, D, F]
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-6)
    assert np.abs(expected - original).max() > 0  # the comparison tells the two apart
    np.testing.assert_allclose(_forward_logits(str(tmp_path / "int4"))[0], _forward_logits(str(tmp_path / "float"))[0],
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("metadata,drop,message", [
    ({"expert_gating_func": gguf.ExpertGatingFuncType.SIGMOID}, (), "expert_gating_func"),
    ({"expert_weights_scale": 2.5}, (), "expert_weights_scale"),
    ({}, ("blk.1.ffn_up_exps.weight",), "missing tensor 'blk.1.ffn_up_exps.weight'"),
])
def test_moe_gguf_problems_are_named(tmp_path, metadata, drop, message):
    model = make_moe_model(str(tmp_path / "hf"), "qwen3_moe")
    path = write_moe_gguf(tmp_path / "bad.gguf", model, "qwen3moe", metadata=metadata, drop=drop)
    with pytest.raises(ConversionError, match=message):
        convert_checkpoint(path, str(tmp_path / "out"))
