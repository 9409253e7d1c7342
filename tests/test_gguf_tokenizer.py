"""checkpoints.gguf_tokenizer: the tokenizer built from GGUF metadata without torch equals the one
transformers' GGUF loader builds (which needs torch, a test-only dependency here)."""
import random

import gguf
import pytest
from transformers import AutoTokenizer

from checkpoints.default_model import smollm2_gguf_path
from checkpoints.gguf_tokenizer import GGUFTokenizerError, build_tokenizer

pytestmark = pytest.mark.slow  # tokenizers against transformers' GGUF loader: out of `make test-quick`

TEXTS = ["Hello world", "  two  spaces\n\nnew lines\t tab ", "2024 numbers 12345 3.14159", "don't I'll we're",
         "<|im_start|>user\nhi<|im_end|>\n", "émojis 🤗, ñ ü 中文 日本語", "a" * 40, " leading", "", "\n"]
SPM_PIECES = ["▁t", "▁a", "he", "in", "▁the", "er", "on", "▁s", "▁w", "▁th", "▁he", "ll", "▁hello", "lo", "▁wor",
              "ld", "▁world", "▁is", "is", "▁test", "es", "st", "▁b", "an", "▁an", "ing", "▁I", "'", "▁do", "n't"]


def _random_texts(alphabet: str, count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 30))) for _ in range(count)]


def _assert_same(mine, reference, texts):
    for text in texts:
        ids = reference(text)["input_ids"]
        assert mine(text)["input_ids"] == ids, text
        assert mine.decode(ids) == reference.decode(ids), text
        assert mine.decode(ids, skip_special_tokens=True) == reference.decode(ids, skip_special_tokens=True), text
    for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
        assert getattr(mine, name) == getattr(reference, name), name
    assert len(mine) == len(reference)


def _saved_and_reloaded(tokenizer, folder):
    tokenizer.save_pretrained(folder)
    return AutoTokenizer.from_pretrained(folder)


def test_smollm2_tokenizer_equals_transformers_gguf_loader(tmp_path):
    path = smollm2_gguf_path()
    mine = _saved_and_reloaded(build_tokenizer(gguf.GGUFReader(path)), tmp_path / "mine")
    reference = AutoTokenizer.from_pretrained(str(tmp_path.parent), gguf_file=path)
    seed = 1234
    _assert_same(mine, reference, TEXTS + _random_texts("abc XYZ 0123\n\t'.,!é中🤗<|>_", 200, seed))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]
    for add_generation_prompt in (True, False):
        text = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        assert mine.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt) == text
    assert "<|im_start|>" in mine.all_special_tokens


def _write_tokenizer_gguf(path, model: str, tokens, types, scores=None, merges=None, pre=None,
                          add_bos=None, chat_template=None):
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model(model)
    if pre:
        writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    if scores is not None:
        writer.add_token_scores(scores)
    if merges is not None:
        writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    if add_bos is not None:
        writer.add_add_bos_token(add_bos)
    if chat_template:
        writer.add_chat_template(chat_template)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def _sentencepiece_vocab():
    """<unk> <s> </s>, the 256 byte tokens, single characters, then SPM_PIECES; scores descending as
    SentencePiece writes them (pieces learned earlier score higher)."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256
    scores = [0.0, 0.0, 0.0] + [0.0] * 256
    chars = sorted(set("".join(SPM_PIECES)) | set("abcdefghijklmnopqrstuvwxyz"))
    for rank, piece in enumerate(SPM_PIECES + chars):
        if piece not in tokens:
            tokens.append(piece)
            types.append(1)
            scores.append(-float(rank))
    tokens.append("<tool>")  # USER_DEFINED: matched whole
    types.append(4)
    scores.append(0.0)
    return tokens, types, scores


@pytest.mark.parametrize("add_bos", [None, True, False])
def test_sentencepiece_tokenizer_equals_transformers(tmp_path, add_bos):
    tokens, types, scores = _sentencepiece_vocab()
    path = _write_tokenizer_gguf(tmp_path / "spm.gguf", "llama", tokens, types, scores=scores, add_bos=add_bos,
                                 chat_template="{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    mine = _saved_and_reloaded(build_tokenizer(gguf.GGUFReader(path)), tmp_path / "mine")
    reference = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="spm.gguf")
    texts = ["hello world", "the test is on", "I don't", " Hello  World", "héllo ✓ 中", "<tool> x<tool>y", "<s>x</s>"]
    _assert_same(mine, reference, texts + _random_texts("helowrdtsi 'ÉZ✓\n", 100, seed=7))
    assert (mine("hello")["input_ids"][0] == 1) == (add_bos in (None, True))  # llama.cpp: BOS unless told not


@pytest.mark.parametrize("pre", ["qwen2", "llama-bpe", "smollm"])
def test_byte_level_split_regex_follows_pre(tmp_path, pre):
    tokens = ["<|endoftext|>", "<|s|>", "<|e|>"] + [chr(c) for c in range(33, 127)] + ["Ġ", "Ċ", "ĠĠ", "12", "123"]
    merges = ["Ġ Ġ", "1 2", "12 3"]
    path = _write_tokenizer_gguf(tmp_path / "bpe.gguf", "gpt2", tokens, [3, 3, 3] + [1] * (len(tokens) - 3),
                                 merges=merges, pre=pre)
    mine = _saved_and_reloaded(build_tokenizer(gguf.GGUFReader(path)), tmp_path / "mine")
    reference = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="bpe.gguf")
    texts = ["123456 12 1", "a  b\n\nc", "x's y'LL", "<|s|>hi<|e|>"]
    _assert_same(mine, reference, texts + _random_texts("123 ab\n'.", 100, seed=11))


def test_unsupported_or_malformed_metadata_is_named(tmp_path):
    path = _write_tokenizer_gguf(tmp_path / "u.gguf", "t5", ["<pad>", "<s>", "</s>"], [3, 3, 3], scores=[0.0] * 3)
    with pytest.raises(GGUFTokenizerError, match="'t5' is not supported"):
        build_tokenizer(gguf.GGUFReader(path))
    path = _write_tokenizer_gguf(tmp_path / "m.gguf", "gpt2", ["<s>", "<s2>", "</s>"], [3, 3, 3])
    with pytest.raises(GGUFTokenizerError, match="needs tokenizer.ggml.merges"):
        build_tokenizer(gguf.GGUFReader(path))
    path = _write_tokenizer_gguf(tmp_path / "s.gguf", "llama", ["<unk>", "<s>", "</s>"], [2, 3, 3])
    with pytest.raises(GGUFTokenizerError, match="needs tokenizer.ggml.scores"):
        build_tokenizer(gguf.GGUFReader(path))
