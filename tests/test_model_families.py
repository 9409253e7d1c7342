"""Qwen2 (q/k/v biases), Qwen3, Mistral (sliding window), Gemma 2 and Gemma 3 against transformers (float32).

Each family is a tiny random Hugging Face model saved as safetensors and converted by jaxserve.
Its logits must match transformers' for prompts longer than the sliding window, through each
attention path (the XLA path the CPU engine runs, the reference, and the Pallas kernels in
interpret mode), and its greedy tokens must match through `jaxserve convert` + `jaxserve generate`
with chunked prefill (chunks shorter than the window) and a decode that runs past the window.
"""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from checkpoints.convert import convert_checkpoint
from checkpoints.load import load_config, load_params
from jaxserve.commands import cli
from jaxserve.config import ConfigError, ModelConfig
from jaxserve.models import llama, weights
from tests.tiny_models import copy_smollm2_tokenizer, hf_logits, prefill_batch

pytestmark = pytest.mark.slow  # models against transformers, convert + generate: out of `make test-quick`

WINDOW = 8
SEED = 1234
BASE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6,
            bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
GEMMA = dict(query_pre_attn_scalar=32, hidden_activation="gelu_pytorch_tanh")
FAMILIES = {  # name: (transformers config class, model class, config fields)
    # Dense Qwen2 / Qwen2.5: q/k/v biases (random, below); the window on the layers from
    # max_window_layers on, as Qwen configs place it.
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"use_sliding_window": True, "sliding_window": WINDOW,
                                                  "max_window_layers": 1}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": WINDOW}),
    # Small soft caps so that they change the result.
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {**GEMMA, "sliding_window": WINDOW,
                                                     "attn_logit_softcapping": 2.0, "final_logit_softcapping": 4.0}),
    # Sliding and full layers with different RoPE bases, linear RoPE scaling on the full ones.
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {
        **GEMMA, "sliding_window": WINDOW, "tie_word_embeddings": True,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0},
                            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}}),
}


def make_family_model(path: str, family: str, vocab_size: int = 128, seed: int = SEED):
    """Saves a random model of `family` under `path` (safetensors); returns the torch model."""
    import torch
    import transformers
    config_cls, model_cls, fields = FAMILIES[family]
    config = getattr(transformers, config_cls)(**{**BASE, **fields, "vocab_size": vocab_size})
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    gemma = family.startswith("gemma")
    with torch.no_grad():  # non-trivial norms and biases (transformers starts biases at zero), so that a
        for name, p in model.named_parameters():  # missing or misplaced one shows up
            if "norm" in name:
                p.copy_((0.0 if gemma else 1.0) + 0.1 * torch.randn_like(p))  # Gemma scales by 1 + w
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p))
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    return model


@pytest.fixture(scope="module", params=list(FAMILIES))
def family_model(request, tmp_path_factory):
    """(family, torch model, converted directory)."""
    root = tmp_path_factory.mktemp(request.param)
    model = make_family_model(str(root / "hf"), request.param)
    convert_checkpoint(str(root / "hf"), str(root / "converted"))
    return request.param, model, str(root / "converted")


def test_the_declaration_names_every_transformers_tensor(family_model):
    """The weights declared once (jaxserve.models.weights) are exactly transformers' tensors, in
    shape and number."""
    _, model, converted = family_model
    config = load_config(converted)
    state = {k: tuple(v.shape) for k, v in model.state_dict().items() if k != "lm_head.weight" or
             not config.tie_word_embeddings}
    declared = {}
    for info in weights.weight_infos(config).values():
        shape = info.shape[1:] if info.per_layer else info.shape
        shape = tuple(reversed(shape)) if info.transposed else shape
        names = [f"model.layers.{i}.{info.hf}" for i in range(config.num_layers)] if info.per_layer else [info.hf]
        declared.update(dict.fromkeys(names, shape))
    assert declared == state
    assert weights.num_params(config) == sum(int(np.prod(s)) for s in state.values())


@pytest.mark.parametrize("backend", ["xla", "reference", "interpret"])
def test_forward_matches_transformers(family_model, backend):
    family, model, converted = family_model
    config = load_config(converted)
    params = load_params(converted, jnp.float32)
    rng = np.random.default_rng(SEED)
    lengths = [3 * WINDOW - 3, WINDOW + 2, 5]  # longer than the window, across pages
    page_size, max_pages = 4, 8
    batch, token_ids, num_pages = prefill_batch(lengths, page_size, max_pages, config.vocab_size, rng)
    spec = llama.KVCacheSpec(num_pages=num_pages, page_size=page_size)
    kv = llama.init_kv_cache(config, spec, jnp.float32)
    logits, _ = jax.jit(lambda p, k, b: llama.forward(p, k, b, config=config, backend=backend))(
        params, kv, {k: jnp.asarray(v) for k, v in batch.items()})
    logits = np.asarray(logits)
    start = 0
    for ids in token_ids:
        expected = hf_logits(model, ids[None])[0]
        got = logits[start:start + len(ids)]
        start += len(ids)
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max(),
                                   err_msg=f"{family} via {backend}, seed {SEED}")


def test_greedy_tokens_through_convert_and_generate(tmp_path, family_model):
    """`jaxserve convert` + `jaxserve generate` (prefill in chunks of 4 tokens, decode past the
    window) give transformers' greedy tokens."""
    import torch
    from checkpoints.default_model import resolve_model
    from transformers import AutoTokenizer
    family = family_model[0]
    hf_dir, converted = tmp_path / "hf", tmp_path / "converted"
    smollm2 = resolve_model("smollm2")
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    model = make_family_model(str(hf_dir), family, vocab_size=len(tokenizer))
    copy_smollm2_tokenizer(str(hf_dir))
    assert cli.main(["jaxserve", "convert", f"--source={hf_dir}", f"--output={converted}"]) == 0
    prompt = "The sliding window keeps only the most recent keys in view."
    prompt_ids = tokenizer(prompt)["input_ids"]
    assert len(prompt_ids) > WINDOW
    (tmp_path / "in.jsonl").write_text(json.dumps({"id": 0, "prompt": prompt}) + "\n")
    new_tokens = 2 * WINDOW
    assert cli.main(["jaxserve", "generate", f"--model={converted}", f"--input={tmp_path / 'in.jsonl'}",
                     f"--output={tmp_path / 'out.jsonl'}", f"--max_tokens={new_tokens}", "--ignore_eos",
                     "--max_num_batched_tokens=4", "--max_num_seqs=2", "--page_size=4", "--num_pages=64",
                     "--max_model_len=128", "--noprogress"]) == 0
    row = json.loads((tmp_path / "out.jsonl").read_text())
    assert row["num_prompt_tokens"] == len(prompt_ids)
    with torch.no_grad():
        expected = model.generate(torch.tensor([prompt_ids]), max_new_tokens=new_tokens, do_sample=False,
                                  min_new_tokens=new_tokens, pad_token_id=0)[0, len(prompt_ids):].tolist()
    assert row["token_ids"] == expected, f"{family}, seed {SEED}"


@pytest.mark.parametrize("edit,message", [
    ({"architectures": ["Qwen3ForCausalLM"], "use_sliding_window": True, "sliding_window": 8,
      "max_window_layers": 0}, None),  # honoured, see below
    ({"architectures": ["LlamaForCausalLM"], "sliding_window": 8}, "sliding_window"),
    ({"architectures": ["LlamaForCausalLM"], "mlp_bias": True}, "mlp_bias"),
    ({"architectures": ["LlamaForCausalLM"], "hidden_act": "relu"}, "activation"),
    ({"architectures": ["LlamaForCausalLM"], "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "yarn"),
    ({"architectures": ["Gemma3ForCausalLM"], "use_bidirectional_attention": True, "query_pre_attn_scalar": 16},
     "use_bidirectional_attention"),
    ({"architectures": ["LlamaForCausalLM"], "partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ({"architectures": ["Gemma3ForConditionalGeneration"]}, "unsupported architecture"),
])
def test_config_fields_that_change_the_math_are_refused_or_honoured(edit, message):
    base = {"vocab_size": 32, "hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 1,
            "num_attention_heads": 2, "num_key_value_heads": 1}
    if message is None:
        config = ModelConfig.from_hf_dict({**base, **edit})
        assert config.layer_windows() == [8]  # layers from max_window_layers on slide
        return
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_hf_dict({**base, **edit})


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_config_round_trips_through_config_json(family):
    import transformers
    config_cls, _, fields = FAMILIES[family]
    hf = getattr(transformers, config_cls)(**{**BASE, **fields, "vocab_size": 64}).to_dict()
    hf["architectures"] = [FAMILIES[family][1]]
    config = ModelConfig.from_hf_dict(hf)
    assert ModelConfig.from_hf_dict(config.to_hf_dict()) == config
    expected_windows = {"qwen2": [0, WINDOW, WINDOW], "qwen3": [0, 0, 0], "mistral": [WINDOW] * 3,
                        "gemma2": [WINDOW, 0, WINDOW], "gemma3": [WINDOW, 0, WINDOW]}[family]
    assert config.layer_windows() == expected_windows
