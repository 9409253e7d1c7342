"""Published quantized mixture-of-experts checkpoints (Mixtral, Qwen3-MoE, Qwen2-MoE) converted as stored.

Each checkpoint is made on the CPU from a tiny random model of the family (tests/test_moe.py's
make_moe_model) by the writers of tests/published_checkpoints.py: every routed expert's own
linear modules, the attention and Qwen2-MoE's shared expert quantized like dense linear layers
(compressed-tensors' own quantizer and compressor; GPTQ and AWQ packed as those libraries pack),
the routers and the shared-expert gate left float as the published checkpoints leave them.
compressed-tensors dequantizes it into the float reference (tests/published_checkpoints.py
reference_model). jaxserve converts the same folder:

- the expert leaves are QuantArrays with leading [L, E] axes in one stored format, and every
  expert's weights dequantize to the reference's bit for bit (as do the dense leaves);
- its logits match transformers' on the reference within 1e-4 of the largest logit, greedy
  decoding picking the same tokens (teacher-forced on transformers' greedy sequence);
- `jaxserve convert` + `jaxserve generate` give transformers' greedy tokens, one family for each
  published format (compressed-tensors, GPTQ act-order, AWQ).
"""
import os

import jax.numpy as jnp
import numpy as np
import pytest

pytestmark = pytest.mark.slow  # published quantized formats against transformers: out of `make test-quick`

pytest.importorskip("compressed_tensors")  # the test extra
torch = pytest.importorskip("torch")

from checkpoints.convert import convert_checkpoint  # noqa: E402
from checkpoints.load import ModelSource  # noqa: E402
from jaxserve.models import quantization as qz  # noqa: E402
from jaxserve.models import weights  # noqa: E402
from tests import published_checkpoints as pc  # noqa: E402
from tests.test_moe import greedy_through_the_cli, make_moe_model  # noqa: E402
from tests.test_published_quant_formats import check_logits_and_greedy_tokens, stored_layer_weights  # noqa: E402

# every input 64 (hidden; 4 heads x 16: o_proj; an expert's intermediate size: its down
# projection): two groups of 32, so that GPTQ act-order has inputs to move between groups
FAMILY_SHAPES = {"mixtral": dict(hidden_size=64, head_dim=16, intermediate_size=64),
                 "qwen3_moe": dict(hidden_size=64, head_dim=16, moe_intermediate_size=64, intermediate_size=64),
                 "qwen2_moe": dict(hidden_size=64, head_dim=16, moe_intermediate_size=64,
                                   shared_expert_intermediate_size=64)}
IGNORE = ("lm_head", *pc.ROUTERS)

# name: (family, writer, its arguments, the format every linear and expert leaf is stored in[,
# more config fields])
CASES = {
    "mixtral_w4a16_g32": ("mixtral", "ct", dict(bits=4, group=32), "int4_g32_sym_f32"),
    "qwen3_moe_w4a16_g32": ("qwen3_moe", "ct", dict(bits=4, group=32), "int4_g32_sym_f32"),
    "qwen2_moe_w4a16_g32": ("qwen2_moe", "ct", dict(bits=4, group=32), "int4_g32_sym_f32"),
    "qwen3_moe_w4a16_asym_g32": ("qwen3_moe", "ct", dict(bits=4, group=32, symmetric=False), "int4_g32_izp_f32"),
    "qwen3_moe_w8a16": ("qwen3_moe", "ct", dict(bits=8, group=None), "int8_f32"),
    "mixtral_fp8": ("mixtral", "ct", dict(bits=8, group=None, kind="float"), "fp8_f32"),
    "qwen2_moe_gptq": ("qwen2_moe", "gptq", dict(group=32), "int4_g32_sym"),
    "mixtral_gptq_act_order": ("mixtral", "gptq", dict(group=32, act_order=True, symmetric=False),
                               "int4_g32_izp_actorder"),
    "qwen3_moe_awq": ("qwen3_moe", "awq", dict(group=32), "int4_g32_izp"),
    # a dense MLP layer among the sparse ones: its leaves stack that layer only (dense_layers)
    "qwen3_moe_mixed_gptq": ("qwen3_moe", "gptq", dict(group=32), "int4_g32_sym",
                             dict(num_hidden_layers=3, mlp_only_layers=[1])),
}


def publish(model, path: str, writer: str, kwargs: dict, seed: int):
    """Writes the published checkpoint of `model` under `path`; returns (path, the reference
    transformers model: its dequantization by compressed-tensors)."""
    if writer == "ct":
        pc.quantize_compressed_tensors(model, path, ignore=IGNORE, **kwargs)
    elif writer == "gptq":
        pc.write_gptq(model, path, seed=seed, **kwargs)
    else:
        pc.write_awq(model, path, **kwargs)
    work_dir = f"{path}-reference"
    os.makedirs(work_dir)
    return path, pc.reference_model(path, work_dir)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """name -> (published folder, converted dir, reference model, reference float weights), made once."""
    cache = {}

    def get(name):
        if name not in cache:
            root = tmp_path_factory.mktemp(name)
            family, writer, kwargs, _, *extra = CASES[name]
            seed = list(CASES).index(name)
            fields = {**FAMILY_SHAPES[family], **(extra[0] if extra else {})}
            model = make_moe_model(str(root / "float"), family, seed=seed, **fields)
            source, (model, state) = publish(model, str(root / "published"), writer, kwargs, seed)
            convert_checkpoint(source, str(root / "converted"))
            cache[name] = (source, str(root / "converted"), model, state)
        return cache[name]
    return get


def quantized_leaves(config) -> list[str]:
    """The leaves a published checkpoint stores quantized: the linear leaves and the experts'."""
    return [info.name for info in weights.weight_infos(config).values() if info.role in ("linear", "experts")]


@pytest.mark.parametrize("name", list(CASES))
def test_expert_weights_dequantize_bit_for_bit_like_the_reference(converted, name):
    _, model_dir, _, reference = converted(name)
    source = ModelSource.open(model_dir)
    config = source.config
    leaves = quantized_leaves(config)
    assert {"w_gate_exps", "w_up_exps", "w_down_exps"} <= set(leaves)
    assert source.quantization == dict.fromkeys(leaves, CASES[name][3])
    params = source.load_params(jnp.float32)
    assert qz.params_formats(params) == source.quantization  # the arrays say the same
    E = config.num_experts
    for info in weights.weight_infos(config).values():
        if info.role not in ("linear", "experts"):
            continue
        weight = params["layers"][info.name]
        got = stored_layer_weights(params, info.name)  # [L, out, in]; experts [L, E, out, in]
        if info.role == "experts":  # [L, E] leading axes on every stored array
            assert all(a.shape[:2] == (len(info.stack_layers), E) for a in weight.stored().values()), info.name
        for row, layer in enumerate(info.stack_layers):
            for expert in range(E) if info.per_expert else [None]:
                hf = info.hf if expert is None else info.hf.format(expert=expert)
                want = reference[f"model.layers.{layer}.{hf}"]
                have = got[row] if expert is None else got[row, expert]
                assert have.view(np.uint32).tolist() == want.view(np.uint32).tolist(), (info.name, layer, expert)
    # the routers (and Qwen2-MoE's shared-expert gate) stay float, as published
    for info in weights.weight_infos(config).values():
        if info.role == "router":
            assert not isinstance(params["layers"][info.name], qz.QuantArray)
            want = np.stack([reference[f"model.layers.{layer}.{info.hf}"].T for layer in info.stack_layers])
            np.testing.assert_array_equal(np.asarray(params["layers"][info.name]), want)


@pytest.mark.parametrize("name", list(CASES))
def test_logits_and_greedy_tokens_match_transformers(converted, name):
    _, model_dir, model, _ = converted(name)
    check_logits_and_greedy_tokens(model_dir, model)


CLI_CASES = {"mixtral": ("ct", dict(bits=4, group=32)),
             "qwen2_moe": ("gptq", dict(group=32, act_order=True, symmetric=False)),
             "qwen3_moe": ("awq", dict(group=32))}


@pytest.mark.parametrize("family", list(CLI_CASES))
def test_greedy_tokens_through_convert_and_generate(tmp_path, family):
    writer, kwargs = CLI_CASES[family]

    def published(model, path):
        path, (reference, _) = publish(model, path, writer, kwargs, seed=7)
        return path, reference

    got, expected = greedy_through_the_cli(tmp_path, family, "Each token goes to two of the four experts.",
                                           publish=published, **FAMILY_SHAPES[family])
    assert got == expected
