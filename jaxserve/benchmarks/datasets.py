"""The prompts a benchmark sends: `random` token prompts, ShareGPT conversations, a JSONL file,
and the random user turns of `multiturn` conversations.

Every dataset yields `SampleRequest`s with the prompt (text, or token ids when no tokenizer is at
hand), its length in tokens and the output length to ask for. Lengths are counted with the served
model's tokenizer when one is given, as vLLM's benchmarks count them. Errors in a dataset file are
`DatasetError`s naming the file and line.
"""
from __future__ import annotations

import dataclasses
import json
import random
from typing import Protocol, Sequence

# Token ids drawn for random prompts stay inside the vocabulary and away from the low ids, where
# tokenizers keep their special and byte tokens.
RANDOM_TOKEN_LOW = 100


class DatasetError(ValueError):
    """A dataset that cannot be read, or that yields no usable prompt."""


class Tokenizer(Protocol):
    """What the datasets need of a Hugging Face tokenizer."""

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def __len__(self) -> int: ...


@dataclasses.dataclass(frozen=True)
class SampleRequest:
    prompt: str | list[int]  # text, or token ids (the `random` dataset without a tokenizer)
    prompt_len: int  # tokens
    expected_output_len: int  # the max_tokens a benchmark asks for


def _range(length: int, range_ratio: float) -> tuple[int, int]:
    """vLLM's `--random_range_ratio`: lengths uniform in [length*(1-r), length*(1+r)], at least 1."""
    return max(1, int(length * (1 - range_ratio))), max(1, int(length * (1 + range_ratio)))


def random_requests(num_prompts: int, input_len: int, output_len: int, *, range_ratio: float = 0.0,
                    seed: int = 0, tokenizer: Tokenizer | None = None, vocab_size: int | None = None,
                    prefix_len: int = 0) -> list[SampleRequest]:
    """`num_prompts` prompts of random token ids, `input_len` (+/- range_ratio) tokens long after a
    shared prefix of `prefix_len` random tokens. With a tokenizer the ids are decoded to text that
    encodes back to as many tokens (`text_of_length`; the text's own token count is the
    prompt_len); without one the prompt is the id list itself."""
    if num_prompts < 1 or input_len < 1 or output_len < 1 or prefix_len < 0:
        raise DatasetError("random dataset: num_prompts, input_len and output_len must be >= 1, prefix_len >= 0")
    if not 0.0 <= range_ratio < 1.0:
        raise DatasetError(f"random dataset: range_ratio must be in [0, 1), got {range_ratio}")
    vocab = len(tokenizer) if tokenizer is not None else vocab_size
    if vocab is None or vocab <= RANDOM_TOKEN_LOW:
        raise DatasetError("random dataset: needs a tokenizer or a vocabulary size above "
                           f"{RANDOM_TOKEN_LOW}")
    rng = random.Random(seed)
    prefix = random_ids(rng, prefix_len, vocab)
    requests = []
    for _ in range(num_prompts):
        ids = prefix + random_ids(rng, rng.randint(*_range(input_len, range_ratio)), vocab)
        max_tokens = rng.randint(*_range(output_len, range_ratio))
        if tokenizer is None:
            requests.append(SampleRequest(ids, len(ids), max_tokens))
        else:
            text, length = text_of_length(tokenizer, ids, len(ids), rng, vocab)
            requests.append(SampleRequest(text, length, max_tokens))
    return requests


def random_ids(rng: random.Random, count: int, vocab: int) -> list[int]:
    """`count` token ids drawn uniformly from [RANDOM_TOKEN_LOW, vocab)."""
    return [rng.randrange(RANDOM_TOKEN_LOW, vocab) for _ in range(count)]


@dataclasses.dataclass(frozen=True)
class Conversation:
    """The user's side of one `multiturn` conversation, drawn before the run: turn 1's prompt and
    the new tokens each later turn appends after the history (the server's replies, the rest of
    each history, come at run time: `next_turn_prompt`)."""

    first_prompt: list[int]
    turn_inputs: list[list[int]]  # [turns - 1]: the new user tokens of turns 2..T
    output_len: int  # the max_tokens of every turn


def multiturn_conversations(num_conversations: int, num_turns: int, input_len: int, turn_input_len: int,
                            output_len: int, *, seed: int = 0, vocab_size: int, prefix_len: int = 0
                            ) -> list[Conversation]:
    """`num_conversations` conversations of `num_turns` turns. Turn 1 is `random_requests`' prompt
    of the same seed (`input_len` random ids after a shared `prefix_len`), kept as token ids; each
    later turn adds `turn_input_len` random ids, drawn from a stream of their own so that the
    first turns do not depend on the number of turns."""
    if num_turns < 1 or turn_input_len < 0:
        raise DatasetError("multiturn dataset: num_turns must be >= 1 and turn_input_len >= 0")
    firsts = random_requests(num_conversations, input_len, output_len, seed=seed, vocab_size=vocab_size,
                             prefix_len=prefix_len)
    rng = random.Random(f"multiturn:{seed}")  # a str seeds deterministically (random's version 2 seeding)
    return [Conversation(list(first.prompt),
                         [random_ids(rng, turn_input_len, vocab_size) for _ in range(num_turns - 1)], output_len)
            for first in firsts]


def next_turn_prompt(prompt: Sequence[int], reply: Sequence[int], new_input: Sequence[int]) -> list[int]:
    """The next turn's prompt: this turn's prompt, the server's reply to it, the user's new tokens."""
    return [*prompt, *reply, *new_input]


TEXT_LENGTH_TRIES = 10  # rounds of trimming or topping up a random prompt's ids


def text_of_length(tokenizer: Tokenizer, ids: list[int], length: int, rng: random.Random,
                   vocab: int) -> tuple[str, int]:
    """(text, its token count): random ids decoded to text that encodes back to `length` tokens.

    Decoding random ids and encoding the text again rarely gives the same count (byte pieces merge
    or split: SmolLM2's 500 random ids come back as about 523 tokens), which would make
    --random_input_len a different workload on every tokenizer. So the text's own tokens are
    trimmed to `length`, or topped up with more random ids, and decoded again, for a few rounds;
    the count returned is the text's own (within a token or two of `length` where the rounds did
    not settle)."""
    text = tokenizer.decode(ids)
    count = len(tokenizer.encode(text, add_special_tokens=False))
    for _ in range(TEXT_LENGTH_TRIES):
        if count == length:
            break
        tokens = tokenizer.encode(text, add_special_tokens=False)
        if count > length:
            tokens = tokens[:length]
        else:
            tokens = tokens + [rng.randrange(RANDOM_TOKEN_LOW, vocab) for _ in range(length - count)]
        text = tokenizer.decode(tokens)
        count = len(tokenizer.encode(text, add_special_tokens=False))
    return text, count


def _read_json_lines(path: str) -> list[tuple[int, object]]:
    """(line number, parsed value) of a JSONL file; a whole-file JSON list reads as its items."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise DatasetError(f"{path}: {e.strerror or e}") from None
    stripped = text.lstrip()
    if stripped.startswith("["):
        try:
            return [(i + 1, item) for i, item in enumerate(json.loads(text))]
        except json.JSONDecodeError as e:
            raise DatasetError(f"{path}: not valid JSON ({e})") from None
    rows = []
    for number, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            try:
                rows.append((number, json.loads(line)))
            except json.JSONDecodeError as e:
                raise DatasetError(f"{path}:{number}: not valid JSON ({e})") from None
    return rows


def _count(tokenizer: Tokenizer | None, text: str) -> int:
    """Tokens in `text`: the tokenizer's count, else a whitespace-word count (stated in --help)."""
    return len(tokenizer.encode(text, add_special_tokens=False)) if tokenizer is not None else len(text.split())


def _sharegpt_turns(path: str, number: int, item: object) -> tuple[str, str] | None:
    """The first human turn and the reply to it, or None for a conversation without both."""
    turns = item.get("conversations") if isinstance(item, dict) else None
    if not isinstance(turns, list):
        raise DatasetError(f"{path}:{number}: a ShareGPT entry needs a 'conversations' list")
    if len(turns) < 2 or not all(isinstance(t, dict) and isinstance(t.get("value"), str) for t in turns[:2]):
        return None
    return turns[0]["value"], turns[1]["value"]


def sharegpt_requests(path: str, num_prompts: int, *, tokenizer: Tokenizer | None = None,
                      output_len: int | None = None, seed: int = 0, max_prompt_len: int | None = None
                      ) -> list[SampleRequest]:
    """ShareGPT conversations (a JSON list or JSONL of {"conversations": [{"from", "value"}, ...]}):
    the first turn is the prompt; the reply's length is the output length unless `output_len` is
    given. Sampled with `seed`, without replacement, skipping empty turns and prompts over
    `max_prompt_len` tokens, as vLLM's sharegpt dataset does."""
    rows = _read_json_lines(path)
    random.Random(seed).shuffle(rows)
    requests, too_long = [], 0
    for number, item in rows:
        turns = _sharegpt_turns(path, number, item)
        if turns is None or not turns[0].strip() or not turns[1].strip():
            continue
        prompt_len = _count(tokenizer, turns[0])
        if max_prompt_len is not None and prompt_len > max_prompt_len:
            too_long += 1
            continue
        requests.append(SampleRequest(turns[0], prompt_len, output_len or max(1, _count(tokenizer, turns[1]))))
        if len(requests) == num_prompts:
            return requests
    skipped = f" ({too_long} left out: prompts over {max_prompt_len} tokens)" if too_long else ""
    if not requests and not too_long:
        raise DatasetError(f"{path}: no usable conversation (each needs a first turn and a reply)")
    raise DatasetError(f"{path}: {len(requests)} usable conversations{skipped}, fewer than "
                       f"--num_prompts={num_prompts}")


def jsonl_requests(path: str, num_prompts: int, *, tokenizer: Tokenizer | None = None,
                   output_len: int = 128) -> list[SampleRequest]:
    """A JSONL file of {"prompt": text, "output_tokens": N (optional)}, in file order, cycled when
    shorter than `num_prompts` (vLLM's custom dataset)."""
    rows = _read_json_lines(path)
    samples = []
    for number, item in rows:
        if not isinstance(item, dict) or not isinstance(item.get("prompt"), str) or not item["prompt"]:
            raise DatasetError(f"{path}:{number}: each line needs a non-empty string 'prompt'")
        max_tokens = item.get("output_tokens", output_len)
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise DatasetError(f"{path}:{number}: 'output_tokens' must be a positive integer")
        samples.append(SampleRequest(item["prompt"], _count(tokenizer, item["prompt"]), max_tokens))
    if not samples:
        raise DatasetError(f"{path}: no prompts")
    return [samples[i % len(samples)] for i in range(num_prompts)]
