"""Paged KV cache: a pool of fixed-size pages per model, a free-list allocator, and per-sequence
block tables (vLLM's PagedAttention, Kwon et al. 2023).

A sequence's token at position t lives in page `block_table[t // page_size]`, row
`t % page_size`. Appending allocates a page only when the last one is full; rolling back rejected
draft tokens is `truncate(n)`: positions >= n are forgotten and pages no longer needed go back to
the free list. Nothing is copied: stale K/V rows in a kept page are simply overwritten later.

Every page has one owner at a time here. An extension that shares pages between tables subclasses
the allocator and the table; this file only allocates, reserves, truncates on rollback and frees.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .config import ModelConfig


class KVPoolExhausted(RuntimeError):
    """Raised when pages are needed and not enough are free (or a request can never fit the
    pool)."""


class PageAllocator:
    """A free list of page ids: a page is on the free list exactly when no table owns it. A page
    moves between the free list and a table's page list in one call (`allocate`, `release`)."""

    def __init__(self, num_pages: int):
        if num_pages < 1:
            raise ValueError(f"a page pool needs at least one page, got {num_pages}")
        self.num_pages = num_pages
        self.free: list[int] = list(range(num_pages - 1, -1, -1))  # pop() hands out page 0 first
        self.in_use = [False] * num_pages

    @property
    def num_free(self) -> int:
        return len(self.free)

    def allocate(self, pages: list[int]) -> int:
        """Move a free page onto the end of `pages` (a block table's) and return it."""
        if not self.free:
            raise KVPoolExhausted(f"KV pool exhausted: all {self.num_pages} pages are in use")
        page = self.free.pop()
        self.in_use[page] = True
        pages.append(page)
        return page

    def release(self, pages: list[int], index: int = -1) -> int:
        """Move pages[index] back to the free list and return it (releasing a free page is a bug
        in the caller: refused)."""
        page = pages[index]
        if not self.in_use[page]:
            raise ValueError(f"page {page} released but it is not allocated")
        del pages[index]
        self.in_use[page] = False
        self.free.append(page)
        return page


@dataclass
class BlockTable:
    """The pages holding one sequence's cached K/V in one model's pool, and how many tokens are
    cached.

    `pages` may cover more positions than `num_cached` (pages reserved for the next step);
    `num_cached` is advanced by whoever writes the K/V (the runner).
    """

    page_size: int
    pages: list[int] = field(default_factory=list)
    num_cached: int = 0  # positions 0..num_cached-1 hold valid K/V

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    @property
    def capacity(self) -> int:
        """Positions the table's pages can hold."""
        return len(self.pages) * self.page_size

    def reserve(self, num_tokens: int, allocator: PageAllocator) -> None:
        """Make room for positions < num_tokens (all-or-nothing when the pool is short: nothing
        is allocated)."""
        need = self.pages_for(num_tokens) - len(self.pages)
        if need <= 0:
            return
        if need > allocator.num_free:
            raise KVPoolExhausted(f"KV pool exhausted: need {need} more pages, "
                                  f"{allocator.num_free} of {allocator.num_pages} free")
        for _ in range(need):  # (stopped part-way: the pages taken so far are the table's)
            allocator.allocate(self.pages)

    def truncate(self, num_tokens: int, allocator: PageAllocator) -> None:
        """Roll back to the first `num_tokens` positions and free the pages past them (no copy)."""
        if num_tokens < 0:
            raise ValueError(f"cannot truncate to {num_tokens} tokens")
        self.num_cached = min(self.num_cached, num_tokens)
        keep = self.pages_for(num_tokens)
        while len(self.pages) > keep:
            allocator.release(self.pages)

    def free(self, allocator: PageAllocator) -> None:
        """Release every page, first to last (an allocator that keeps released pages sees the
        first as the least recently used)."""
        while self.pages:
            allocator.release(self.pages, 0)
        self.num_cached = 0

    def slots(self, start: int, end: int) -> list[int]:
        """Pool slots (page * page_size + offset) of positions start..end-1 (they must be
        reserved)."""
        if not 0 <= start <= end <= self.capacity:
            raise ValueError(f"positions {start}..{end - 1} are outside the "
                             f"{self.capacity} reserved slots")
        ps = self.page_size
        return [self.pages[t // ps] * ps + t % ps for t in range(start, end)]


class KVCache:
    """One model's page pool: per layer K and V, each [num_pages, page_size, kv_heads, head_dim]."""

    def __init__(self, cfg: ModelConfig, num_pages: int, page_size: int, dtype: torch.dtype,
                 device: torch.device, allocator: type[PageAllocator] = PageAllocator):
        """allocator: the page allocator's class (a subclass may share pages between tables)."""
        if num_pages < 1:
            raise ValueError(f"KV cache needs at least one page, got {num_pages}")
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        self.allocator = allocator(num_pages)
        # [L, 2, pages, page_size, Hkv, D]
        self.pool = self.new_pool(cfg, num_pages, page_size, dtype, device)
        # Per layer (k_pool, v_pool) views, each [num_pages, page_size, Hkv, D]; built once.
        self._layers = [(self.pool[i, 0], self.pool[i, 1]) for i in range(cfg.num_layers)]

    def new_pool(self, cfg: ModelConfig, num_pages: int, page_size: int, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
        """The zeroed pool, [L, 2, num_pages, page_size, Hkv, D] (dim 1: K, V). Zeros, not empty:
        attention multiplies masked-out rows by 0, and 0 * NaN garbage is NaN. A subclass may
        lay out more pages than the allocator hands out, or allocate the zeros another way."""
        shape = (cfg.num_layers, 2, num_pages, page_size, cfg.num_kv_heads, cfg.head_dim)
        return torch.zeros(shape, dtype=dtype, device=device)

    @property
    def num_pages(self) -> int:
        """Pages the allocator hands out."""
        return self.allocator.num_pages

    def layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (k_pool, v_pool) views, each [num_pages, page_size, Hkv, D]."""
        return self._layers
