"""Mixture-of-experts models (Mixtral, Qwen3-MoE, Qwen2-MoE) against transformers (float32).

Each family is a tiny random model built and saved by transformers, converted by jaxserve; its
logits through the XLA path must match transformers' within 1e-4, and one family's greedy tokens
must match through `jaxserve convert` + `jaxserve generate`. The routing itself is checked
against a numpy reference with crafted router logits: a token sent to the wrong expert, top-k
weights renormalised where they should not be (or not where they should), a shared expert whose
gate is dropped, and a near-tie, each change the answer the tests expect.
"""
import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from checkpoints.convert import convert_checkpoint
from checkpoints.load import load_config, load_params
from jaxserve.config import ConfigError, ModelConfig
from jaxserve.models import llama, moe, weights
from tests.tiny_models import hf_logits, prefill_batch

pytestmark = pytest.mark.slow  # models against transformers, convert + generate: out of `make test-quick`

SEED = 4321
BASE = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=256, rms_norm_eps=1e-6,
            bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, num_experts_per_tok=2)
FAMILIES = {  # name: (transformers config class, model class, config fields)
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 4, "sliding_window": 8}),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  {"num_experts": 4, "moe_intermediate_size": 24, "norm_topk_prob": True}),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  {"num_experts": 4, "moe_intermediate_size": 24, "norm_topk_prob": False,
                   "shared_expert_intermediate_size": 40}),
}


def make_moe_model(path: str, family: str, vocab_size: int = 128, seed: int = SEED, **extra):
    """Saves a random model of `family` under `path` (safetensors); returns the torch model.
    Weights of unit scale (router included), so routing is decisive and every expert's share shows
    in the logits; non-trivial norms. `extra`: more config fields (num_hidden_layers, mlp_only_layers...)."""
    import torch
    import transformers
    config_cls, model_cls, fields = FAMILIES[family]
    config = getattr(transformers, config_cls)(**{**BASE, **fields, "vocab_size": vocab_size, **extra})
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif p.ndim >= 2:
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
            else:
                p.copy_(0.1 * torch.randn_like(p))
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    return model


@pytest.fixture(scope="module", params=list(FAMILIES))
def moe_model(request, tmp_path_factory):
    """(family, torch model, source folder, converted directory)."""
    root = tmp_path_factory.mktemp(request.param)
    model = make_moe_model(str(root / "hf"), request.param)
    convert_checkpoint(str(root / "hf"), str(root / "converted"))
    return request.param, model, str(root / "hf"), str(root / "converted")


def test_the_declaration_names_every_saved_tensor(moe_model):
    """The declared weights are exactly the tensors save_pretrained wrote (one per expert), in
    shape and number."""
    from safetensors import safe_open
    _, _, hf_dir, converted = moe_model
    config = load_config(converted)
    with safe_open(os.path.join(hf_dir, "model.safetensors"), "np") as f:
        saved = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    declared = {}
    for info in weights.weight_infos(config).values():
        shape = info.shape[2:] if info.per_expert else info.shape[1:] if info.per_layer else info.shape
        shape = tuple(reversed(shape)) if info.transposed else shape
        names = [info.hf.format(expert=e) for e in range(config.num_experts)] if info.per_expert else [info.hf]
        layers = [f"model.layers.{i}." for i in range(config.num_layers)] if info.per_layer else [""]
        declared.update({p + n: shape for p in layers for n in names})
    assert declared == saved
    assert weights.num_params(config) == sum(int(np.prod(s)) for s in saved.values())


def expert_bytes_read(converted: str, name: str, experts: slice) -> tuple[int, int]:
    """(bytes read from the files, bytes of the values) when tensorstore reads the experts
    `experts` of every layer of the routed expert weight `name` of a converted checkpoint (orbax's
    array "layers.<name>"), and the array's chunk shape."""
    import tensorstore as ts

    from checkpoints.load import file_bytes_read
    array = ts.open({"driver": "zarr", "kvstore": {"driver": "ocdbt", "base": "file://" + os.path.join(
        converted, "params"), "path": f"layers.{name}/"}}).result()
    before = file_bytes_read()
    values = array[:, experts].read().result()
    return file_bytes_read() - before, values.nbytes, tuple(array.chunk_layout.read_chunk.shape)


def test_routed_experts_are_stored_one_chunk_per_layer_and_expert(tmp_path):
    """A process that restores only its own experts (expert parallelism over several processes)
    reads only their chunks: half of the experts cost about half of the bytes of all of them
    (experts of 64 KiB, so that the checkpoint's index, a few KiB a read, does not blur it)."""
    make_moe_model(str(tmp_path / "hf"), "qwen3_moe", moe_intermediate_size=512)
    converted = str(tmp_path / "converted")
    convert_checkpoint(str(tmp_path / "hf"), converted)
    config = load_config(converted)
    E = config.num_experts
    for name in ("w_gate_exps", "w_up_exps", "w_down_exps"):
        half, half_values, chunk = expert_bytes_read(converted, name, slice(E // 2, E))
        whole, whole_values, _ = expert_bytes_read(converted, name, slice(0, E))
        shape = weights.param_shapes(config)["layers"][name]
        assert chunk == (1, 1, *shape[2:]), (name, chunk)
        assert 2 * half_values == whole_values == 4 * np.prod(shape)
        assert 0.4 * whole < half < 0.6 * whole, (name, half, whole)


def test_transformers_5_fused_expert_tensors_convert_to_the_same_weights(moe_model, tmp_path):
    """save_pretrained(save_original_format=False) writes transformers 5's fused experts
    (`experts.gate_up_proj` [E, 2F, D], `experts.down_proj`): the same weights once converted."""
    from safetensors import safe_open
    family, model, _, converted = moe_model
    model.save_pretrained(str(tmp_path / "fused"), save_original_format=False)
    with safe_open(str(tmp_path / "fused" / "model.safetensors"), "np") as f:
        assert "model.layers.0.mlp.experts.gate_up_proj" in f.keys()
    convert_checkpoint(str(tmp_path / "fused"), str(tmp_path / "converted"))
    expected, got = load_params(converted, jnp.float32), load_params(str(tmp_path / "converted"), jnp.float32)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=family),
                 expected, got)


def test_forward_matches_transformers(moe_model):
    family, model, _, converted = moe_model
    config = load_config(converted)
    params = load_params(converted, jnp.float32)
    rng = np.random.default_rng(SEED)
    batch, token_ids, num_pages = prefill_batch([11, 6, 3], 4, 4, config.vocab_size, rng)
    kv = llama.init_kv_cache(config, llama.KVCacheSpec(num_pages=num_pages, page_size=4), jnp.float32)
    batch = {k: jnp.asarray(v) for k, v in batch.items()}
    step = jax.jit(lambda p, k, b, c: llama.forward(p, k, b, config=c)[0], static_argnums=3)
    logits = np.asarray(step(params, kv, batch, config))
    expected = np.concatenate([hf_logits(model, ids[None])[0] for ids in token_ids])
    atol = 1e-4 * np.abs(expected).max()
    np.testing.assert_allclose(logits, expected, rtol=1e-4, atol=atol, err_msg=f"{family}, seed {SEED}")
    # The comparison sees the routing: the other renormalisation is far off transformers.
    flipped = np.asarray(step(params, kv, batch, dataclasses.replace(config, norm_topk_prob=not config.norm_topk_prob)))
    assert np.abs(flipped - expected).max() > 100 * atol


def greedy_through_the_cli(tmp_path, family: str, prompt: str, publish=None,
                           **model_kwargs) -> tuple[list[int], list[int]]:
    """(`jaxserve convert` + `jaxserve generate`'s 8 greedy tokens of `prompt`, transformers') for a
    tiny `family` model with SmolLM2's tokenizer (chunked prefill of 4 tokens, then decode).
    `publish(model, folder)`: the folder converted instead of the float one and the transformers
    model it is compared with (a published quantized checkpoint of it and its reference)."""
    import torch
    from checkpoints.default_model import resolve_model
    from jaxserve.commands import cli
    from tests.tiny_models import copy_smollm2_tokenizer
    from transformers import AutoTokenizer
    hf_dir, converted = tmp_path / "hf", tmp_path / "converted"
    tokenizer = AutoTokenizer.from_pretrained(resolve_model("smollm2"))
    model = make_moe_model(str(hf_dir), family, vocab_size=len(tokenizer), **model_kwargs)
    copy_smollm2_tokenizer(str(hf_dir))
    source = str(hf_dir)
    if publish is not None:
        source, model = publish(model, str(tmp_path / "published"))
        copy_smollm2_tokenizer(source)
    assert cli.main(["jaxserve", "convert", f"--source={source}", f"--output={converted}"]) == 0
    prompt_ids = tokenizer(prompt)["input_ids"]
    (tmp_path / "in.jsonl").write_text(json.dumps({"id": 0, "prompt": prompt}) + "\n")
    new_tokens = 8
    assert cli.main(["jaxserve", "generate", f"--model={converted}", f"--input={tmp_path / 'in.jsonl'}",
                     f"--output={tmp_path / 'out.jsonl'}", f"--max_tokens={new_tokens}", "--ignore_eos",
                     "--max_num_batched_tokens=4", "--max_num_seqs=2", "--page_size=4", "--num_pages=32",
                     "--max_model_len=64", "--noprogress"]) == 0
    row = json.loads((tmp_path / "out.jsonl").read_text())
    with torch.no_grad():
        expected = model.generate(torch.tensor([prompt_ids]), max_new_tokens=new_tokens, do_sample=False,
                                  min_new_tokens=new_tokens, pad_token_id=0)[0, len(prompt_ids):].tolist()
    return row["token_ids"], expected


def test_greedy_tokens_through_convert_and_generate(tmp_path):
    """`jaxserve convert` + `jaxserve generate` (chunked prefill, then decode) give transformers'
    greedy tokens for a Qwen3-MoE model."""
    got, expected = greedy_through_the_cli(tmp_path, "qwen3_moe", "Each token goes to two of the four experts.")
    assert got == expected


# ---- the routing against a numpy reference ------------------------------------------------------

def reference_moe(h, router_logits, w_gate, w_up, w_down, top_k, renormalize, shared=None, gated=True):
    """Token by token: softmax over all experts, the k largest (lower index on ties), optionally
    renormalised, each chosen expert's SwiGLU weighted; plus sigmoid(gate) * the shared SwiGLU."""
    def swiglu(x, g, u, d):
        a = x @ g
        return (a / (1 + np.exp(-a)) * (x @ u)) @ d
    out = np.zeros_like(h, dtype=np.float64)
    for t in range(h.shape[0]):
        p = np.exp(router_logits[t] - router_logits[t].max())
        p /= p.sum()
        chosen = np.argsort(-p, kind="stable")[:top_k]
        w = p[chosen] / (p[chosen].sum() if renormalize else 1.0)
        for e, weight in zip(chosen, w):
            out[t] += weight * swiglu(h[t], w_gate[e], w_up[e], w_down[e])
        if shared is not None:
            g, u, d, gate = shared
            out[t] += swiglu(h[t], g, u, d) / ((1 + np.exp(-(h[t] @ gate)[0])) if gated else 1.0)
    return out


def _crafted(num_tokens=6, D=8, E=4, F=5, seed=SEED):
    """Random rows and experts, and router weights whose logits send token t to experts
    (t, t + 1) mod E with clear margins (unequal top two, so renormalising changes the weights)."""
    rng = np.random.default_rng(seed)
    h = rng.standard_normal((num_tokens, D)).astype(np.float32)
    logits = np.full((num_tokens, E), 0.5, np.float32)
    for t in range(num_tokens):
        logits[t, t % E], logits[t, (t + 1) % E] = 2.0, 1.0
    router = np.linalg.lstsq(h.T @ h + 1e-3 * np.eye(D), h.T @ logits, rcond=None)[0].astype(np.float32)
    mats = [rng.standard_normal(s).astype(np.float32) / np.sqrt(s[1]) for s in [(E, D, F), (E, D, F), (E, F, D)]]
    return h, router, mats


@pytest.mark.parametrize("renormalize", [True, False])
def test_route_picks_the_top_experts_and_renormalises_as_asked(renormalize):
    h, router, _ = _crafted()
    weights_, experts = moe.route(jnp.asarray(h @ router), 2, renormalize)
    logits = h @ router
    probs = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    expected = np.argsort(-probs, axis=-1, kind="stable")[:, :2]
    np.testing.assert_array_equal(np.asarray(experts), expected)
    np.testing.assert_array_equal(expected, [[t % 4, (t + 1) % 4] for t in range(6)])
    top = np.take_along_axis(probs, expected, -1)
    np.testing.assert_allclose(np.asarray(weights_), top / top.sum(-1, keepdims=True) if renormalize else top,
                               rtol=1e-5)
    assert np.abs(top.sum(-1) - 1).min() > 0.2  # renormalising changes these weights


def test_route_breaks_ties_toward_the_lower_expert():
    logits = jnp.asarray([[2.0, 2.0, 2.0, 0.0],  # exact tie of three: experts 0 and 1
                          [0.0, 1.0, 1.0 + 1e-6, 1.0],  # near tie: 2 (above by 1e-6) then the lower of 1, 3
                          [5.0, 0.0, 5.0, 5.0]])
    _, experts = moe.route(logits, 2, True)
    np.testing.assert_array_equal(np.asarray(experts), [[0, 1], [2, 1], [0, 2]])
    _, again = jax.jit(moe.route, static_argnums=(1, 2))(logits, 2, True)  # the same compiled
    np.testing.assert_array_equal(np.asarray(again), np.asarray(experts))


def near_tie_logits() -> np.ndarray:
    """[6, 4] float32 router logits with exact ties and ties within one ulp of 1.0, at the top-2
    boundary (tests/test_moe_expert_parallel.py routes them on every device too)."""
    one = np.float32(1.0)
    up, down = np.nextafter(one, np.float32(2)), np.nextafter(one, np.float32(0))
    return np.asarray([[one, one, one, 0], [down, one, up, one], [one, up, one, up], [up, down, one, one],
                       [0, down, down, down], [one, one, up, up]], np.float32)


def stable_top_k(probs: np.ndarray, k: int) -> np.ndarray:
    """The k largest of each row, the lower index first among equal values."""
    return np.argsort(-probs, axis=-1, kind="stable")[:, :k]


def test_route_on_one_ulp_near_ties_is_the_same_every_run_lower_index_first():
    """Logits one ulp apart: the softmax keeps some apart and merges others into exact ties;
    either way the route is the stable order of the float32 probabilities (higher first, then the
    lower index), the same eagerly and compiled, run after run."""
    logits = jnp.asarray(near_tie_logits())
    probs = np.asarray(jax.nn.softmax(logits, axis=-1))  # what route ranks
    top3 = np.sort(probs, axis=-1)[:, ::-1][:, :3]
    assert (top3[:, 1] == top3[:, 2]).sum() >= 2  # ties that decide the second expert
    bits = probs.view(np.int32)  # positive floats: one ulp apart is one apart here
    assert np.any(bits[:, :, None] - bits[:, None, :] == 1)  # and one-ulp differences that survive
    expected = stable_top_k(probs, 2)
    compiled = jax.jit(moe.route, static_argnums=(1, 2))
    for _ in range(3):
        np.testing.assert_array_equal(np.asarray(moe.route(logits, 2, True)[1]), expected)
        np.testing.assert_array_equal(np.asarray(compiled(logits, 2, False)[1]), expected)


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("with_shared", [False, True])
def test_sparse_mlp_matches_the_reference(renormalize, with_shared):
    h, router, (wg, wu, wd) = _crafted()
    D, E = h.shape[1], wg.shape[0]
    rng = np.random.default_rng(SEED + 1)
    shared = ([rng.standard_normal(s).astype(np.float32) / np.sqrt(s[0]) for s in [(D, 7), (D, 7), (7, D)]]
              + [rng.standard_normal((D, 1)).astype(np.float32)]) if with_shared else None
    config = ModelConfig(vocab_size=8, hidden_size=D, intermediate_size=5, num_layers=1, num_q_heads=1,
                         num_kv_heads=1, head_dim=D, num_experts=E, num_experts_per_tok=2, moe_intermediate_size=5,
                         norm_topk_prob=renormalize, shared_expert_intermediate_size=7 if with_shared else 0)
    lp = {"router": router, "w_gate_exps": wg, "w_up_exps": wu, "w_down_exps": wd}
    if with_shared:
        lp.update(w_gate=shared[0], w_up=shared[1], w_down=shared[2], shared_gate=shared[3])
    got = np.asarray(jax.jit(moe.sparse_mlp, static_argnums=2)(lp, jnp.asarray(h), config))
    ref = lambda **kw: reference_moe(h, h @ router, wg, wu, wd, 2, **{"renormalize": renormalize, "shared": shared,
                                                                     **kw})
    np.testing.assert_allclose(got, ref(), rtol=1e-4, atol=1e-5)
    # What the comparison catches: the other renormalisation, a dropped gate, a wrong expert.
    assert np.abs(got - ref(renormalize=not renormalize)).max() > 1e-2
    if with_shared:
        assert np.abs(got - ref(gated=False)).max() > 1e-2
    swapped = wg[[1, 0, 2, 3]]  # experts 0 and 1 exchanged: every token but 2 meets a wrong one
    assert np.abs(got - reference_moe(h, h @ router, swapped, wu, wd, 2, renormalize, shared)).max() > 1e-2


def test_routed_experts_computes_every_assignment_even_all_to_one_expert():
    """No capacity: all T * k pairs on one expert (and none on the rest) are each computed."""
    h, _, (wg, wu, wd) = _crafted()
    experts = jnp.zeros((6, 2), jnp.int32).at[:, 1].set(3)  # every token to experts 0 and 3
    w = jnp.full((6, 2), 0.5, jnp.float32)
    got = np.asarray(moe.routed_experts(jnp.asarray(h), w, experts, wg, wu, wd))
    swiglu = lambda e: (lambda a: a / (1 + np.exp(-a)))(h @ wg[e]) * (h @ wu[e]) @ wd[e]
    np.testing.assert_allclose(got, 0.5 * swiglu(0) + 0.5 * swiglu(3), rtol=1e-4, atol=1e-5)


# ---- configs --------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_config_round_trips_and_reads_both_transformers_names(family):
    import transformers
    config_cls, model_cls, fields = FAMILIES[family]
    hf = getattr(transformers, config_cls)(**{**BASE, **fields, "vocab_size": 64}).to_dict()
    hf["architectures"] = [model_cls]
    config = ModelConfig.from_hf_dict(hf)
    assert (config.num_experts, config.num_experts_per_tok) == (4, 2)
    assert config.norm_topk_prob == (family != "qwen2_moe")
    assert config.shared_expert_intermediate_size == (40 if family == "qwen2_moe" else 0)
    assert config.moe_intermediate_size == (48 if family == "mixtral" else 24)
    assert ModelConfig.from_hf_dict(config.to_hf_dict()) == config
    if family != "mixtral":  # transformers 4's `num_experts` and 5's `num_local_experts` alike
        renamed = {k: v for k, v in hf.items() if k not in ("num_experts", "num_local_experts")}
        assert ModelConfig.from_hf_dict({**renamed, "num_experts": 4}) == config
        assert ModelConfig.from_hf_dict({**renamed, "num_local_experts": 4}) == config


MOE_BASE = {"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 32, "hidden_size": 16, "intermediate_size": 24,
            "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "num_experts": 4,
            "num_experts_per_tok": 2, "moe_intermediate_size": 8}


@pytest.mark.parametrize("edit,message", [
    ({"mlp_only_layers": [0, 1]}, "no layer"),
    ({"decoder_sparse_step": 3}, "no layer"),
    ({"decoder_sparse_step": 0}, "decoder_sparse_step"),
    ({"mlp_only_layers": "0"}, "mlp_only_layers"),
    ({"num_experts_per_tok": 5}, "num_experts_per_tok"),
    ({"hidden_act": "gelu_pytorch_tanh"}, "hidden_act"),
    ({"architectures": ["Qwen2MoeForCausalLM"], "shared_expert_intermediate_size": 0}, "shared_expert"),
    ({"moe_intermediate_size": None}, "moe_intermediate_size"),
])
def test_moe_fields_not_implemented_are_refused_by_name(edit, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_hf_dict({**MOE_BASE, **edit})


# ---- what else meets a mixture-of-experts model ---------------------------------------------------

def _moe_config(family="qwen2_moe"):
    import transformers
    config_cls, model_cls, fields = FAMILIES[family]
    hf = getattr(transformers, config_cls)(**{**BASE, **fields, "vocab_size": 64}).to_dict()
    return ModelConfig.from_hf_dict({**hf, "architectures": [model_cls]})


def test_the_planner_counts_every_experts_bytes():
    from jaxserve.planning import memory
    config = _moe_config()
    L, D, E, F, S = 2, 32, 4, 24, 40
    counts = memory.count_params(config)
    assert counts["experts"] == L * E * 3 * D * F
    assert counts["routers"] == L * (D * E + D)  # the router and the shared expert's gate
    assert counts["linear"] == L * (2 * 32 * 32 + 2 * 32 * 16 + 3 * D * S)  # attention + the shared expert
    assert sum(counts.values()) == weights.num_params(config)
    assert memory.weights_bytes(config, "bfloat16") == 2 * weights.num_params(config)
    dense = dataclasses.replace(config, num_experts_per_tok=1)
    sizes = dict(max_num_batched_tokens=64, max_num_seqs=4, max_context_len=64)
    assert memory.activation_bytes(config, **sizes) >= memory.activation_bytes(dense, **sizes)


MIXTRAL_8X7B = {"architectures": ["MixtralForCausalLM"], "vocab_size": 32000, "hidden_size": 4096,
                "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                "num_local_experts": 8, "num_experts_per_tok": 2, "max_position_embeddings": 32768}
QWEN3_30B_A3B = {"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 151936, "hidden_size": 2048,
                 "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48,
                 "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
                 "num_experts_per_tok": 8, "norm_topk_prob": True, "max_position_embeddings": 40960}


def test_the_gpu_planner_counts_ragged_dots_masked_copy_unless_the_kernel_runs(monkeypatch):
    """XLA's GPU ragged-dot holds the sorted rows once per local expert (its deviceless compile:
    2.2 GiB for Qwen3-30B-A3B's 512-token prefill at TP 8); the Pallas kernel holds none."""
    from jaxserve import environment
    from jaxserve.planning import memory
    config = ModelConfig.from_hf_dict(QWEN3_30B_A3B)
    sizes = dict(max_num_batched_tokens=512, max_num_seqs=32, max_context_len=4096, tensor_parallel_size=8,
                 backend="pallas", weight_dtype="bfloat16")
    cpu = {**sizes, "backend": "xla"}
    monkeypatch.delenv(environment.GROUPED_MATMUL_BACKEND, raising=False)
    with_copy, cpu_default = memory.activation_bytes(config, **sizes), memory.activation_bytes(config, **cpu)
    monkeypatch.setenv(environment.GROUPED_MATMUL_BACKEND, "pallas")
    kernel = memory.activation_bytes(config, **sizes)
    rows = (32 + 512) * 8  # the GPU build's largest step, top-8
    assert with_copy - kernel == 128 * rows * 2048 * 2  # [experts, rows, hidden] in bfloat16
    assert memory.activation_bytes(config, **cpu) == cpu_default  # the CPU runs its loop either way: no copy


@pytest.mark.parametrize("hf,published", [(MIXTRAL_8X7B, 46.70e9), (QWEN3_30B_A3B, 30.53e9)])
def test_the_planner_counts_published_moe_sizes(hf, published):
    """Mixtral-8x7B's 46.7B parameters and Qwen3-30B-A3B's 30.5B (their model cards): every expert counted."""
    from jaxserve.planning import memory
    config = ModelConfig.from_hf_dict(hf)
    count = sum(memory.count_params(config).values())
    assert abs(count - published) < 0.01e9
    assert memory.weights_bytes(config, "bfloat16") == 2 * count


def test_a_moe_gguf_without_its_expert_metadata_is_refused_by_name(tmp_path):
    """llama.cpp writes Mixtral as arch "llama" with an expert count (tests/test_moe_gguf.py
    converts such files); one without its top-k is refused by the key's name, not misread."""
    import gguf
    from checkpoints import ConversionError
    from checkpoints.convert import open_source
    writer = gguf.GGUFWriter(str(tmp_path / "mixtral.gguf"), "llama")
    for add, value in (("block_count", 1), ("embedding_length", 4), ("head_count", 1), ("feed_forward_length", 8),
                       ("vocab_size", 8), ("expert_count", 4)):
        getattr(writer, f"add_{add}")(value)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ConversionError, match="expert_used_count"):
        open_source(str(tmp_path / "mixtral.gguf"))
