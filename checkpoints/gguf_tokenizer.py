"""A GGUF file's tokenizer (vocabulary, merges, special tokens, chat template) as a Hugging Face fast
tokenizer, built with `gguf` and `tokenizers` alone: no torch.

transformers' own GGUF loader reads the file with a module that imports torch, so `pip install
jaxserve` could not convert a GGUF model; this builds the same tokenizer (tested against
transformers' on the default model and on tiny files of both kinds) from the metadata that
`gguf.GGUFReader` already parsed. Two vocabulary kinds, those of the families jaxserve converts:
- `gpt2`: byte-level BPE (SmolLM2, Llama 3, Qwen2), merges in the file, the split regex chosen by
  `tokenizer.ggml.pre`;
- `llama`: SentencePiece BPE (Llama 2, Mistral, TinyLlama), merges recovered from the token scores,
  byte fallback, a "▁" space prefix.
Tokens of type CONTROL become special added tokens, USER_DEFINED ones plain added tokens, so that
both are matched whole in text, as llama.cpp does.
"""
from __future__ import annotations

import gguf
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

CONTROL, USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values (llama.cpp's llama_token_type)
SPACE_MARK = "\u2581"  # SentencePiece's "▁"

# tokenizer.ggml.pre -> the split regex its merges were learned with (GPT-2's when absent).
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZER_SPLITS = {"llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
                        "smaug-bpe": _LLAMA3_SPLIT, "dbrx": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT,
                        "deepseek-r1-qwen": _QWEN2_SPLIT}
SUPPORTED_MODELS = ("gpt2", "llama")


class GGUFTokenizerError(ValueError):
    """The file's tokenizer metadata is missing, malformed or of a kind not supported."""


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the byte-level vocabulary's spelling)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            table[byte] = chr(byte)
        else:
            table[byte] = chr(256 + extra)
            extra += 1
    return table


def _field(reader: gguf.GGUFReader, key: str, default=None):
    field = reader.get_field(key)
    return default if field is None else field.contents()


def _sentencepiece_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """The BPE merges a SentencePiece vocabulary implies: every split of a token into two tokens of
    the vocabulary, the merged token's score first (higher merges earlier), ties by the pieces'
    lengths, then by the pieces' ids (as transformers derives them)."""
    ids = {token: index for index, token in enumerate(tokens)}
    merges = []
    for token, score in zip(tokens, scores):
        local = [(token[:i], token[i:], score) for i in range(1, len(token))
                 if token[:i] in ids and token[i:] in ids]
        merges.extend(sorted(local, key=lambda m: (ids[m[0]], ids[m[1]])))
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def _byte_level(tokens: list[str], merges: list[str], pre: str | None) -> Tokenizer:
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab = {}
    for index, token in enumerate(tokens):  # a token outside the byte alphabet is spelled in it
        spelled = token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode("utf-8"))
        vocab.setdefault(spelled, index)
    pairs = []
    for merge in merges:
        left, sep, right = merge.partition(" ")
        if not sep:
            raise GGUFTokenizerError(f"malformed merge {merge!r} in tokenizer.ggml.merges")
        pairs.append((left, right))
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=pairs, dropout=None, continuing_subword_prefix="",
                                     end_of_word_suffix="", fuse_unk=False))
    split = PRE_TOKENIZER_SPLITS.get(pre)
    if split is None:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _sentencepiece(tokens: list[str], scores: list[float] | None, unk: str | None,
                   add_space_prefix: bool) -> Tokenizer:
    if scores is None or len(scores) != len(tokens):
        raise GGUFTokenizerError("a SentencePiece vocabulary needs tokenizer.ggml.scores, one per token")
    vocab = {}
    for index, token in enumerate(tokens):
        vocab.setdefault(token, index)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=_sentencepiece_merges(tokens, scores), unk_token=unk,
                                     fuse_unk=True, byte_fallback=True, dropout=None))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement=SPACE_MARK, prepend_scheme="first" if add_space_prefix else "never", split=False)
    steps = [decoders.Replace(SPACE_MARK, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        steps.append(decoders.Strip(content=" ", left=1))
    tokenizer.decoder = decoders.Sequence(steps)
    return tokenizer


def build_tokenizer(reader: gguf.GGUFReader):
    """The file's tokenizer as a `transformers.PreTrainedTokenizerFast` (chat template, BOS/EOS/UNK/PAD
    and the added tokens set), or None when the file has no vocabulary. GGUFTokenizerError names what
    is missing or unsupported."""
    from transformers import PreTrainedTokenizerFast

    tokens = _field(reader, "tokenizer.ggml.tokens")
    if tokens is None:
        return None
    kind = _field(reader, "tokenizer.ggml.model")
    if kind not in SUPPORTED_MODELS:
        raise GGUFTokenizerError(f"tokenizer.ggml.model {kind!r} is not supported; supported: "
                                 f"{', '.join(SUPPORTED_MODELS)}")
    types = _field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)

    def token(key: str) -> str | None:
        index = _field(reader, f"tokenizer.ggml.{key}")
        if index is None:
            return None
        if not 0 <= int(index) < len(tokens):
            raise GGUFTokenizerError(f"tokenizer.ggml.{key} {index} is outside the vocabulary ({len(tokens)})")
        return tokens[int(index)]

    unk = token("unknown_token_id")
    if kind == "gpt2":
        merges = _field(reader, "tokenizer.ggml.merges")
        if merges is None:
            raise GGUFTokenizerError("a byte-level BPE vocabulary needs tokenizer.ggml.merges")
        backend = _byte_level(tokens, merges, _field(reader, "tokenizer.ggml.pre"))
        alphabet = set(_bytes_to_unicode().values())
        add_bos = bool(_field(reader, "tokenizer.ggml.add_bos_token", False))
    else:
        backend = _sentencepiece(tokens, _field(reader, "tokenizer.ggml.scores"), unk,
                                 bool(_field(reader, "tokenizer.ggml.add_space_prefix", True)))
        alphabet = None
        add_bos = bool(_field(reader, "tokenizer.ggml.add_bos_token", True))  # llama.cpp's default for SPM
    # A CONTROL token outside the byte alphabet is a mislabel of llama.cpp's in a byte-level vocabulary.
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t, kind_ in zip(tokens, types)
                                if kind_ == CONTROL and (alphabet is None or set(t) <= alphabet)])
    backend.add_tokens([AddedToken(t, normalized=False, special=False) for t, kind_ in zip(tokens, types)
                        if kind_ == USER_DEFINED])

    bos, eos = token("bos_token_id"), token("eos_token_id")
    add_eos = bool(_field(reader, "tokenizer.ggml.add_eos_token", False))

    def template(sequence: str) -> list[str]:
        return ([f"{bos}:0"] if add_bos and bos else []) + [sequence] + ([f"{eos}:0"] if add_eos and eos else [])

    specials = [(t, backend.token_to_id(t)) for t in dict.fromkeys([bos if add_bos else None,
                                                                  eos if add_eos else None]) if t]
    backend.post_processor = processors.TemplateProcessing(
        single=template("$A:0"), pair=template("$A:0") + template("$B:1"), special_tokens=specials)

    chat_template = _field(reader, "tokenizer.chat_template")
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=bos, eos_token=eos, unk_token=unk, pad_token=token("padding_token_id"),
        add_bos_token=add_bos, add_eos_token=add_eos, clean_up_tokenization_spaces=False,
        **({"chat_template": chat_template} if chat_template else {}))
