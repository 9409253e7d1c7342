"""Incremental detokenization and stop-string handling for streamed output.

`IncrementalDetokenizer` turns one new token id at a time into a text delta. It decodes a short
window of recent tokens twice (with and without the new tokens) and emits the difference, holding
the text back while it ends with U+FFFD (a multi-byte character split across tokens).

`StopChecker` cuts the streamed text before the first stop string and holds back any suffix that
could still grow into one, releasing it once it turns out not to match.
"""
from __future__ import annotations

from typing import Any, Sequence

REPLACEMENT_CHAR = "\ufffd"
_NUM_CONTEXT_TOKENS = 5  # prompt tokens decoded with the first output tokens (spacing, merges)


class IncrementalDetokenizer:
    """Detokenizes the output of one request token by token.

    `tokenizer` is anything with `decode(ids, skip_special_tokens=...)`: a Hugging Face
    tokenizer or a `tokenizers.Tokenizer`.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self._prefix_offset = max(len(self.token_ids) - _NUM_CONTEXT_TOKENS, 0)
        self._read_offset = len(self.token_ids)
        self.output_text = ""

    def _decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> str:
        """Appends one generated token; returns the text it completes ("" while held back)."""
        self.token_ids.append(int(token_id))
        prefix_text = self._decode(self.token_ids[self._prefix_offset:self._read_offset])
        full_text = self._decode(self.token_ids[self._prefix_offset:])
        if len(full_text) <= len(prefix_text) or full_text.endswith(REPLACEMENT_CHAR):
            return ""
        delta = full_text[len(prefix_text):]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self.token_ids)
        self.output_text += delta
        return delta

    def flush(self) -> str:
        """Returns the text still held back (possibly with U+FFFD) when the request ends."""
        if self._read_offset == len(self.token_ids):
            return ""
        prefix_text = self._decode(self.token_ids[self._prefix_offset:self._read_offset])
        full_text = self._decode(self.token_ids[self._prefix_offset:])
        delta = full_text[len(prefix_text):]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self.token_ids)
        self.output_text += delta
        return delta


def find_stop_string(text: str, stop: Sequence[str], search_from: int = 0) -> tuple[int, str] | None:
    """The earliest stop string occurring in `text` at or after `search_from`: (index, string)."""
    best: tuple[int, str] | None = None
    for stop_string in stop:
        index = text.find(stop_string, search_from)
        if index >= 0 and (best is None or index < best[0]):
            best = (index, stop_string)
    return best


def partial_stop_suffix_len(text: str, stop: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
    longest = 0
    for stop_string in stop:
        for length in range(min(len(stop_string) - 1, len(text)), longest, -1):
            if text.endswith(stop_string[:length]):
                longest = length
                break
    return longest


class StopChecker:
    """Streams text with stop strings cut out.

    Feed each text delta to `add`; it returns the text that is safe to emit now and whether a stop
    string matched (then the emitted text ends right before it and later deltas are ignored). At
    the end of a request without a stop match, `flush` releases the held-back tail.
    """

    def __init__(self, stop: Sequence[str]) -> None:
        self.stop = [s for s in stop if s]
        self._max_stop_len = max((len(s) for s in self.stop), default=0)
        self.text = ""  # everything seen (up to the stop string once one matched)
        self.num_emitted_chars = 0
        self.matched_stop: str | None = None

    @property
    def stopped(self) -> bool:
        return self.matched_stop is not None

    @property
    def output_text(self) -> str:
        """The text so far, without the stop string and what followed it."""
        return self.text

    def add(self, delta: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        search_from = max(0, len(self.text) - self._max_stop_len + 1)
        self.text += delta
        match = find_stop_string(self.text, self.stop, search_from)
        if match is not None:
            index, self.matched_stop = match
            self.text = self.text[:index]
            return self._emit(index), True
        safe_end = len(self.text) - partial_stop_suffix_len(self.text, self.stop)
        return self._emit(safe_end), False

    def flush(self) -> str:
        """Releases the held-back suffix (call when the request ends without a stop match)."""
        return self._emit(len(self.text))

    def _emit(self, end: int) -> str:
        if end <= self.num_emitted_chars:
            return ""
        out = self.text[self.num_emitted_chars:end]
        self.num_emitted_chars = end
        return out
