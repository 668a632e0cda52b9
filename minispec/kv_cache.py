"""Paged KV cache: a pool of fixed-size pages per model, a free-list allocator, and per-sequence
block tables (as in vLLM's PagedAttention, Kwon et al. 2023).

A sequence's token at position t lives in page `block_table[t // page_size]`, row
`t % page_size`. Appending allocates a page only when the last one is full; rolling back rejected
draft tokens is `truncate(n)`: positions >= n are forgotten and pages no longer needed go back to
the free list. Nothing is copied: stale K/V rows in a kept page are simply overwritten later.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .config import ModelConfig


class KVPoolExhausted(RuntimeError):
    """Raised when a page is needed and none is free."""


class PageAllocator:
    """A free list of page ids with reference counts (a page may be shared by forked sequences)."""

    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self.free: list[int] = list(range(num_pages - 1, -1, -1))  # pop() hands out page 0 first
        self.refs = [0] * num_pages

    @property
    def num_free(self) -> int:
        return len(self.free)

    def allocate(self) -> int:
        if not self.free:
            raise KVPoolExhausted(f"KV pool exhausted: all {self.num_pages} pages are in use")
        page = self.free.pop()
        self.refs[page] = 1
        return page

    def share(self, page: int) -> None:
        assert self.refs[page] > 0, f"page {page} is not allocated"
        self.refs[page] += 1

    def release(self, page: int) -> None:
        assert self.refs[page] > 0, f"page {page} released twice"
        self.refs[page] -= 1
        if self.refs[page] == 0:
            self.free.append(page)


@dataclass
class BlockTable:
    """The pages holding one sequence's cached K/V in one model's pool, and how many tokens are cached."""

    page_size: int
    pages: list[int] = field(default_factory=list)
    num_cached: int = 0  # positions 0..num_cached-1 hold valid K/V

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def reserve(self, num_tokens: int, allocator: PageAllocator) -> None:
        """Make room for positions < num_tokens (all-or-nothing: on failure nothing is kept)."""
        need = self.pages_for(num_tokens) - len(self.pages)
        if need > allocator.num_free:
            raise KVPoolExhausted(
                f"KV pool exhausted: need {need} more pages, {allocator.num_free} of {allocator.num_pages} free"
            )
        self.pages.extend(allocator.allocate() for _ in range(max(need, 0)))

    def truncate(self, num_tokens: int, allocator: PageAllocator) -> None:
        """Roll back to the first `num_tokens` positions and free the pages past them (no copy)."""
        self.num_cached = min(self.num_cached, num_tokens)
        while len(self.pages) > self.pages_for(num_tokens):
            allocator.release(self.pages.pop())

    def fork(self, allocator: PageAllocator) -> "BlockTable":
        """A copy sharing every page (copy-on-write is the caller's concern: only full pages may be shared)."""
        for page in self.pages:
            allocator.share(page)
        return BlockTable(self.page_size, list(self.pages), self.num_cached)

    def free(self, allocator: PageAllocator) -> None:
        for page in self.pages:
            allocator.release(page)
        self.pages, self.num_cached = [], 0

    def slots(self, start: int, end: int) -> list[int]:
        """Pool slots (page * page_size + offset) of positions start..end-1."""
        ps = self.page_size
        return [self.pages[t // ps] * ps + t % ps for t in range(start, end)]


class KVCache:
    """One model's page pool: per layer K and V, each [num_pages, page_size, kv_heads, head_dim]."""

    def __init__(self, cfg: ModelConfig, num_pages: int, page_size: int, dtype: torch.dtype, device: torch.device):
        if num_pages < 1:
            raise ValueError(f"KV cache needs at least one page, got {num_pages}")
        shape = (cfg.num_layers, 2, num_pages, page_size, cfg.num_kv_heads, cfg.head_dim)
        self.pool = torch.zeros(shape, dtype=dtype, device=device)  # [L, 2, pages, page_size, Hkv, D]
        self.page_size = page_size
        self.allocator = PageAllocator(num_pages)

    @staticmethod
    def bytes_per_page(cfg: ModelConfig, page_size: int, dtype: torch.dtype) -> int:
        return cfg.num_layers * 2 * page_size * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize

    @classmethod
    def from_budget(
        cls, cfg: ModelConfig, budget_bytes: int, page_size: int, dtype: torch.dtype, device: torch.device
    ) -> "KVCache":
        return cls(cfg, budget_bytes // cls.bytes_per_page(cfg, page_size, dtype), page_size, dtype, device)

    @property
    def num_pages(self) -> int:
        return self.allocator.num_pages

    @property
    def nbytes(self) -> int:
        return self.pool.numel() * self.pool.element_size()

    def layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (k_pool, v_pool) views, each [num_pages, page_size, Hkv, D]."""
        return [(self.pool[i, 0], self.pool[i, 1]) for i in range(self.pool.shape[0])]
