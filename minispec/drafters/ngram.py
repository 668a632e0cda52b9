"""The n-gram drafter: no model. It looks up the latest earlier occurrence of the sequence's last n
tokens (prompt lookup decoding, Saxena 2023) and proposes what followed; its q is one-hot."""

from __future__ import annotations

from ..runtime.sequence import Sequence
from .base import Drafter, Proposal


class NgramDrafter(Drafter):
    """Match the last n tokens (n from max_n down to min_n) against the sequence's earlier tokens;
    propose the up-to-k tokens that followed the latest match."""

    def __init__(self, max_n: int = 3, min_n: int = 1):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.max_n, self.min_n = max_n, min_n

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            suffix = tokens[-n:]
            for start in range(len(tokens) - n - 1, -1, -1):  # latest match first
                if tokens[start : start + n] == suffix:
                    return tokens[start + n : start + n + k]
        return []

    def propose(self, seqs: list[Sequence], num_draft: list[int]) -> Proposal:
        return Proposal([self.lookup(s.tokens, n) if n > 0 else [] for s, n in zip(seqs, num_draft)])
