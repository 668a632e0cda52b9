"""The paged KV cache of the production engine: the core's (minispec/core/kv_cache.py: the page
allocator, block tables, the pool) and what only its extensions need, in a `KVCache` subclass:

  * the scratch page: one page more in the pool than the allocator hands out, which no sequence
    owns, where the padding rows of a static-shape step write their K/V (static_shapes.py); the
    KV budget counts it;
  * on CPU the pool's zeros come from numpy's calloc (`zeros`), so a large pool is not written
    byte by byte before its first use;
  * `copy_slots`, how a tree verification moves its accepted path's K/V (speculative_tree.py);
  * a `PageAllocator` safe against an exception landing anywhere inside it (a KeyboardInterrupt
    from a signal, in a server that must give every page back when a request is stopped).

The pool's shape and the page ids handed out are those of a core cache with one more page that
is never handed out: page ids 0 .. num_pages-1 are the allocator's, page num_pages the scratch.
"""

from __future__ import annotations

import numpy as np
import torch

from ..core import kv_cache as core
from ..core.kv_cache import BlockTable, KVPoolExhausted
from ..model.config import ModelConfig

__all__ = ["BlockTable", "KVCache", "KVPoolExhausted", "PageAllocator", "zeros"]


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor. On CPU from numpy's zeros (calloc): the OS maps zero pages and backs them
    with memory only when they are first written, so building a large pool does not write every
    byte of it up front, as torch.zeros does. Every element still reads as 0."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    raw = np.zeros(shape, dtype={1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[dtype.itemsize])
    return torch.from_numpy(raw).view(dtype)


class PageAllocator(core.PageAllocator):
    """The core's allocator, whose books stay true wherever an exception lands inside a move (a
    KeyboardInterrupt from a signal can land between any two instructions): the table's page list
    is the record, and a move stopped half-way has its books made to agree with it (`_settle`; a
    second interrupt inside that repair is not covered). A page is never in the caller's hands
    only, where an interrupt would lose it."""

    def allocate(self, pages: list[int]) -> int:
        page = self.free[-1] if self.free else None  # (None: the core refuses, nothing moved)
        try:
            return super().allocate(pages)
        except BaseException:
            if page is not None:
                self._settle(page, int(pages[-1:] == [page]))
            raise

    def release(self, pages: list[int], index: int = -1) -> int:
        page = pages[index]
        if not self.in_use[page]:
            return super().release(pages, index)  # refused there before anything moves
        try:
            return super().release(pages, index)
        except BaseException:
            self._settle(page, int(page in pages))
            raise

    def _settle(self, page: int, holders: int) -> None:
        """Make the books of `page` say what its holders say (after an exception part-way
        through a move: the steps done are redone or undone, whichever agrees with the table)."""
        self.in_use[page] = holders > 0
        if holders and page in self.free:
            self.free.remove(page)
        elif not holders and page not in self.free:
            self.free.append(page)


class KVCache(core.KVCache):
    """The core pool with the scratch page (page id `scratch_page`, after the allocator's)."""

    def __init__(self, cfg: ModelConfig, num_pages: int, page_size: int, dtype: torch.dtype,
                 device: torch.device, allocator: type[PageAllocator] = PageAllocator):
        super().__init__(cfg, num_pages, page_size, dtype, device, allocator)
        self.scratch_page = num_pages

    def new_pool(self, cfg: ModelConfig, num_pages: int, page_size: int, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
        """[L, 2, num_pages + 1, page_size, Hkv, D]: the last page is the scratch page."""
        shape = (cfg.num_layers, 2, num_pages + 1, page_size, cfg.num_kv_heads, cfg.head_dim)
        return zeros(shape, dtype, device)

    @classmethod
    def bytes_per_page(cls, cfg: ModelConfig, page_size: int, dtype: torch.dtype) -> int:
        """The bytes one page of `page_size` positions takes in every layer's K and V."""
        return cfg.num_layers * 2 * page_size * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize

    @classmethod
    def from_budget(cls, cfg: ModelConfig, budget_bytes: int, page_size: int, dtype: torch.dtype,
                    device: torch.device, max_pages: int | None = None,
                    allocator: type[PageAllocator] = PageAllocator) -> KVCache:
        """As many pages as fit in budget_bytes beside the scratch page (at most max_pages: more
        could never be used)."""
        page_bytes = cls.bytes_per_page(cfg, page_size, dtype)
        num_pages = budget_bytes // page_bytes - 1  # the scratch page counts against the budget too
        if num_pages < 1:
            raise ValueError(
                f"KV cache budget of {budget_bytes} bytes is smaller than one page of {page_size} tokens "
                f"({page_bytes} bytes) beside the scratch page; raise kv_cache_gib / gpu_memory_utilization "
                "or lower page_size"
            )
        if max_pages is not None:
            num_pages = min(num_pages, max_pages)
        return cls(cfg, num_pages, page_size, dtype, device, allocator)

    @property
    def nbytes(self) -> int:
        return self.pool.numel() * self.pool.element_size()

    def copy_slots(self, src: list[int] | torch.Tensor, dst: list[int] | torch.Tensor) -> None:
        """K/V of pool slots src -> dst in every layer (all read before any is written): how a
        tree verification moves its accepted path's K/V to the sequence's next positions. src,
        dst: host lists, or int64 tensors on the pool's device (a walk made there: no upload)."""
        if len(src) == 0:
            return
        device = self.pool.device
        src_t, dst_t = (x if isinstance(x, torch.Tensor) else torch.tensor(x, dtype=torch.int64, device=device)
                        for x in (src, dst))
        flat = self.pool.flatten(2, 3).flatten(0, 1)  # [L * 2, (pages + 1) * page_size, Hkv, D], a view
        flat[:, dst_t] = flat[:, src_t]
