"""jaxserve.benchmarks.datasets: random, ShareGPT and JSONL prompts (jax-free, a toy tokenizer)."""
from __future__ import annotations

import json

import pytest

from jaxserve.benchmarks.datasets import (RANDOM_TOKEN_LOW, DatasetError, jsonl_requests, random_requests,
                                          sharegpt_requests)


class CharTokenizer:
    """One token per character: id = code point (decodes back exactly)."""

    def encode(self, text, add_special_tokens=True):
        return [ord(c) for c in text]

    def decode(self, ids):
        return "".join(chr(i) for i in ids)

    def __len__(self):
        return 400


def test_random_prompts_without_a_tokenizer_are_token_ids():
    requests = random_requests(50, 20, 10, range_ratio=0.5, seed=7, vocab_size=300, prefix_len=4)
    assert requests == random_requests(50, 20, 10, range_ratio=0.5, seed=7, vocab_size=300, prefix_len=4)
    assert requests != random_requests(50, 20, 10, range_ratio=0.5, seed=8, vocab_size=300, prefix_len=4)
    prefix = requests[0].prompt[:4]
    for r in requests:
        assert isinstance(r.prompt, list) and r.prompt[:4] == prefix and r.prompt_len == len(r.prompt)
        assert 4 + 10 <= r.prompt_len <= 4 + 30 and 5 <= r.expected_output_len <= 15
        assert all(RANDOM_TOKEN_LOW <= t < 300 for t in r.prompt)
    assert len({r.prompt_len for r in requests}) > 1  # the range ratio spreads lengths
    fixed = random_requests(3, 8, 2, seed=0, vocab_size=300)
    assert [(r.prompt_len, r.expected_output_len) for r in fixed] == [(8, 2)] * 3


def test_random_prompts_with_a_tokenizer_are_text():
    tokenizer = CharTokenizer()
    requests = random_requests(5, 12, 3, seed=1, tokenizer=tokenizer)
    for r in requests:
        assert isinstance(r.prompt, str) and r.prompt_len == len(tokenizer.encode(r.prompt)) == 12


class MergingTokenizer(CharTokenizer):
    """Re-encoding is not the identity: ids decode to one character each, but "de" (ids 100, 101)
    encodes to one token (id 1000), as byte-level BPE merges pieces of random ids."""

    def encode(self, text, add_special_tokens=True):
        ids, i = [], 0
        while i < len(text):
            if text.startswith("de", i):
                ids.append(1000)
                i += 2
            else:
                ids.append(ord(text[i]))
                i += 1
        return ids

    def decode(self, ids):
        return "".join("de" if i == 1000 else chr(i) for i in ids)

    def __len__(self):
        return 104  # random ids 100..103: one adjacent pair in 16 is "de"


def test_random_text_prompts_encode_back_to_the_length_asked():
    tokenizer = MergingTokenizer()
    merged = tokenizer.encode(tokenizer.decode(list(range(100, 104)) * 10))
    assert len(merged) < 40  # decoding and encoding again does change the count
    for seed in range(20):
        for r in random_requests(5, 40, 3, seed=seed, tokenizer=tokenizer):
            assert r.prompt_len == len(tokenizer.encode(r.prompt)) == 40, f"seed {seed}"


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_prompts=0), "must be >= 1"), (dict(range_ratio=1.0), "range_ratio"),
    (dict(vocab_size=None), "needs a tokenizer"), (dict(vocab_size=RANDOM_TOKEN_LOW), "needs a tokenizer")])
def test_random_bad_arguments(kwargs, message):
    args = dict(num_prompts=2, input_len=4, output_len=4, vocab_size=300) | kwargs
    with pytest.raises(DatasetError, match=message):
        random_requests(args.pop("num_prompts"), args.pop("input_len"), args.pop("output_len"), **args)


def conversation(human: str, reply: str) -> dict:
    return {"conversations": [{"from": "human", "value": human}, {"from": "gpt", "value": reply}]}


def test_sharegpt_list_and_jsonl(tmp_path):
    entries = [conversation(f"question number {i}", "a b c d") for i in range(6)]
    entries += [conversation("", "empty prompt"), {"conversations": [{"from": "human", "value": "alone"}]}]
    as_list, as_lines = tmp_path / "sg.json", tmp_path / "sg.jsonl"
    as_list.write_text(json.dumps(entries))
    as_lines.write_text("\n".join(json.dumps(e) for e in entries) + "\n")
    a = sharegpt_requests(str(as_list), 6, seed=3)
    assert a == sharegpt_requests(str(as_lines), 6, seed=3)  # same rows, same shuffle
    assert sorted(r.prompt for r in a) == sorted(f"question number {i}" for i in range(6))
    assert all(r.prompt_len == 3 and r.expected_output_len == 4 for r in a)  # word counts without a tokenizer
    fixed = sharegpt_requests(str(as_list), 2, output_len=9, tokenizer=CharTokenizer())
    assert all(r.expected_output_len == 9 and r.prompt_len == len(r.prompt) for r in fixed)
    with pytest.raises(DatasetError, match="6 usable conversations, fewer than --num_prompts=7"):
        sharegpt_requests(str(as_list), 7)
    with pytest.raises(DatasetError, match="6 left out: prompts over 2 tokens"):
        sharegpt_requests(str(as_list), 1, max_prompt_len=2)  # every prompt has 3 words: none is kept


def test_sharegpt_seed_changes_the_sample(tmp_path):
    path = tmp_path / "sg.json"
    path.write_text(json.dumps([conversation(f"prompt {i}", "reply") for i in range(40)]))
    first = [r.prompt for r in sharegpt_requests(str(path), 5, seed=0)]
    assert first == [r.prompt for r in sharegpt_requests(str(path), 5, seed=0)]
    assert first != [r.prompt for r in sharegpt_requests(str(path), 5, seed=1)]


def test_dataset_file_errors_name_the_file_and_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{not json\n')
    with pytest.raises(DatasetError, match=r"bad.jsonl:2: not valid JSON"):
        jsonl_requests(str(bad), 1)
    with pytest.raises(DatasetError, match="No such file"):
        sharegpt_requests(str(tmp_path / "missing.json"), 1)
    no_conversations = tmp_path / "x.jsonl"
    no_conversations.write_text('{"text": "hi"}\n')
    with pytest.raises(DatasetError, match=r"x.jsonl:1: a ShareGPT entry needs a 'conversations' list"):
        sharegpt_requests(str(no_conversations), 1)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(DatasetError, match="no prompts"):
        jsonl_requests(str(empty), 1)


def test_jsonl_cycles_and_reads_output_tokens(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "one two", "output_tokens": 5}\n\n{"prompt": "three"}\n')
    requests = jsonl_requests(str(path), 5, output_len=7)
    assert [r.prompt for r in requests] == ["one two", "three", "one two", "three", "one two"]
    assert [r.expected_output_len for r in requests[:2]] == [5, 7] and [r.prompt_len for r in requests[:2]] == [2, 1]
    for line, message in (('{"prompt": ""}', "non-empty string 'prompt'"), ('["x"]', "non-empty string"),
                          ('{"prompt": "x", "output_tokens": 0}', "positive integer"),
                          ('{"prompt": "x", "output_tokens": true}', "positive integer")):
        path.write_text(line + "\n")
        with pytest.raises(DatasetError, match=message):
            jsonl_requests(str(path), 1)
