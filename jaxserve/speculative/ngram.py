"""The n-gram (prompt lookup) proposer: proposals copied from earlier in the sequence (no jax)."""
from __future__ import annotations

from typing import Sequence

import numpy as np


class NgramProposer:
    """Prompt lookup: the longest suffix n-gram (max_n down to min_n tokens) that occurred earlier
    in the sequence (prompt + output) proposes the tokens that followed its latest occurrence."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n

    def propose(self, requests: Sequence, k: int) -> list[list[int]]:
        """Up to `k` tokens to follow each request's tokens (the proposer interface)."""
        return [self.propose_tokens(request.all_token_ids, k) for request in requests]

    def propose_tokens(self, token_ids: Sequence[int], k: int) -> list[int]:
        """Up to `k` tokens to follow `token_ids`; [] when no suffix n-gram recurs."""
        if k < 1 or len(token_ids) < self.min_n + 1:
            return []
        tokens = np.asarray(token_ids, np.int64)  # [L]
        length = len(tokens)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            suffix = tokens[length - n:]
            # Starts i < L - n whose n tokens equal the suffix (the suffix itself excluded).
            starts = np.flatnonzero(tokens[:length - n] == suffix[0])
            starts = starts[starts + n < length]
            for i in starts[::-1]:  # the latest occurrence first
                if np.array_equal(tokens[i:i + n], suffix):
                    return tokens[i + n:i + n + k].tolist()
        return []
