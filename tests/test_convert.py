"""Checkpoint conversion: HF safetensors and GGUF -> orbax pytree, exact against the sources."""
import json
import os

import gguf
import numpy as np
import pytest
import torch
from absl import flags
from safetensors.torch import save_file
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from checkpoints import ConversionError
from checkpoints.convert import convert_checkpoint
from checkpoints.default_model import resolve_model, smollm2_gguf_path
from checkpoints.load import load_config, load_params, load_tokenizer
from jaxserve.commands import convert as convert_command

pytestmark = pytest.mark.slow  # conversions checked against transformers: out of `make test-quick`

Q = gguf.GGMLQuantizationType
TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + [chr(c) for c in range(97, 123)] + ["Ġ", "ab", "cd", "Ġa"]
MERGES = ["a b", "c d", "Ġ a"]
CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"
HF_TO_OURS = {  # HF per-layer key -> our stacked leaf (all transposed except norms and biases)
    "input_layernorm.weight": "attn_norm", "self_attn.q_proj.weight": "wq", "self_attn.k_proj.weight": "wk",
    "self_attn.v_proj.weight": "wv", "self_attn.o_proj.weight": "wo", "self_attn.q_proj.bias": "bq",
    "self_attn.k_proj.bias": "bk", "self_attn.v_proj.bias": "bv", "post_attention_layernorm.weight": "mlp_norm",
    "mlp.gate_proj.weight": "w_gate", "mlp.up_proj.weight": "w_up", "mlp.down_proj.weight": "w_down",
}
HF_TO_GGUF = {
    "input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight", "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias", "self_attn.v_proj.bias": "attn_v.bias",
}


def tiny_model(tied=False, num_kv_heads=2, qwen2=False, vocab_size=len(TOKENS), seed=0):
    """A tiny random model; every parameter (norms too) drawn from N(0, 1)."""
    torch.manual_seed(seed)
    kwargs = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=num_kv_heads, tie_word_embeddings=tied,
                  max_position_embeddings=128, rope_theta=50000.0, rms_norm_eps=1e-6)
    model = Qwen2ForCausalLM(Qwen2Config(**kwargs)) if qwen2 else LlamaForCausalLM(LlamaConfig(**kwargs))
    with torch.no_grad():
        for param in model.parameters():
            param.normal_()
    return model


def expected_pytree(state: dict, num_layers: int, tied: bool) -> dict:
    """The pytree our converter must produce from HF tensors: [out, in] -> [in, out], layers stacked."""
    tree = {"embed": state["model.embed_tokens.weight"], "final_norm": state["model.norm.weight"], "layers": {}}
    if not tied:
        tree["lm_head"] = state["lm_head.weight"].T
    for hf_key, ours in HF_TO_OURS.items():
        if f"model.layers.0.{hf_key}" in state:
            per_layer = [state[f"model.layers.{i}.{hf_key}"] for i in range(num_layers)]
            tree["layers"][ours] = np.stack([w.T if w.ndim == 2 else w for w in per_layer])
    return tree


def assert_tree_equal(params, expected):
    assert set(params) == set(expected) and set(params["layers"]) == set(expected["layers"])
    for key in expected:
        if key != "layers":
            np.testing.assert_array_equal(np.asarray(params[key], np.float32), expected[key], err_msg=key)
    for key, value in expected["layers"].items():
        np.testing.assert_array_equal(np.asarray(params["layers"][key], np.float32), value, err_msg=key)


def numpy_state(model) -> dict:
    return {k: v.detach().float().numpy() for k, v in model.state_dict().items()}


def llama_cpp_permute(rows: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's Q/K row order for rotary (its converter's `permute`), what GGUF files hold."""
    grouped = rows.reshape(num_heads, 2, rows.shape[0] // num_heads // 2, *rows.shape[1:])
    return grouped.swapaxes(1, 2).reshape(rows.shape)


def add_model_header(writer, cfg, rope_theta: float) -> None:
    """The shape keys of a transformers config `cfg` as llama.cpp writes them into a GGUF header."""
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(rope_theta)


def write_gguf(path, model, qtype=Q.F32, arch="llama", drop=(), replace=None, raw_types=None):
    """Writes `model` as llama.cpp would: permuted Q/K rows, F32 norms, 2-D weights as `qtype`."""
    cfg = model.config
    state = numpy_state(model)
    writer = gguf.GGUFWriter(str(path), arch)
    add_model_header(writer, cfg, rope_theta=50000.0)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(TOKENS)
    writer.add_token_types([3, 3, 3] + [1] * (len(TOKENS) - 3))
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_chat_template(CHAT_TEMPLATE)
    tensors = {"token_embd.weight": state["model.embed_tokens.weight"],
               "output_norm.weight": state["model.norm.weight"]}
    if not cfg.tie_word_embeddings:
        tensors["output.weight"] = state["lm_head.weight"]
    for i in range(cfg.num_hidden_layers):
        for hf_key, gguf_key in HF_TO_GGUF.items():
            if f"model.layers.{i}.{hf_key}" not in state:
                continue
            value = state[f"model.layers.{i}.{hf_key}"]
            if gguf_key.startswith("attn_q.") and arch == "llama":
                value = llama_cpp_permute(value, cfg.num_attention_heads)
            elif gguf_key.startswith("attn_k.") and arch == "llama":
                value = llama_cpp_permute(value, cfg.num_key_value_heads)
            tensors[f"blk.{i}.{gguf_key}"] = value
    tensors.update(replace or {})
    for name, value in tensors.items():
        if name in drop:
            continue
        raw_type = (raw_types or {}).get(name)
        if raw_type is not None:
            writer.add_tensor(name, value, raw_dtype=raw_type)
        elif value.ndim == 1 or qtype in (Q.F32, Q.F16):
            writer.add_tensor(name, gguf.quants.quantize(value, Q.F32 if value.ndim == 1 else qtype))
        else:
            writer.add_tensor(name, gguf.quants.quantize(value, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def quantized_roundtrip(state: dict, qtype) -> dict:
    """HF tensors as a GGUF of `qtype` stores them (norms stay F32)."""
    return {k: v if v.ndim == 1 else gguf.quants.dequantize(gguf.quants.quantize(v, qtype), qtype).reshape(v.shape)
            for k, v in state.items()}


# ---- Hugging Face folders ---------------------------------------------------------------------

@pytest.mark.parametrize("tied,num_kv_heads,shard", [(False, 2, False), (True, 4, True), (False, 1, True)])
def test_hf_conversion_is_exact(tmp_path, tied, num_kv_heads, shard):
    model = tiny_model(tied=tied, num_kv_heads=num_kv_heads)
    model.save_pretrained(tmp_path / "hf", max_shard_size="20KB" if shard else "1GB")
    assert os.path.isfile(tmp_path / "hf" / "model.safetensors.index.json") == shard
    config = convert_checkpoint(str(tmp_path / "hf"), str(tmp_path / "out"))
    assert (config.tie_word_embeddings, config.num_kv_heads, config.rope_theta) == (tied, num_kv_heads, 50000.0)
    assert load_config(str(tmp_path / "out")) == config
    params = load_params(str(tmp_path / "out"), "float32")
    assert_tree_equal(params, expected_pytree(numpy_state(model), 2, tied))
    marker = json.loads((tmp_path / "out" / "jaxserve.json").read_text())
    assert (marker["source_format"], marker["dtype"], marker["has_tokenizer"]) == ("hf", "float32", False)
    assert load_tokenizer(str(tmp_path / "out")) is None


def test_hf_bfloat16_qwen2_biases_and_tokenizer_copy(tmp_path):
    model = tiny_model(qwen2=True).to(torch.bfloat16)
    model.save_pretrained(tmp_path / "hf")
    AutoTokenizer.from_pretrained(tmp_path, gguf_file=os.path.basename(
        write_gguf(tmp_path / "tok.gguf", tiny_model()))).save_pretrained(tmp_path / "hf")
    config = convert_checkpoint(str(tmp_path / "hf"), str(tmp_path / "out"))
    assert config.architecture == "Qwen2ForCausalLM" and config.attention_bias
    assert json.loads((tmp_path / "out" / "jaxserve.json").read_text())["dtype"] == "bfloat16"
    params = load_params(str(tmp_path / "out"), "bfloat16")
    assert params["layers"]["bq"].dtype == np.dtype("bfloat16") and params["layers"]["bq"].shape == (2, 64)
    assert_tree_equal(params, expected_pytree(numpy_state(model), 2, tied=False))
    tokenizer = load_tokenizer(str(tmp_path / "out"))
    assert tokenizer.convert_ids_to_tokens(tokenizer("ab cd a")["input_ids"]) == ["ab", "Ġ", "cd", "Ġa"]


# ---- GGUF files -------------------------------------------------------------------------------

def transformers_gguf_tensors(path: str, converted_dir: str) -> dict:
    """What transformers' own GGUF loader makes of `path` (HF names, [out, in], Q/K un-permuted)."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    with torch.device("meta"):
        skeleton = LlamaForCausalLM(LlamaConfig(**json.loads(open(os.path.join(converted_dir, "config.json")).read())))
    loaded = load_gguf_checkpoint(path, return_tensors=True, model_to_load=skeleton)["tensors"]
    return {k: np.asarray(v, np.float32) for k, v in loaded.items()}


@pytest.mark.parametrize("qtype,tied", [(Q.F32, False), (Q.F16, True), (Q.BF16, False), (Q.Q8_0, False),
                                        (Q.Q4_0, True), (Q.Q4_1, False)], ids=lambda v: getattr(v, "name", str(v)))
def test_gguf_conversion_matches_source_and_transformers(tmp_path, qtype, tied):
    model = tiny_model(tied=tied)
    path = write_gguf(tmp_path / "tiny.gguf", model, qtype)
    config = convert_checkpoint(path, str(tmp_path / "out"))
    assert (config.tie_word_embeddings, config.num_q_heads, config.num_kv_heads) == (tied, 4, 2)
    assert (config.vocab_size, config.bos_token_id, config.eos_token_ids) == (len(TOKENS), 1, (2,))
    assert (config.rope_theta, config.rms_norm_eps) == (50000.0, 1e-6)
    params = load_params(str(tmp_path / "out"), "float32")
    state = numpy_state(model)
    expected = quantized_roundtrip(state, qtype)
    if qtype in (Q.F32, Q.F16, Q.BF16):  # exact up to the storage type of the file
        np.testing.assert_allclose(expected["model.embed_tokens.weight"], state["model.embed_tokens.weight"],
                                   rtol=1e-2 if qtype == Q.BF16 else 1e-3)
    assert_tree_equal(params, expected_pytree(expected, 2, tied))
    assert_tree_equal(params, expected_pytree(transformers_gguf_tensors(path, str(tmp_path / "out")), 2, tied))


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_gguf_attention_biases(tmp_path, arch):
    """qwen2 files keep HF's Q/K order; llama files permute Q/K biases like the weights."""
    model = tiny_model(qwen2=True)
    config = convert_checkpoint(write_gguf(tmp_path / "b.gguf", model, arch=arch), str(tmp_path / "out"))
    assert config.attention_bias
    assert config.architecture == {"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM"}[arch]
    assert_tree_equal(load_params(str(tmp_path / "out"), "float32"), expected_pytree(numpy_state(model), 2, False))


def test_gguf_tokenizer_with_chat_template(tmp_path):
    path = write_gguf(tmp_path / "tiny.gguf", tiny_model(), Q.Q8_0)
    convert_checkpoint(path, str(tmp_path / "out"))
    tokenizer = load_tokenizer(str(tmp_path / "out"))
    assert tokenizer.convert_ids_to_tokens(tokenizer("ab cd a")["input_ids"]) == ["ab", "Ġ", "cd", "Ġa"]
    text = tokenizer.apply_chat_template([{"role": "user", "content": "ab"}], tokenize=False)
    assert text == "<|im_start|>ab<|im_end|>"


LLAMA32_SCALING = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192}


def test_llama3_rope_divisors_match_transformers():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from checkpoints.rope_freqs import llama3_frequency_divisors
    hf_config = LlamaConfig(hidden_size=2048, num_attention_heads=32, max_position_embeddings=131072,
                            rope_parameters={"rope_theta": 500000.0, **LLAMA32_SCALING})
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_config, "cpu")
    unscaled = 1.0 / 500000.0 ** (np.arange(0, 64, 2) / 64)
    divisors = llama3_frequency_divisors(500000.0, 64, LLAMA32_SCALING)
    assert divisors.min() == 1.0 and divisors.max() == 32.0
    np.testing.assert_allclose(unscaled / divisors, scaled.double().numpy(), rtol=1e-6)


@pytest.mark.parametrize("factors,expected", [("llama32", LLAMA32_SCALING), ("ones", None), ("garbage", "error")])
def test_gguf_rope_freqs_become_rope_scaling(tmp_path, factors, expected):
    from checkpoints.rope_freqs import llama3_frequency_divisors
    values = {"llama32": llama3_frequency_divisors(50000.0, 16, LLAMA32_SCALING), "ones": np.ones(8),
              "garbage": np.linspace(1, 3, 8)}[factors].astype(np.float32)
    path = write_gguf(tmp_path / "r.gguf", tiny_model(), replace={"rope_freqs.weight": values})
    if expected == "error":
        with pytest.raises(ConversionError, match="rope_freqs.weight"):
            convert_checkpoint(path, str(tmp_path / "out"))
    else:
        assert convert_checkpoint(path, str(tmp_path / "out")).rope_scaling == expected
        assert load_config(str(tmp_path / "out")).rope_scaling == expected


def test_smollm2_default_model_matches_transformers():
    model_dir = resolve_model("smollm2")
    assert resolve_model("smollm2") == model_dir and resolve_model(model_dir) == model_dir
    config = load_config(model_dir)
    assert (config.num_layers, config.num_q_heads, config.num_kv_heads, config.vocab_size) == (30, 9, 3, 49152)
    assert config.tie_word_embeddings and config.eos_token_ids == (2,)
    params = load_params(model_dir, "float32")
    reference = transformers_gguf_tensors(smollm2_gguf_path(), model_dir)
    for layer in (0, 29):
        for hf_key in ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "mlp.down_proj.weight"):
            np.testing.assert_array_equal(np.asarray(params["layers"][HF_TO_OURS[hf_key]][layer]),
                                          reference[f"model.layers.{layer}.{hf_key}"].T, err_msg=hf_key)
    np.testing.assert_array_equal(np.asarray(params["embed"]), reference["model.embed_tokens.weight"])
    assert "<|im_start|>assistant" in load_tokenizer(model_dir).apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)


def test_resolve_model_converts_sources_once(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXSERVE_CACHE", str(tmp_path / "cache"))
    path = write_gguf(tmp_path / "tiny.gguf", tiny_model(), Q.F16)
    model_dir = resolve_model(path)
    assert model_dir.startswith(str(tmp_path / "cache")) and os.path.isfile(os.path.join(model_dir, "jaxserve.json"))
    stamp = os.stat(os.path.join(model_dir, "jaxserve.json")).st_mtime_ns
    assert resolve_model(path) == model_dir
    assert os.stat(os.path.join(model_dir, "jaxserve.json")).st_mtime_ns == stamp
    with pytest.raises(ConversionError, match="not a known model name"):
        resolve_model(str(tmp_path / "missing"))


# ---- bad input --------------------------------------------------------------------------------

def _truncate(path, fraction=0.6):
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(int(size * fraction))
    return str(path)


def _hf_folder(tmp_path, edit=None, config_edit=None):
    model = tiny_model()
    model.save_pretrained(tmp_path / "hf")
    if edit is not None:
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        edit(state)
        save_file(state, str(tmp_path / "hf" / "model.safetensors"))
    if config_edit is not None:
        config = json.loads((tmp_path / "hf" / "config.json").read_text())
        config_edit(config)
        (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    return str(tmp_path / "hf")


def _bad_ffn_gate(model):
    return {"blk.1.ffn_gate.weight": np.zeros((128, 32), np.float32)}


BAD_SOURCES = {  # name -> (build source, words the message must contain)
    "missing file": (lambda p: str(p / "nope.gguf"), ["nope.gguf", "no such file"]),
    "missing folder config": (lambda p: (os.mkdir(p / "empty"), str(p / "empty"))[1], ["config.json"]),
    "not gguf": (lambda p: ((p / "x.gguf").write_bytes(b"hello world"), str(p / "x.gguf"))[1], ["x.gguf", "GGUF"]),
    "truncated gguf": (lambda p: _truncate(write_gguf(p / "t.gguf", tiny_model())), ["t.gguf", "truncated"]),
    "truncated safetensors": (lambda p: (_truncate(os.path.join(_hf_folder(p), "model.safetensors")), str(p / "hf"))[1],
                              ["model.safetensors", "truncated"]),
    "gguf architecture": (lambda p: write_gguf(p / "a.gguf", tiny_model(), arch="gpt2"),
                          ["a.gguf", "unsupported architecture 'gpt2'"]),
    "hf architecture": (lambda p: _hf_folder(p, config_edit=lambda c: c.update(architectures=["GPT2LMHeadModel"])),
                        ["config.json", "unsupported architecture 'GPT2LMHeadModel'"]),
    "quant type": (lambda p: write_gguf(p / "q.gguf", tiny_model(), Q.Q8_0, raw_types={"blk.0.ffn_up.weight": Q.IQ4_NL},
                                        replace={"blk.0.ffn_up.weight": np.zeros((128, 2 * 18), np.uint8)}),
                   ["q.gguf", "blk.0.ffn_up.weight", "IQ4_NL"]),
    "gguf shape": (lambda p: write_gguf(p / "s.gguf", tiny_model(), replace=_bad_ffn_gate(None)),
                   ["s.gguf", "blk.1.ffn_gate.weight", "shape (128, 32)", "expected (128, 64)"]),
    "hf shape": (lambda p: _hf_folder(p, edit=lambda s: s.update(
                     {"model.layers.1.self_attn.q_proj.weight": torch.zeros(32, 64)})),
                 ["model.safetensors", "model.layers.1.self_attn.q_proj.weight", "expected (64, 64)"]),
    "gguf missing tensor": (lambda p: write_gguf(p / "m.gguf", tiny_model(), drop={"blk.1.ffn_up.weight"}),
                            ["m.gguf", "missing tensor 'blk.1.ffn_up.weight'"]),
    "hf missing tensor": (lambda p: _hf_folder(p, edit=lambda s: s.pop("model.layers.0.mlp.up_proj.weight")),
                          ["missing tensor 'model.layers.0.mlp.up_proj.weight'"]),
    "hf unexpected tensor": (lambda p: _hf_folder(p, edit=lambda s: s.update(
                                 {"model.layers.0.mlp.gate_proj.bias": torch.zeros(128)})),
                             ["unexpected tensor 'model.layers.0.mlp.gate_proj.bias'"]),
}


def run_convert_command(argv):
    fv = flags.FlagValues()
    convert_command.define_flags(fv)
    fv(["jaxserve convert"] + argv)
    return convert_command.run(fv)


@pytest.mark.parametrize("case", list(BAD_SOURCES))
def test_bad_sources_fail_cleanly(tmp_path, capsys, case):
    build, words = BAD_SOURCES[case]
    source = build(tmp_path)
    output = tmp_path / "out" / "model"
    with pytest.raises(ConversionError) as error:
        convert_checkpoint(source, str(output))
    for word in words:
        assert word in str(error.value)
    capsys.readouterr()
    assert run_convert_command([f"--source={source}", f"--output={output}"]) == 2
    stderr = capsys.readouterr().err
    assert stderr.startswith("jaxserve convert: ") and all(word in stderr for word in words)
    assert "Traceback" not in stderr
    assert not output.exists()
    assert not (tmp_path / "out").exists() or os.listdir(tmp_path / "out") == []  # no staging left


def test_command_converts_and_refuses_to_overwrite(tmp_path, capsys):
    path = write_gguf(tmp_path / "tiny.gguf", tiny_model(), Q.Q4_1)
    output = tmp_path / "out"
    assert run_convert_command([f"--source={path}", f"--output={output}", "--dtype=bfloat16"]) == 0
    assert "LlamaForCausalLM, 2 layers" in capsys.readouterr().out
    assert json.loads((output / "jaxserve.json").read_text())["dtype"] == "bfloat16"
    params = load_params(str(output), "float32")
    expected = quantized_roundtrip(numpy_state(tiny_model()), Q.Q4_1)["model.layers.1.mlp.down_proj.weight"].T
    np.testing.assert_array_equal(np.asarray(params["layers"]["w_down"][1]),
                                  expected.astype("bfloat16").astype(np.float32))
    assert run_convert_command([f"--source={path}", f"--output={output}"]) == 2
    assert "already exists" in capsys.readouterr().err
    assert run_convert_command([f"--source={path}", f"--output={output}", "--overwrite", "--dtype=float32"]) == 0
    assert json.loads((output / "jaxserve.json").read_text())["dtype"] == "float32"
    assert sorted(os.listdir(tmp_path)) == ["out", "tiny.gguf"]
    assert run_convert_command([f"--output={output}"]) == 2


def test_load_params_with_shardings_and_dtype(tmp_path):
    import jax
    model = tiny_model(tied=True)
    model.save_pretrained(tmp_path / "hf")
    convert_checkpoint(str(tmp_path / "hf"), str(tmp_path / "out"), dtype="bfloat16")
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[-1])
    shapes = jax.tree.map(lambda x: x, load_params(str(tmp_path / "out"), "float32"))
    shardings = jax.tree.map(lambda _: sharding, shapes)
    params = load_params(str(tmp_path / "out"), "float16", shardings=shardings)
    assert all(x.dtype == np.float16 and x.sharding == sharding for x in jax.tree.leaves(params))
    expected = numpy_state(model)["model.layers.1.mlp.up_proj.weight"].T
    np.testing.assert_array_equal(np.asarray(params["layers"]["w_up"][1]),
                                  expected.astype("bfloat16").astype(np.float16))
    with pytest.raises(ConversionError, match="shardings"):
        load_params(str(tmp_path / "out"), "float32", shardings={"embed": sharding})
    with pytest.raises(ConversionError, match="not a converted jaxserve model"):
        load_params(str(tmp_path / "hf"), "float32")
