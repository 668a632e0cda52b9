"""Prefix caching: full pages of K/V shared between sequences whose tokens agree up to them (vLLM
v1's automatic prefix caching; SGLang's RadixAttention shares the same way, a token at a time).

Keys. Page i of a sequence (positions i*P .. i*P + P - 1) is keyed by a hash of its whole token
chain: key_i = H(key_{i-1}, tokens of page i [, the token after it]). In the target's and a draft
model's pools the K/V at position t depend on tokens 0..t only; in an EAGLE head's pool they also
depend on token t+1 (a position reads its feature and the NEXT token), hence `lookahead` = 1 there.
H is BLAKE2b (128 bits), not Python's hash: a collision would hand a sequence another's K/V.

Why the output stays exact. A page is registered under its key only once all its positions hold
the K/V of committed tokens (after the step's rollback: never a draft the target may still
reject); a sequence that finds the key therefore finds what it would have computed itself for the
same positions (bit for bit with row_invariant=True; otherwise the same numbers computed in
another batch shape, as a verification row already is). A shared page is never written: a hit
covers whole pages below the sequence's first uncached position (at least its newest token is fed,
so it gets its logits), writes go past that position, and a rollback truncates to the sequence's
committed length, which is past every page it shares.

With a drafter that reads the target's features (an EAGLE head) at least the two newest tokens
are fed: the head drafts from the target's features of the position before the newest, and a
preempted sequence readmitted onto pages cached up to its newest token would otherwise have none
and skip a draft, which under the standard rule changes what a seeded request samples.

How it plugs in. The pools' allocator is a `CachingAllocator` (a PageAllocator subclass) and each
sequence's tables are `PrefixTable`s (a BlockTable subclass that remembers the keys of its
registered pages and refuses a rollback into them). `PrefixCache` plugs into two extension
points: it is the scheduler's `Admission` (`attach` shares the cached pages of a sequence being
admitted, `admitted` counts the hit) and the engine's `StepFeature` (runtime/step_feature.py:
after each step, once its rollback is done and before finished sequences free their pages, it
`commit`s what each sequence has cached). `prefix_cache` builds it over an engine's pools.

Pages. `CachingAllocator` counts the block tables holding each page. At 0 a registered page is
kept, evictable, least recently used first; allocation takes a free page first and evicts only
when none is left, so the cache holds what the running sequences leave free.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from ..core.scheduler import Admission
from .kv_cache import BlockTable, KVPoolExhausted, PageAllocator
from .step_feature import StepFeature, StepRecord

if TYPE_CHECKING:
    from ..drafters.base import Drafter
    from .runner import ModelRunner


def page_keys(tokens: list[int], page_size: int, num_pages: int, lookahead: int = 0, parent: bytes = b"",
              first: int = 0) -> list[bytes]:
    """The keys of pages first .. num_pages-1 (parent: the key of page first-1). Page i needs
    tokens[: (i+1)*page_size + lookahead]; the caller passes only pages that have them."""
    keys = []
    ids = np.asarray(tokens, dtype=np.int64)
    for i in range(first, num_pages):
        chunk = ids[i * page_size : (i + 1) * page_size + lookahead]
        parent = hashlib.blake2b(parent + chunk.tobytes(), digest_size=16).digest()
        keys.append(parent)
    return keys


class CachingAllocator(PageAllocator):
    """A page allocator with reference counts and an index of full pages by key (module docstring).

    Every page is in exactly one state: free (on the free list), held (refs >= 1), or evictable
    (registered, refs 0, in `evictable` in LRU order). A held page may be registered too. As in
    PageAllocator, a page moves to or from a table's list in one call that leaves these states
    agreeing with the tables whatever exception lands inside it (`_settle`). An index entry is
    made key_of first and undone page_of first, so a half-made or half-undone one is in key_of
    alone: a key never finds a page that may be handed out and written."""

    def __init__(self, num_pages: int):
        super().__init__(num_pages)
        self.refs = [0] * num_pages
        self.page_of: dict[bytes, int] = {}  # key -> registered page
        self.key_of: dict[int, bytes] = {}  # registered page -> key
        self.evictable: OrderedDict[int, None] = OrderedDict()  # least recently used first

    @property
    def num_free(self) -> int:
        return len(self.free) + len(self.evictable)

    def allocate(self, pages: list[int]) -> int:
        """Move a free page onto the end of `pages`, else the least recently used evictable one
        (forgetting its key), and return it."""
        if not self.free and not self.evictable:
            raise KVPoolExhausted(f"KV pool exhausted: all {self.num_pages} pages are in use")
        evict = not self.free
        page = next(iter(self.evictable)) if evict else self.free[-1]
        try:
            if not evict:
                self.free.pop()
            else:
                del self.evictable[page]
                del self.page_of[self.key_of[page]]
                del self.key_of[page]
            self.refs[page] = 1
            self.in_use[page] = True
            pages.append(page)
        except BaseException:
            self._settle(page, int(pages[-1:] == [page]))
            raise
        return page

    def release(self, pages: list[int], index: int = -1) -> int:
        """Move pages[index] out of one table; the last holder frees the page, or keeps it
        evictable if registered. Returns it."""
        page = pages[index]
        holders = self.refs[page] - 1
        if holders < 0:
            raise ValueError(f"page {page} released but it is not allocated")
        try:
            del pages[index]
            self.refs[page] = holders
            if holders == 0:
                self.in_use[page] = False
                if page in self.key_of:
                    self.evictable[page] = None  # the most recently used end
                else:
                    self.free.append(page)
        except BaseException:
            self._settle(page, holders + int(page in pages))
            raise
        return page

    def share(self, page: int, pages: list[int]) -> None:
        """One more table holds the registered page (taking it out of the evictable set): the
        page goes onto the end of `pages`."""
        holders = self.refs[page] + 1
        try:
            if holders == 1:
                del self.evictable[page]
                self.in_use[page] = True
            self.refs[page] = holders
            pages.append(page)
        except BaseException:
            self._settle(page, holders - int(pages[-1:] != [page]))
            raise

    def _settle(self, page: int, holders: int) -> None:
        """Make the books of `page` say what its holders say (after an exception part-way
        through a move): a half-made or half-undone index entry is dropped; held, the page is in
        neither the free list nor the evictable set; not held, it is evictable if registered,
        else free."""
        if page in self.key_of and self.page_of.get(self.key_of[page]) != page:
            del self.key_of[page]
        self.refs[page] = holders
        self.in_use[page] = holders > 0
        evictable = not holders and page in self.key_of
        free = not holders and not evictable
        if not evictable:
            self.evictable.pop(page, None)
        elif page not in self.evictable:
            self.evictable[page] = None
        if not free and page in self.free:
            self.free.remove(page)
        elif free and page not in self.free:
            self.free.append(page)

    def register(self, page: int, key: bytes) -> None:
        """Index a held page, all of whose positions hold committed K/V, under its key (a key or a
        page already indexed stays as it is: the first page with those contents serves them)."""
        if key in self.page_of or page in self.key_of:
            return
        try:
            self.key_of[page] = key
            self.page_of[key] = page
        except BaseException:
            if self.page_of.get(key) != page:  # (half made: undone)
                self.key_of.pop(page, None)
            raise

    def lookup(self, keys: list[bytes]) -> list[int]:
        """The registered pages of the leading keys found, up to the first miss."""
        pages = []
        for key in keys:
            page = self.page_of.get(key)
            if page is None:
                break
            pages.append(page)
        return pages


@dataclass
class PrefixTable(BlockTable):
    """A block table whose leading full pages may be registered (shared, never written): it keeps
    their keys, and refuses a rollback below them (a rollback never goes below committed tokens,
    so one that does is a caller's bug, which would write a page other sequences may read)."""

    keys: list[bytes] = field(default_factory=list)  # keys of the leading full pages registered

    def truncate(self, num_tokens: int, allocator: PageAllocator) -> None:
        if 0 <= num_tokens < len(self.keys) * self.page_size:
            raise ValueError(f"truncating to {num_tokens} tokens would cut into a registered page of committed K/V "
                             f"({len(self.keys)} pages of {self.page_size}), which other sequences may share")
        super().truncate(num_tokens, allocator)

    def free(self, allocator: PageAllocator) -> None:
        super().free(allocator)
        self.keys = []


class PrefixCache(Admission, StepFeature):
    """Prefix caching over a sequence's pools: one `CachingAllocator` each, and the lookahead of
    each pool's keys. `attach` gives a sequence being admitted the pages it can share; `commit`
    (after each step) registers the pages a step filled with committed K/V. Counts tokens looked
    up and found (vLLM's `prefix_cache_queries` / `prefix_cache_hits`)."""

    def __init__(self, pools: list[tuple[str, CachingAllocator, int]], page_size: int, min_fed: int = 1):
        """pools: ("target" | "draft", its allocator, its lookahead); min_fed: the newest tokens a
        hit always leaves to feed (2 with a drafter that reads the target's features)."""
        self.pools = pools
        self.page_size = page_size
        self.min_fed = min_fed
        self.queries = 0
        self.hits = 0

    def attach(self, seq) -> int:
        """Share the longest run of cached pages that every pool has for seq's tokens, leaving at
        least the min_fed newest tokens to feed; seq's tables must be empty PrefixTables. Returns
        the tokens found (counted by `admitted` once the sequence is admitted)."""
        tokens, P = seq.tokens, self.page_size
        usable = max(0, len(tokens) - self.min_fed) // P
        keys = [page_keys(tokens, P, min(usable, (len(tokens) - lookahead) // P), lookahead) for _, _, lookahead in self.pools]
        found = [allocator.lookup(k) for (_, allocator, _), k in zip(self.pools, keys)]
        hit = min(len(pages) for pages in found)
        for (which, allocator, _), pool_keys, pages in zip(self.pools, keys, found):
            table: PrefixTable = seq.table(which)
            if not isinstance(table, PrefixTable):
                raise TypeError(f"prefix caching needs PrefixTables, got a {type(table).__name__} "
                                "(Sequence(..., table_type=PrefixTable))")
            assert not table.pages, "attach needs a sequence with empty block tables"
            # Keys first: a page the table holds below its keys is one it never writes. Interrupted
            # part-way, the pages shared so far are the table's, released when it is freed.
            table.keys = pool_keys[:hit]
            for page in pages[:hit]:
                allocator.share(page, table.pages)
            table.num_cached = hit * P
        return hit * P

    def admitted(self, seq, cached: int) -> None:
        """Count a sequence admitted with `cached` of its tokens found (vLLM counts tokens); its
        first admission's hit is its request's num_cached_tokens."""
        self.queries += len(seq)
        self.hits += cached
        if not seq.num_preemptions:
            seq.metrics.num_cached_tokens = cached

    def commit(self, seq) -> None:
        """Register every full page of seq's tables below its cached positions not registered yet
        (called after a step's rollback: what is cached then is committed)."""
        tokens, P = seq.tokens, self.page_size
        for which, allocator, lookahead in self.pools:
            table: PrefixTable = seq.table(which)
            full, done = min(table.num_cached, len(tokens) - lookahead) // P, len(table.keys)
            if full > done:
                table.keys += page_keys(tokens, P, full, lookahead, table.keys[-1] if done else b"", first=done)
                for page, key in zip(table.pages[done:full], table.keys[done:full]):
                    allocator.register(page, key)

    def after(self, engine, record: StepRecord) -> None:
        """Commit what each of the step's sequences has cached (a failed one's K/V are not trusted)."""
        for seq in record.seqs:
            if seq.finish_reason != "error":
                self.commit(seq)


def prefix_cache(runners: list[tuple[ModelRunner, str]], drafter: Drafter) -> PrefixCache:
    """The prefix cache over the engine's pools: an EAGLE head's K/V at a position also depend on
    the next token (lookahead 1), the target's and a draft model's on the tokens up to it; with
    such a head a hit leaves the two newest tokens to feed (module docstring)."""
    pools = []
    for runner, which in runners:
        if not isinstance(runner.cache.allocator, CachingAllocator):
            raise ValueError("prefix caching needs KV pools whose allocator is a CachingAllocator (KVCache(..., allocator=...))")
        pools.append((which, runner.cache.allocator, 1 if which == "draft" and drafter.target_layers else 0))
    sizes = {runner.cache.page_size for runner, _ in runners}
    if len(sizes) != 1:
        raise ValueError(f"prefix caching needs one page size in every pool, got {sorted(sizes)}")
    return PrefixCache(pools, sizes.pop(), 2 if drafter.target_layers else 1)
