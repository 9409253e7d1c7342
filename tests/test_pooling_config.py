"""How a model pools (jaxserve.pooling.config) and a prompt's chunks combined (jaxserve.pooling.accumulate).

Quick: JSON files in a temporary folder and numpy; no model, no jax.
"""
import json
import os

import numpy as np
import pytest

from jaxserve.pooling.accumulate import PooledPrompt, cosine_scores, finish_embedding
from jaxserve.pooling.config import (Classifier, PoolerConfigError, classifier_from_hf_config, parse_pooler_flag,
                                     published_pooling_fields, resolve_pooler)

HIDDEN = 32
SEED = 20261203


def write_json(path, data):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f)


def st_folder(root, modes=None, normalize=True, extra_modules=(), pooling_path="1_Pooling",
              architecture="LlamaModel", **pooling_fields):
    """A sentence-transformers folder: config.json, modules.json, the Pooling config, maybe Normalize."""
    folder = str(root)
    write_json(os.path.join(folder, "config.json"), {"architectures": [architecture], "hidden_size": HIDDEN})
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": pooling_path, "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
        os.makedirs(os.path.join(folder, "2_Normalize"), exist_ok=True)
    modules.extend(extra_modules)
    write_json(os.path.join(folder, "modules.json"), modules)
    config = {"word_embedding_dimension": HIDDEN, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": False,
              "pooling_mode_max_tokens": False, "pooling_mode_mean_sqrt_len_tokens": False,
              "pooling_mode_weightedmean_tokens": False, "pooling_mode_lasttoken": False, "include_prompt": True}
    config.update({name: True for name in (modes or ["pooling_mode_lasttoken"])})
    config.update(pooling_fields)
    write_json(os.path.join(folder, pooling_path, "config.json"), config)
    return folder


@pytest.mark.parametrize("mode, expected", [("pooling_mode_lasttoken", "LAST"), ("pooling_mode_mean_tokens", "MEAN"),
                                            ("pooling_mode_cls_token", "CLS")])
@pytest.mark.parametrize("normalize", [True, False])
def test_sentence_transformers_files_decide(tmp_path, mode, expected, normalize):
    config = resolve_pooler(st_folder(tmp_path, [mode], normalize), HIDDEN)
    assert (config.pooling_type, config.normalize, config.dimensions, config.classifier) == (
        expected, normalize, None, None)
    assert dict(config.sources)["pooling_type"] == "modules.json"


def test_newer_sentence_transformers_names(tmp_path):
    """sentence-transformers 5 writes full module paths and may name the mode as one string."""
    folder = st_folder(tmp_path, modes=[], pooling_mode="mean")
    modules = json.load(open(os.path.join(folder, "modules.json")))
    modules[1]["type"] = "sentence_transformers.sentence_transformer.modules.pooling.Pooling"
    write_json(os.path.join(folder, "modules.json"), modules)
    assert resolve_pooler(folder, HIDDEN).pooling_type == "MEAN"


def test_without_sentence_transformers_files_a_decoder_pools_its_last_token_normalized(tmp_path):
    write_json(str(tmp_path / "config.json"), {"architectures": ["Qwen3ForCausalLM"]})
    config = resolve_pooler(str(tmp_path), HIDDEN)
    assert (config.pooling_type, config.normalize, config.classifier) == ("LAST", True, None)
    assert dict(config.sources) == {"pooling_type": "default", "normalize": "default", "dimensions": "default"}


def test_the_flag_wins_field_by_field(tmp_path):
    folder = st_folder(tmp_path, ["pooling_mode_mean_tokens"], normalize=True)
    config = resolve_pooler(folder, HIDDEN, '{"pooling_type": "CLS", "dimensions": 8}')
    assert (config.pooling_type, config.normalize, config.dimensions) == ("CLS", True, 8)
    assert dict(config.sources) == {"pooling_type": "--pooler_config", "normalize": "modules.json",
                                    "dimensions": "--pooler_config"}
    assert resolve_pooler(folder, HIDDEN, {"normalize": False}).normalize is False


@pytest.mark.parametrize("flag, field", [
    ('{"pooling_type": "MAX"}', "pooling_type"), ('{"normalize": "yes"}', "normalize"),
    ('{"dimensions": 0}', "dimensions"), ('{"dimensions": 33}', "dimensions"), ('{"step_tag_id": 3}', "step_tag_id"),
    ('{"use_activation": 1}', "use_activation"), ("[1]", "JSON object"), ("{pooling", "not valid JSON"),
])
def test_bad_flags_are_refused_naming_the_field(tmp_path, flag, field):
    write_json(str(tmp_path / "config.json"), {"architectures": ["LlamaForCausalLM"]})
    with pytest.raises(PoolerConfigError, match=field):
        resolve_pooler(str(tmp_path), HIDDEN, flag)


def test_vllm_newer_field_name_is_read():
    assert parse_pooler_flag({"seq_pooling_type": "MEAN", "normalize": None}) == {"pooling_type": "MEAN"}


@pytest.mark.parametrize("change, field", [
    (dict(modes=["pooling_mode_max_tokens"]), "pooling_mode_max_tokens"),
    (dict(modes=["pooling_mode_mean_tokens", "pooling_mode_cls_token"]), "2 pooling modes"),
    (dict(modes=[], pooling_mode="weightedmean"), "pooling_mode"),
    (dict(include_prompt=False), "include_prompt"),
    (dict(word_embedding_dimension=HIDDEN * 2), "word_embedding_dimension"),
    (dict(extra_modules=[{"idx": 3, "path": "3_Dense", "type": "sentence_transformers.models.Dense"}]), "3_Dense"),
    (dict(extra_modules=[{"idx": 3, "path": "x", "type": "custom_st.Pooling"}]), "custom_st.Pooling"),
])
def test_unsupported_sentence_transformers_files_are_refused_naming_them(tmp_path, change, field):
    with pytest.raises(PoolerConfigError, match=field):
        resolve_pooler(st_folder(tmp_path, **change), HIDDEN)


def test_matryoshka_dimensions_of_the_checkpoint_bound_the_flag(tmp_path):
    write_json(str(tmp_path / "config.json"), {"architectures": ["LlamaModel"], "matryoshka_dimensions": [8, 16, 32]})
    assert resolve_pooler(str(tmp_path), HIDDEN, {"dimensions": 16}).matryoshka_dimensions == (8, 16, 32)
    with pytest.raises(PoolerConfigError, match="one of \\[8, 16, 32\\]"):
        resolve_pooler(str(tmp_path), HIDDEN, {"dimensions": 12})


@pytest.mark.parametrize("fields, activation", [
    ({"id2label": {"0": "LABEL_0"}}, "sigmoid"),  # one label: sigmoid (vLLM, CrossEncoder)
    ({"id2label": {"0": "neg", "1": "pos"}}, "softmax"),
    ({"id2label": {"0": "a", "1": "b"}, "problem_type": "multi_label_classification"}, "sigmoid"),
    ({"id2label": {"0": "a"}, "problem_type": "regression"}, "identity"),
    ({"id2label": {"0": "a"}, "sentence_transformers": {"activation_fn": "torch.nn.modules.linear.Identity"}},
     "identity"),
    ({}, "softmax"),  # transformers' default: two labels
])
def test_a_sequence_classifier_and_its_activation(fields, activation):
    config = {"architectures": ["Qwen3ForSequenceClassification"], **fields}
    classifier = classifier_from_hf_config(config)
    assert classifier.activation == activation
    assert classifier.num_labels == (len(fields.get("id2label", {})) or 2)
    assert classifier_from_hf_config(config, use_activation=False).activation == "identity"
    assert classifier_from_hf_config({"architectures": ["Qwen3ForCausalLM"]}) is None


def test_a_classifier_pools_its_last_token_unnormalized(tmp_path):
    write_json(str(tmp_path / "pooling.json"), published_pooling_fields({
        "architectures": ["LlamaForSequenceClassification"], "id2label": {"0": "neg", "1": "pos"},
        "hidden_size": HIDDEN}))
    config = resolve_pooler(str(tmp_path), HIDDEN)
    assert config.classifier == Classifier(2, ("neg", "pos"), "softmax")
    assert (config.pooling_type, config.normalize) == ("LAST", False)
    with pytest.raises(PoolerConfigError, match="reads the last token"):
        resolve_pooler(str(tmp_path), HIDDEN, {"pooling_type": "MEAN"})
    with pytest.raises(PoolerConfigError, match="num_labels"):
        classifier_from_hf_config({"architectures": ["LlamaForSequenceClassification"], "num_labels": 3,
                                   "id2label": {"0": "a"}})


@pytest.mark.parametrize("pooling_type", ["LAST", "MEAN", "CLS"])
def test_chunks_combine_to_the_whole_prompts_pool(pooling_type):
    rng = np.random.default_rng(SEED)
    rows = rng.standard_normal((11, 6)).astype(np.float32)  # a prompt's final-normed hidden states
    expected = {"LAST": rows[-1], "MEAN": rows.mean(0), "CLS": rows[0]}[pooling_type]
    prompt = PooledPrompt(pooling_type, len(rows))
    for start, end in ((0, 4), (4, 5), (5, 11)):
        chunk = rows[start:end]
        partial = {"LAST": chunk[-1], "MEAN": chunk.sum(0), "CLS": chunk[0]}[pooling_type]
        assert not prompt.done
        prompt.add(partial, start, end - start)
    assert prompt.done
    np.testing.assert_allclose(prompt.pooled(), expected, rtol=1e-6, atol=1e-6, err_msg=f"seed {SEED}")


def test_chunks_out_of_order_are_refused():
    prompt = PooledPrompt("MEAN", 8)
    prompt.add(np.ones(3), 0, 4)
    with pytest.raises(ValueError, match="expected the next chunk at 4"):
        prompt.add(np.ones(3), 5, 3)
    with pytest.raises(ValueError, match="pooled after 4 of 8"):
        prompt.pooled()


def test_finish_truncates_then_renormalizes():
    rng = np.random.default_rng(SEED)
    pooled = rng.standard_normal(16).astype(np.float32)
    full = finish_embedding(pooled, normalize=True)
    np.testing.assert_allclose(np.linalg.norm(full), 1.0, rtol=1e-6)
    short = finish_embedding(pooled, normalize=True, dimensions=5)
    np.testing.assert_allclose(short, pooled[:5] / np.linalg.norm(pooled[:5]), rtol=1e-6)
    np.testing.assert_array_equal(finish_embedding(pooled, normalize=False, dimensions=5), pooled[:5])
    with pytest.raises(ValueError, match="dimensions 17"):
        finish_embedding(pooled, normalize=True, dimensions=17)


def test_cosine_scores():
    a = np.array([[1.0, 0.0], [1.0, 1.0], [3.0, 4.0]])
    b = np.array([[0.0, 2.0], [2.0, 2.0], [-3.0, -4.0]])
    np.testing.assert_allclose(cosine_scores(a, b), [0.0, 1.0, -1.0], atol=1e-7)
