"""Published quantized checkpoints (compressed-tensors, GPTQ, AWQ, FP8) converted as stored.

Each checkpoint is made here on the CPU from a tiny random Llama (tests/published_checkpoints.py:
compressed-tensors' own quantizer and compressor, GPTQ and AWQ packed as those libraries pack) and
dequantized by compressed-tensors (AWQ through its AutoAWQ converter; GPTQ by AutoGPTQ's formula)
into a float model that transformers runs: the reference. jaxserve converts the same folder:

- its weights dequantize to the reference's float weights bit for bit;
- its logits match transformers' within 1e-4 of the largest logit, and greedy decoding picks the
  same tokens (teacher-forced on transformers' greedy sequence, and through the engine);
- unsupported variants are refused with the config field named.
"""
import json
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytestmark = pytest.mark.slow  # published quantized formats against transformers, engines: out of `make test-quick`

pytest.importorskip("compressed_tensors")  # the test extra
torch = pytest.importorskip("torch")

from checkpoints import ConversionError  # noqa: E402
from checkpoints.convert import convert_checkpoint  # noqa: E402
from checkpoints.load import ModelSource  # noqa: E402
from jaxserve.core.request import SamplingParams  # noqa: E402
from jaxserve.engine import Engine, EngineConfig  # noqa: E402
from jaxserve.executor import device_setup
from jaxserve.models import quantization as qz  # noqa: E402
from jaxserve.models import cpu_layout, llama, weights  # noqa: E402
from tests import published_checkpoints as pc  # noqa: E402
from tests.test_convert import run_convert_command  # noqa: E402
from tests.tiny_models import hf_logits, make_tiny_hf_model, prefill_batch  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# inputs of 128 (hidden, 4 heads x 32) and 256 (MLP): groups of 32, 64 and 128 all fit
TINY = dict(hidden_size=128, intermediate_size=256, head_dim=32, num_q_heads=4, num_kv_heads=2)
PROMPT_LEN, GREEDY_TOKENS = 20, 12
LOGIT_TOLERANCE = 1e-4  # of the largest |logit|

# name: (writer, its arguments, the format every linear leaf is stored in)
CASES = {
    "w4a16_g128": ("ct", dict(bits=4, group=128), "int4_g128_sym_f32"),
    "w4a16_g32": ("ct", dict(bits=4, group=32), "int4_g32_sym_f32"),
    "w4a16_asym_g32": ("ct", dict(bits=4, group=32, symmetric=False), "int4_g32_izp_f32"),
    "w4a16_per_channel": ("ct", dict(bits=4, group=None), "int4_g128_sym_f32"),
    "w8a16": ("ct", dict(bits=8, group=None), "int8_f32"),
    "w8a16_asym_g64_naive": ("ct", dict(bits=8, group=64, symmetric=False, fmt="naive-quantized"),
                             "int8_g64_izp_f32"),
    "fp8_per_channel": ("ct", dict(bits=8, group=None, kind="float"), "fp8_f32"),
    "fp8_per_tensor": ("ct", dict(bits=8, group="tensor", kind="float"), "fp8_f32"),
    "w4a16_g128_bf16": ("ct_bf16", dict(bits=4, group=128), "int4_g128_sym_bf16"),
    "gptq": ("gptq", dict(group=32), "int4_g32_sym"),
    "gptq_act_order": ("gptq", dict(group=32, act_order=True, symmetric=False), "int4_g32_izp_actorder"),
    "gptq_act_order_sym_g64": ("gptq", dict(group=64, act_order=True), "int4_g64_sym_actorder"),
    "gptq_8bit_per_channel": ("gptq", dict(bits=8, group=-1), "int8"),
    "awq": ("awq", dict(group=32), "int4_g32_izp"),
}
ENGINE_CASES = ("w4a16_g128", "gptq_act_order", "awq")


def write_checkpoint(path: str, writer: str, kwargs: dict, seed: int = 0):
    model = make_tiny_hf_model(os.path.join(os.path.dirname(path), "float"), seed=seed, **TINY)
    if writer == "ct_bf16":
        pc.quantize_compressed_tensors(model.to(torch.bfloat16), path, **kwargs)
    elif writer == "ct":
        pc.quantize_compressed_tensors(model, path, **kwargs)
    elif writer == "gptq":
        pc.write_gptq(model, path, seed=seed, **kwargs)
    else:
        pc.write_awq(model, path, **kwargs)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """name -> (published folder, converted dir, reference model, reference float weights), made once."""
    cache = {}

    def get(name):
        if name not in cache:
            root = tmp_path_factory.mktemp(name)
            writer, kwargs, _ = CASES[name]
            source = str(root / "published")
            write_checkpoint(source, writer, kwargs, seed=list(CASES).index(name))
            os.makedirs(root / "reference")
            model, state = pc.reference_model(source, str(root / "reference"))
            convert_checkpoint(source, str(root / "converted"))
            cache[name] = (source, str(root / "converted"), model, state)
        return cache[name]
    return get


def greedy_reference(model, prompt: list[int], steps: int) -> list[int]:
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            tokens.append(int(model(torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens


def jaxserve_logits(params, config, sequences):
    batch, _, num_pages = prefill_batch([len(s) for s in sequences], 8, 8, config.vocab_size,
                                        np.random.default_rng(0))
    batch["token_ids"] = np.concatenate(sequences).astype(np.int32)
    cache = llama.init_kv_cache(config, llama.KVCacheSpec(num_pages, 8), jnp.float32)
    logits, _ = jax.jit(lambda p, c, b: llama.forward(p, c, b, config=config))(params, cache, batch)
    logits, out, start = np.asarray(logits), [], 0
    for s in sequences:
        out.append(logits[start:start + len(s)])
        start += len(s)
    return out


def stored_layer_weights(params, leaf: str) -> np.ndarray:
    """[..., out, in] float32 of a stored leaf ([L, out, in]; experts [L, E, out, in]), dequantized
    by jaxserve, rows back in input order."""
    weight = params["layers"][leaf]
    if not isinstance(weight, qz.QuantArray):
        return np.swapaxes(np.asarray(weight, np.float32), -1, -2)
    values = np.asarray(qz.dequantize(weight))  # [..., in, out], rows in their stored order
    if weight.perm is not None:  # row i holds input perm[i]: input j is at row argsort(perm)[j]
        rows = np.argsort(np.asarray(weight.perm), axis=-1)[..., None]  # [..., in, 1]
        values = np.take_along_axis(values, rows, axis=-2)
    return np.swapaxes(values, -1, -2)


@pytest.mark.parametrize("name", list(CASES))
def test_weights_dequantize_bit_for_bit_like_the_reference(converted, name):
    _, model_dir, _, reference = converted(name)
    source = ModelSource.open(model_dir)
    expected_format = CASES[name][2]
    assert source.quantization == dict.fromkeys(weights.linear_leaves(source.config), expected_format)
    params = source.load_params(jnp.float32)
    assert qz.params_formats(params) == source.quantization  # the arrays say the same
    infos = {info.name: info for info in weights.weight_infos(source.config).values()}
    for leaf in weights.linear_leaves(source.config):
        got = stored_layer_weights(params, leaf)
        for layer in range(source.config.num_layers):
            want = reference[f"model.layers.{layer}.{infos[leaf].hf}"]
            assert got[layer].view(np.uint32).tolist() == want.view(np.uint32).tolist(), (leaf, layer)


@pytest.mark.parametrize("name", list(CASES))
def test_logits_and_greedy_tokens_match_transformers(converted, name):
    _, model_dir, model, _ = converted(name)
    check_logits_and_greedy_tokens(model_dir, model)


def check_logits_and_greedy_tokens(model_dir: str, model) -> None:
    """The converted `model_dir`'s logits over transformers' greedy continuations of two random
    prompts equal the reference `model`'s (LOGIT_TOLERANCE), and its top token at every generated
    position is transformers' next token."""
    source = ModelSource.open(model_dir)
    params = source.load_params(jnp.float32)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, source.config.vocab_size, n).tolist() for n in (PROMPT_LEN, 7)]
    sequences = [greedy_reference(model, p, GREEDY_TOKENS) for p in prompts]
    for sequence, got in zip(sequences, jaxserve_logits(params, source.config, sequences)):
        want = hf_logits(model, np.asarray([sequence]))[0]
        np.testing.assert_allclose(got, want, rtol=0, atol=LOGIT_TOLERANCE * np.abs(want).max())
        # greedy: at every generated position jaxserve's top token is transformers' next token
        start = len(sequence) - GREEDY_TOKENS - 1
        assert got[start:-1].argmax(-1).tolist() == sequence[start + 1:]


@pytest.mark.parametrize("name", ENGINE_CASES)
def test_engine_greedy_decoding_matches_transformers(converted, name):
    _, model_dir, model, _ = converted(name)
    source = ModelSource.open(model_dir)
    engine = Engine(source.config, source.load_params(jnp.float32), None, EngineConfig(
        max_num_seqs=4, max_num_batched_tokens=64, page_size=8, num_pages=32, max_model_len=64, warmup=False))
    rng = np.random.default_rng(2)
    prompts = [rng.integers(3, source.config.vocab_size, n).tolist() for n in (PROMPT_LEN, 5, 11)]
    params = SamplingParams(max_tokens=GREEDY_TOKENS, temperature=0.0, ignore_eos=True)
    got = [r.token_ids for r in engine.generate(prompts, params)]
    assert got == [greedy_reference(model, p, GREEDY_TOKENS)[len(p):] for p in prompts]


def test_codes_unpack_like_compressed_tensors():
    """The GPTQ / AWQ packing the fixtures write, read back by compressed-tensors' own unpacking
    (GPTQ packs along the input like its pack_to_int32 with packed_dim=0) and AutoAWQ converter."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from compressed_tensors.entrypoints.convert.converters import AutoAWQConverter
    rng = np.random.default_rng(3)
    codes = rng.integers(0, 16, (64, 48)).astype(np.uint8)  # [in, out]
    qweight = pc._pack(codes.T.copy(), 4).T.copy()  # GPTQ: [in / 8, out]
    unpacked = unpack_from_int32(torch.from_numpy(qweight), 4, torch.Size((64, 48)), packed_dim=0)
    np.testing.assert_array_equal(unpacked.numpy() + 8, codes)
    awq = pc._pack(codes, 4, pc.AWQ_ORDER)  # AWQ: [in, out / 8]
    iweight, _ = AutoAWQConverter.unpack_awq(torch.from_numpy(awq), None, 4)
    iweight, _ = AutoAWQConverter.reverse_awq_order(iweight, None, 4)
    np.testing.assert_array_equal(iweight.numpy() & 0xF, codes)


def test_transformers_loads_the_compressed_tensors_folder_alike(converted):
    """transformers' own compressed-tensors loader gives the reference's logits (symmetric W4A16)."""
    from transformers import AutoModelForCausalLM
    source, _, reference, _ = converted("w4a16_g128")
    direct = AutoModelForCausalLM.from_pretrained(source).eval()
    tokens = np.arange(3, 3 + PROMPT_LEN)[None]
    np.testing.assert_array_equal(hf_logits(direct, tokens), hf_logits(reference, tokens))


def test_ignored_and_quantized_lm_head_layers(tmp_path):
    """An ignored layer stays float: its leaf, quantized in the other layers, is stored float
    (dequantized exactly); a quantized lm_head (not in ignore) is dequantized into the float lm_head."""
    source = str(tmp_path / "published")
    model = make_tiny_hf_model(str(tmp_path / "float"), seed=5, **TINY)
    float_down = model.model.layers[0].mlp.down_proj.weight.detach().numpy().copy()
    pc.quantize_compressed_tensors(model, source, bits=4, group=32, ignore=[r"re:model\.layers\.0\.mlp\.down_proj$"])
    os.makedirs(tmp_path / "reference")
    reference, state = pc.reference_model(source, str(tmp_path / "reference"))
    convert_checkpoint(source, str(tmp_path / "converted"))
    model_source = ModelSource.open(str(tmp_path / "converted"))
    assert "w_down" not in model_source.quantization and model_source.quantization["wq"] == "int4_g32_sym_f32"
    params = model_source.load_params(jnp.float32)
    np.testing.assert_array_equal(np.asarray(params["layers"]["w_down"][0]).T, float_down)
    np.testing.assert_array_equal(np.asarray(params["layers"]["w_down"][1]).T,
                                  state["model.layers.1.mlp.down_proj.weight"])
    np.testing.assert_array_equal(np.asarray(params["lm_head"]).T, state["lm_head.weight"])
    tokens = np.arange(3, 3 + PROMPT_LEN)
    want = hf_logits(reference, tokens[None])[0]
    got = jaxserve_logits(params, model_source.config, [tokens])[0]
    np.testing.assert_allclose(got, want, rtol=0, atol=LOGIT_TOLERANCE * np.abs(want).max())


def test_planner_and_engine_count_the_stored_bytes(converted):
    from jaxserve.commands.plan import _measured_weights_bytes
    _, model_dir, _, _ = converted("gptq_act_order")
    source = ModelSource.open(model_dir)
    params = source.load_params(jnp.float32)
    config = source.config
    L, D, F, q, kv = (config.num_layers, config.hidden_size, config.intermediate_size, config.q_size,
                      config.kv_size)
    linear = [(D, q), (D, kv), (D, kv), (q, D), (D, F), (D, F), (F, D)]
    # int4 codes, float16 scales, uint8 zero points per group of 32, an int32 per input (perm)
    quantized = L * sum(i * o // 2 + (i // 32) * o * (2 + 1) + 4 * i for i, o in linear)
    rest = sum(np.prod(info.shape) for info in weights.weight_infos(config).values() if info.role != "linear") * 4
    engine = Engine(config, params, None, EngineConfig(num_pages=16, max_model_len=64, warmup=False))
    assert engine.weights_bytes == quantized + rest
    assert device_setup.quantized_weights_bytes(source.abstract_params(jnp.float32)) == quantized + rest
    assert _measured_weights_bytes(source, EngineConfig(dtype="float32"), on_gpu=True) == quantized + rest
    # On the CPU the step's transposed copy of the codes (act-order: not the kernel's format) too
    copies = cpu_layout.layer_views_bytes(source.abstract_params(jnp.float32))
    assert copies == L * sum(i * o + (i // 32) * o * (4 + 1) for i, o in linear)  # uint8 codes, f32 scales, uint8 zeros
    assert _measured_weights_bytes(source, EngineConfig(dtype="float32")) == quantized + rest + copies


_TP_CODE = """
import json, sys
from jaxserve.core.request import SamplingParams
from jaxserve.engine import Engine, EngineConfig
from jaxserve.parallel import sharding
import jax
out = {}
for tp in (1, 2, 4):
    engine = Engine.from_model(sys.argv[1], EngineConfig(
        tensor_parallel_size=tp, max_num_seqs=4, max_num_batched_tokens=64, page_size=8, num_pages=32,
        max_model_len=64, warmup=False, dtype="float32"))
    prompts = [[5, 9, 20, 31, 7, 3, 44], [100, 3, 17]]
    tokens = [r.token_ids for r in engine.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0,
                                                                         ignore_eos=True))]
    leaves = jax.tree.leaves(engine.runner.params)
    out[tp] = {"tokens": tokens, "per_device": sum(sharding.per_device_bytes(a) for a in leaves)}
print(json.dumps(out))
"""


def test_act_order_checkpoint_under_tensor_parallelism(converted):
    """Codes, scales, zero points and perm shard like any quantized weight (TP 2; TP 4 also
    replicates the 2 KV heads): the same greedy tokens as one device."""
    _, model_dir, _, _ = converted("gptq_act_order")
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-c", _TP_CODE, model_dir], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = json.loads(proc.stdout.strip().splitlines()[-1])
    assert runs["2"]["tokens"] == runs["1"]["tokens"] == runs["4"]["tokens"]
    assert runs["2"]["per_device"] < runs["1"]["per_device"]


# ---- refused ------------------------------------------------------------------------------------

ACT_INT8 = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}
REFUSED = {  # name: (fixture, config edit, words of the message)
    "W8A8 (activations)": ("w8a16", lambda q: q["config_groups"]["group_0"].update(input_activations=ACT_INT8),
                           ["quantization_config.config_groups.group_0.input_activations", "activation quantization"]),
    "W4A8 (activations)": ("w4a16_g32", lambda q: q["config_groups"]["group_0"].update(input_activations=ACT_INT8),
                           ["config_groups.group_0.input_activations"]),
    "FP8 dynamic": ("fp8_per_channel", lambda q: q["config_groups"]["group_0"].update(input_activations={
        "num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}), ["input_activations"]),
    "2:4 sparsity": ("w4a16_g32", lambda q: q.update(sparsity_config={
        "format": "sparse-24-bitmask", "sparsity_structure": "2:4", "targets": ["Linear"]}),
        ["quantization_config.sparsity_config", "sparse"]),
    "nvfp4": ("w4a16_g32", lambda q: q["config_groups"]["group_0"].update(format="nvfp4-pack-quantized"),
              ["quantization_config.config_groups.group_0.format = 'nvfp4-pack-quantized'"]),
    "block fp8": ("fp8_per_channel", lambda q: q["config_groups"]["group_0"]["weights"].update(
        strategy="block", block_structure=[128, 128]), ["config_groups.group_0.weights.strategy", "block"]),
    "int2": ("w4a16_g32", lambda q: q["config_groups"]["group_0"]["weights"].update(num_bits=2),
             ["weights.num_bits = 2"]),
    "kv cache scheme": ("w4a16_g32", lambda q: q.update(kv_cache_scheme={"num_bits": 8, "type": "float"}),
                        ["quantization_config.kv_cache_scheme"]),
    "unknown method": ("w4a16_g32", lambda q: q.update(quant_method="bitsandbytes"),
                       ["quantization_config.quant_method 'bitsandbytes'", "compressed-tensors, gptq, awq"]),
    "gptq 3 bits": ("gptq", lambda q: q.update(bits=3), ["quantization_config.bits = 3"]),
    "gptq marlin": ("gptq", lambda q: q.update(checkpoint_format="marlin"), ["quantization_config.checkpoint_format"]),
    "gptq dynamic": ("gptq", lambda q: q.update(dynamic={r"-:.*down_proj": {}}), ["quantization_config.dynamic"]),
    "awq gemv": ("awq", lambda q: q.update(version="gemv"), ["quantization_config.version = 'gemv'"]),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_unsupported_variants_are_refused_naming_the_field(converted, tmp_path, capsys, case):
    fixture, edit, words = REFUSED[case]
    source = str(tmp_path / "source")
    shutil.copytree(converted(fixture)[0], source)
    with open(os.path.join(source, "config.json")) as f:
        config = json.load(f)
    edit(config["quantization_config"])
    with open(os.path.join(source, "config.json"), "w") as f:
        json.dump(config, f)
    with pytest.raises(ConversionError) as error:
        convert_checkpoint(source, str(tmp_path / "out"))
    assert all(word in str(error.value) for word in words), str(error.value)
    capsys.readouterr()
    assert run_convert_command([f"--source={source}", f"--output={tmp_path / 'out'}"]) == 2
    stderr = capsys.readouterr().err
    assert stderr.startswith("jaxserve convert: ") and "Traceback" not in stderr
    assert not (tmp_path / "out").exists()


def test_requantizing_a_published_checkpoint_is_refused(converted, tmp_path):
    with pytest.raises(ConversionError, match="already quantized .*compressed-tensors.*without --quantization"):
        convert_checkpoint(converted("w4a16_g32")[0], str(tmp_path / "out"), quantization="int8")


def test_stored_formats_are_not_quantization_choices():
    for name in ("int4_g32_izp", "fp8_bf16", "int4_g128_sym_actorder", "int8_bf16"):
        assert qz.parse_format(name, stored=True).name == name
        with pytest.raises(ValueError, match="unknown quantization .*published"):
            qz.parse_format(name)
    assert qz.parse_format("fp8") == qz.parse_format("fp8", stored=True)  # --quantization=fp8 (float16 scales)


def test_model_flag_converts_a_published_folder_on_first_use(converted, tmp_path, monkeypatch):
    from checkpoints.default_model import resolve_model
    monkeypatch.setenv("JAXSERVE_CACHE", str(tmp_path / "cache"))
    model_dir = resolve_model(converted("awq")[0])
    assert model_dir.startswith(str(tmp_path / "cache"))
    assert set(ModelSource.open(model_dir).quantization.values()) == {"int4_g32_izp"}
    assert resolve_model(converted("awq")[0]) == model_dir  # converted once
