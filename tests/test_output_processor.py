import random
import string

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from jaxserve.core.output_processor import (REPLACEMENT_CHAR, CoreOutput, IncrementalDetokenizer, OutputProcessor,
                                       RowLogprobs, StopChecker, find_stop_string, partial_stop_suffix_len)
from jaxserve.core.request import SamplingParams

TEXT = "héllo wörld, 日本語 😀 the café end"


def byte_level_tokenizer():
    """A tiny byte-level BPE (GPT-2 / Llama 3 style): characters not merged stay split in bytes."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = ["hello world, the quick brown fox jumps over the lazy dog", "héllo wörld café naïve", "the end"]
    tokenizer.train_from_iterator(corpus * 3, trainer)
    return tokenizer


def metaspace_tokenizer():
    """A tiny SentencePiece-style BPE (Llama 2 style): "▁" for spaces, byte fallback for the rest."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for byte in range(256):
        vocab[f"<0x{byte:02X}>"] = len(vocab)
    for char in ["▁", ",", "é"] + list(string.ascii_lowercase):
        vocab[char] = len(vocab)
    merges = [("▁", "h"), ("e", "l"), ("l", "o"), ("▁h", "el"), ("▁hel", "lo"), ("▁", "w"), ("o", "r")]
    for left, right in merges:
        vocab[left + right] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                           decoders.Strip(" ", 1, 0)])
    return tokenizer


def as_hf(tokenizer):
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>")


TOKENIZERS = {
    "byte_level": byte_level_tokenizer,
    "byte_level_hf": lambda: as_hf(byte_level_tokenizer()),
    "metaspace": metaspace_tokenizer,
    "metaspace_hf": lambda: as_hf(metaspace_tokenizer()),
}


def encode(tokenizer, text):
    if isinstance(tokenizer, Tokenizer):
        return tokenizer.encode(text).ids
    return tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
@pytest.mark.parametrize("num_prompt_tokens", [0, 1, 3, 8])
def test_streamed_text_never_breaks_characters(name, num_prompt_tokens):
    tokenizer = TOKENIZERS[name]()
    ids = encode(tokenizer, TEXT)
    assert any(REPLACEMENT_CHAR in tokenizer.decode([i]) for i in ids), "the text must split characters"
    prompt, output = ids[:num_prompt_tokens], ids[num_prompt_tokens:]
    detokenizer = IncrementalDetokenizer(tokenizer, prompt)
    deltas = [detokenizer.add(token_id) for token_id in output]
    assert all(REPLACEMENT_CHAR not in delta for delta in deltas)
    assert "" in deltas  # some text was held back until its character was complete
    expected = TEXT[len(tokenizer.decode(prompt)):]
    assert "".join(deltas) == detokenizer.output_text == expected
    assert detokenizer.flush() == ""


@pytest.mark.parametrize("skip, expected", [(True, ""), (False, "</s>")])
def test_special_tokens(skip, expected):
    tokenizer = as_hf(byte_level_tokenizer())
    detokenizer = IncrementalDetokenizer(tokenizer, encode(tokenizer, "the"), skip_special_tokens=skip)
    assert detokenizer.add(encode(tokenizer, " the")[0]) == " the"
    assert detokenizer.add(tokenizer.eos_token_id) == expected


def test_flush_releases_an_incomplete_character():
    tokenizer = byte_level_tokenizer()
    detokenizer = IncrementalDetokenizer(tokenizer, encode(tokenizer, "the"))
    first_byte_of_emoji = encode(tokenizer, "😀")[0]
    assert detokenizer.add(encode(tokenizer, " the")[0]) == " the"
    assert detokenizer.add(first_byte_of_emoji) == ""
    assert detokenizer.flush() == REPLACEMENT_CHAR and detokenizer.output_text == " the" + REPLACEMENT_CHAR


def stream(checker, deltas):
    emitted, stopped = [], False
    for delta in deltas:
        out, stopped = checker.add(delta)
        emitted.append(out)
    return emitted, stopped


def test_stop_string_is_excluded():
    checker = StopChecker(["STOP"])
    emitted, stopped = stream(checker, ["ab", "cS", "TOPd", "more"])
    assert emitted == ["ab", "c", "", ""] and stopped and checker.matched_stop == "STOP"
    assert checker.output_text == "abc" and checker.flush() == ""


def test_partial_stop_string_is_held_then_released():
    checker = StopChecker(["</a>"])
    emitted, stopped = stream(checker, ["x <", "/a", "b> y"])
    assert emitted == ["x ", "", "</ab> y"] and not stopped


def test_held_tail_released_by_flush():
    checker = StopChecker(["end!"])
    emitted, stopped = stream(checker, ["the en"])
    assert emitted == ["the "] and not stopped
    assert checker.flush() == "en" and checker.output_text == "the en"


def test_stop_completed_first_wins_over_a_longer_pending_one():
    checker = StopChecker(["abbb", "b"])
    assert checker.add("a") == ("", False)  # could become "abbb"
    assert checker.add("b") == ("a", True)  # "b" is complete now; generation ends here


def test_earliest_stop_string_wins():
    assert find_stop_string("xfoobar", ["bar", "foo"]) == (1, "foo")
    assert find_stop_string("xfoobar", ["bar", "foo"], search_from=2) == (4, "bar")
    assert find_stop_string("xyz", ["bar"]) is None
    checker = StopChecker(["bar", "foo"])
    assert checker.add("xfoobar") == ("x", True)


def test_partial_suffix_length():
    assert partial_stop_suffix_len("abc<", ["<stop>", "c<s"]) == 2
    assert partial_stop_suffix_len("abc", ["abc"]) == 0  # a whole match is not partial
    assert partial_stop_suffix_len("", ["a"]) == 0


def test_no_stop_strings_streams_everything():
    checker = StopChecker([])
    assert stream(checker, ["a", "b"]) == (["a", "b"], False)


def test_random_streams_match_one_shot_truncation():
    rng = random.Random(0)
    for _ in range(500):
        stop = ["".join(rng.choices("ab", k=rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
        text = "".join(rng.choices("abc", k=rng.randint(0, 20)))
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(0, 6))))
        deltas = [text[i:j] for i, j in zip([0] + cuts, cuts + [len(text)])]
        # Generation ends at the first delta that completes a stop string.
        seen, match = "", None
        for delta in deltas:
            seen += delta
            match = find_stop_string(seen, stop)
            if match is not None:
                break
        expected = seen if match is None else seen[:match[0]]
        checker = StopChecker(stop)
        emitted = ""
        for delta in deltas:
            out, stopped = checker.add(delta)
            emitted += out
            assert expected.startswith(emitted)
            if not stopped:
                assert len(checker.text) - len(emitted) < max(map(len, stop))
        assert emitted + checker.flush() == expected and checker.stopped == (match is not None)


# ---- the output processor: core results -> deltas ---------------------------------------------
def core(request_id, token_ids, num_output_tokens, finish_reason=None, **fields):
    return CoreOutput(request_id, tuple(token_ids), finish_reason, num_prompt_tokens=2,
                      num_output_tokens=num_output_tokens, **fields)


def run_tokens(processor, request_id, ids, last_reason="length"):
    """Feeds `ids` one per step, the last one ending the request with `last_reason`; the deltas."""
    outputs, stopped = [], []
    for i, token_id in enumerate(ids):
        out, ids_stopped = processor.process([core(request_id, [token_id], i + 1,
                                                   last_reason if i == len(ids) - 1 else None)])
        outputs += out
        stopped += ids_stopped
        if out[0].finished:
            break
    return outputs, stopped


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
def test_output_processor_streams_the_text_and_flushes_at_the_end(name):
    tokenizer = TOKENIZERS[name]()
    ids = encode(tokenizer, TEXT)
    processor = OutputProcessor(tokenizer)
    processor.add("r", ids[:2], SamplingParams())
    output_ids = ids[2:] + encode(tokenizer, "😀")[:1]  # byte-level: ends mid-character, held until the end
    outputs, stopped = run_tokens(processor, "r", output_ids)
    expected = tokenizer.decode(ids[:2] + output_ids)[len(tokenizer.decode(ids[:2])):]
    assert "".join(o.new_text for o in outputs) == expected and stopped == []
    assert [o.new_token_ids for o in outputs] == [[t] for t in output_ids]
    assert [o.finished for o in outputs] == [False] * (len(outputs) - 1) + [True]
    assert outputs[-1].finish_reason == "length" and not processor.has("r")


def test_output_processor_cuts_a_stop_string_and_reports_it():
    tokenizer = byte_level_tokenizer()
    ids = encode(tokenizer, "hello world, the quick brown fox")
    processor = OutputProcessor(tokenizer)
    processor.add("r", ids[:1], SamplingParams(stop=["quick"]))
    outputs, stopped = run_tokens(processor, "r", ids[1:])
    assert "".join(o.new_text for o in outputs) == tokenizer.decode(ids)[len(tokenizer.decode(ids[:1])):].split(
        "quick")[0]
    assert stopped == ["r"] and outputs[-1].finished and outputs[-1].finish_reason == "stop"
    assert len(outputs) < len(ids) - 1 and not processor.has("r")  # ended at the token completing "quick"


def test_output_processor_a_stop_token_is_not_text_but_releases_the_held_tail():
    tokenizer = byte_level_tokenizer()
    processor = OutputProcessor(tokenizer)
    processor.add("r", encode(tokenizer, "the"), SamplingParams(stop=["end!"]))
    en = encode(tokenizer, " en")
    outputs, stopped = run_tokens(processor, "r", en + [1], last_reason="stop")  # 1: "</s>", a stop token
    assert "".join(o.new_text for o in outputs[:-1]) == " "  # "en" could start "end!": held back
    assert outputs[-1].new_text == "en" and stopped == []  # released at the end; the core ended it
    assert outputs[-1].new_token_ids == [1] and outputs[-1].finish_reason == "stop"


def test_output_processor_shapes_logprobs_and_closes_without_a_token():
    import numpy as np
    processor = OutputProcessor(None)  # no tokenizer: token ids only
    processor.add("r", [5, 6], SamplingParams(logprobs=2))
    row = RowLogprobs(-0.5, np.array([7, 3, 9], np.int32), np.array([-0.5, -1.5, -2.0], np.float32))
    (out,), _ = processor.process([core("r", [7], 1, logprobs=row)])
    assert out.new_text == "" and out.new_token_ids == [7] and not out.finished
    (lp,) = out.new_logprobs
    assert (lp.token_id, lp.logprob, lp.top) == (7, -0.5, [(7, -0.5), (3, -1.5)])
    (closed,), _ = processor.process([core("r", [], 1, "abort")])
    assert (closed.finished, closed.finish_reason, closed.new_token_ids, closed.new_logprobs) == (True, "abort", [],
                                                                                                  None)
    (failed,), _ = processor.process([core("unknown", [], 0, "error", error="boom")])
    assert (failed.finish_reason, failed.error, failed.new_text) == ("error", "boom", "")


# ---- include_stop_str_in_output, stop_reason, min_tokens, skip_special_tokens ---------------------
def test_the_stop_string_is_kept_when_asked():
    checker = StopChecker(["STOP"], include_stop_str_in_output=True)
    emitted, stopped = stream(checker, ["ab", "cS", "TOPd", "more"])
    assert emitted == ["ab", "c", "STOP", ""] and stopped and checker.output_text == "abcSTOP"


def test_text_added_without_search_is_emitted_whole_and_never_matched():
    checker = StopChecker(["ab"])
    assert checker.add("xa", search=False) == ("xa", False)  # "a" could start "ab", but is not held back
    assert checker.add("b") == ("b", False)  # "ab" straddles the boundary: not a match (begins before it)
    assert checker.add("zab") == ("z", True) and checker.matched_stop == "ab"


def test_random_streams_with_a_search_floor_match_one_shot_truncation():
    rng = random.Random(1)
    for _ in range(300):
        stop = ["".join(rng.choices("ab", k=rng.randint(1, 3))) for _ in range(rng.randint(1, 2))]
        deltas = ["".join(rng.choices("abc", k=rng.randint(0, 4))) for _ in range(rng.randint(1, 8))]
        unsearched = rng.randint(0, len(deltas))
        include = rng.random() < 0.5
        floor = len("".join(deltas[:unsearched]))
        # Generation ends at the first searched delta after which a stop string begins at or past the floor.
        seen, match = "", None
        for i, delta in enumerate(deltas):
            seen += delta
            match = find_stop_string(seen, stop, floor) if i >= unsearched else None
            if match is not None:
                break
        expected = seen if match is None else seen[:match[0] + (len(match[1]) if include else 0)]
        checker = StopChecker(stop, include)
        emitted = ""
        for i, delta in enumerate(deltas):
            out, stopped = checker.add(delta, search=i >= unsearched)
            emitted += out
            if stopped:
                break
        assert emitted + checker.flush() == expected, (stop, deltas, unsearched, include)


def test_output_processor_names_the_stop_reason():
    tokenizer = byte_level_tokenizer()
    ids = encode(tokenizer, "hello world, the quick brown fox")
    processor = OutputProcessor(tokenizer)
    processor.add("string", ids[:1], SamplingParams(stop=["quick"], include_stop_str_in_output=True))
    outputs, stopped = run_tokens(processor, "string", ids[1:])
    assert "".join(o.new_text for o in outputs).endswith("the quick") and stopped == ["string"]
    assert outputs[-1].stop_reason == "quick" and all(o.stop_reason is None for o in outputs[:-1])
    processor.add("token", ids[:1], SamplingParams(stop_token_ids=[ids[3]]))
    outputs, _ = run_tokens(processor, "token", ids[1:4], last_reason="stop")
    assert (outputs[-1].finish_reason, outputs[-1].stop_reason) == ("stop", ids[3])
    processor.add("eos", ids[:1], SamplingParams(stop_token_ids=[ids[3]]))
    outputs, _ = run_tokens(processor, "eos", ids[1:3] + [1], last_reason="stop")  # 1: </s>, the EOS
    assert (outputs[-1].finish_reason, outputs[-1].stop_reason) == ("stop", None)
    processor.add("length", ids[:1], SamplingParams(stop=["zzz"]))
    outputs, _ = run_tokens(processor, "length", ids[1:4])
    assert (outputs[-1].finish_reason, outputs[-1].stop_reason) == ("length", None)


def test_a_stop_token_is_text_with_include_stop_str_in_output():
    tokenizer = byte_level_tokenizer()
    ids = encode(tokenizer, "the quick brown")
    for include in (False, True):
        processor = OutputProcessor(tokenizer)
        processor.add("r", ids[:1], SamplingParams(stop_token_ids=[ids[-1]], include_stop_str_in_output=include))
        outputs, _ = run_tokens(processor, "r", ids[1:], last_reason="stop")
        text = "".join(o.new_text for o in outputs)
        whole = tokenizer.decode(ids)[len(tokenizer.decode(ids[:1])):]
        assert text == (whole if include else tokenizer.decode(ids[:-1])[len(tokenizer.decode(ids[:1])):])


def test_stop_strings_wait_for_min_tokens():
    tokenizer = byte_level_tokenizer()
    ids = encode(tokenizer, "the end, the end, the end")
    end_tokens = [i + 1 for i in range(len(ids)) if tokenizer.decode(ids[:i + 1]).endswith("end")]
    assert len(end_tokens) >= 2
    for min_tokens, first_stop in ((0, end_tokens[0]), (end_tokens[0], end_tokens[1])):
        processor = OutputProcessor(tokenizer)
        processor.add("r", [], SamplingParams(stop=["end"], min_tokens=min_tokens, max_tokens=len(ids)))
        outputs, stopped = run_tokens(processor, "r", ids)
        assert stopped == ["r"] and len(outputs) == first_stop, min_tokens  # ended by the token completing it
        assert "".join(o.new_text for o in outputs) == tokenizer.decode(ids[:first_stop]).removesuffix("end")


def test_special_tokens_are_text_when_not_skipped():
    tokenizer = as_hf(byte_level_tokenizer())
    the = encode(tokenizer, " the")
    for skip, expected in ((True, " the"), (False, " the</s>")):
        processor = OutputProcessor(tokenizer)
        processor.add("r", encode(tokenizer, "the"), SamplingParams(skip_special_tokens=skip))
        outputs, _ = run_tokens(processor, "r", the + [tokenizer.eos_token_id])
        assert "".join(o.new_text for o in outputs) == expected
