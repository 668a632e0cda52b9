"""Prefix caching (minispec/runtime/prefix_cache.py): pages of committed K/V shared between
sequences, LRU-evicted when free, never written while shared, never truncated.

Invariants taught here:
* a hypothesis state machine over one page pool with sharing, driven as the engine drives it
  (admit with a lookup, speculative steps that write drafts and roll back, finish, preempt, abort),
  with the pool's contents simulated: every page is free, held or evictable, never two; its
  reference count is the number of tables holding it; every cached position of every table holds
  the K/V of that table's own tokens (what a hit must give), and a registered page never changes;
* the books hold at every point an exception (a KeyboardInterrupt from a signal) can land: attach,
  commit, reserve by eviction, free and truncate, interrupted before each of their instructions in
  turn, lose no page, miscount no reference, and leave no key finding a page that may be written;
* power: the same machine fails with a release that frees a page other tables still hold, and with
  keys made of a page's own tokens (not its chain: another prefix's K/V served); a rollback into
  a registered page is refused by name;
* through the engine: outputs with prefix caching equal those without, token for token and logprob
  for logprob (row-invariant target), for every drafter, greedy and seeded, with preemption too;
* a preempted request readmitted onto pages an identical one (a client's retry) cached up to its
  newest token starts over in its drafter too: nothing the drafter remembered from before points
  below those shared pages.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from minispec import LLM, SamplingParams, load_checkpoint
import minispec.core.kv_cache as kv_cache
import minispec.runtime.prefix_cache as prefix_cache
from interrupts import every_interrupt
from minispec.runtime.kv_cache import BlockTable, KVCache, KVPoolExhausted
from minispec.runtime.prefix_cache import CachingAllocator, PrefixCache, PrefixTable, page_keys
from test_row_invariance import assert_same_outputs

PAGE = 4
PREFIXES = [[7, 7, 1, 2, 3, 4, 5, 6, 9], [7, 7, 1, 2, 8, 8], [3] * 13]  # shared starts: system prompts


def assert_books_agree(a: CachingAllocator, tables: list[PrefixTable]) -> None:
    """Every page is free, held or evictable, never two, never none; its reference count is the
    number of tables holding it; the index is one-to-one; a page kept when free is registered, a
    registered page is never on the free list (it would be handed out and written while its key
    still finds it), and no table holds a registered page where it may write (past its keys)."""
    held = [p for t in tables for p in t.pages]
    assert all(a.refs[p] == held.count(p) for p in range(a.num_pages)), "refcount != tables holding the page"
    assert all(a.in_use[p] == (a.refs[p] > 0) for p in range(a.num_pages)), "in-use mark != held"
    free, evictable = set(a.free), set(a.evictable)
    assert len(free) == len(a.free) and not free & evictable and not (free | evictable) & set(held)
    assert len(free | evictable | set(held)) == a.num_pages, "a page was lost"
    assert all(a.key_of[p] in a.page_of and a.page_of[a.key_of[p]] == p for p in a.key_of) and len(a.key_of) == len(a.page_of)
    assert evictable <= set(a.key_of), "only registered pages are kept when free"
    assert not free & set(a.key_of), "a registered page is on the free list"
    assert all(p not in a.key_of for t in tables for p in t.pages[len(t.keys):]), "a table may write a registered page"


class FakeSeq:
    """What PrefixCache needs of a Sequence: tokens and a table per pool."""

    def __init__(self, tokens: list[int]):
        self.tokens_ = list(tokens)
        self.target_table = PrefixTable(PAGE)

    @property
    def tokens(self) -> list[int]:
        return self.tokens_

    def __len__(self) -> int:
        return len(self.tokens_)

    def table(self, which: str) -> BlockTable:
        return self.target_table


class PoolMachine(RuleBasedStateMachine):
    """One pool, the engine's protocol, the K/V of each slot simulated as the token chain it encodes."""

    ROLLBACK_PAST = 0  # a rollback this many tokens past the committed ones (refused past a page boundary)

    def __init__(self):
        super().__init__()
        self.allocator = CachingAllocator(12)
        self.cache = PrefixCache([("target", self.allocator, 0)], PAGE)
        self.content: dict[int, tuple] = {}  # slot -> the tokens 0..t whose K/V it holds
        self.live: list[FakeSeq] = []
        self.snapshots: dict[tuple, list] = {}  # (registered page, its key) -> its contents when registered

    def write(self, seq: FakeSeq, tokens: list[int], start: int) -> None:
        """The runner writes K/V of tokens[start:] at positions start.. (pages reserved)."""
        table = seq.target_table
        for t in range(start, len(tokens)):
            self.content[table.slots(t, t + 1)[0]] = tuple(tokens[: t + 1])
        table.num_cached = len(tokens)

    def step(self, seq: FakeSeq, drafts: list[int], accepted: int, final: int) -> bool:
        """One speculative step as speculative.py runs it: feed the uncached tokens and the drafts
        (K/V written), accept a prefix of the drafts and one more token, roll back, commit."""
        table = seq.target_table
        try:
            table.reserve(len(seq) + len(drafts), self.allocator)
        except KVPoolExhausted:
            return False
        self.write(seq, seq.tokens + drafts, table.num_cached)
        seq.tokens_ += drafts[:accepted] + [final]
        table.truncate(len(seq) - 1 - self.ROLLBACK_PAST, self.allocator)
        self.cache.commit(seq)
        return True

    @precondition(lambda self: len(self.live) < 4)
    @rule(prefix=st.sampled_from(PREFIXES), tail=st.lists(st.integers(1, 3), max_size=6), final=st.integers(1, 3))
    def admit(self, prefix, tail, final):
        """A new (or preempted) sequence: the lookup, then its prefill step."""
        seq = FakeSeq(prefix + tail)
        self.cache.attach(seq)
        assert seq.target_table.num_cached < len(seq), "a hit leaves the newest token to feed"
        if self.step(seq, [], 0, final):
            self.live.append(seq)
        else:
            seq.target_table.free(self.allocator)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), drafts=st.lists(st.integers(1, 3), max_size=3))
    def speculative_step(self, data, drafts):
        seq = data.draw(st.sampled_from(self.live))
        self.step(seq, drafts, data.draw(st.integers(0, len(drafts))), data.draw(st.integers(1, 3)))

    @precondition(lambda self: self.live)
    @rule(data=st.data(), how=st.sampled_from(["finish", "preempt", "abort"]))
    def leave(self, data, how):
        seq = data.draw(st.sampled_from(self.live))
        if how == "finish":
            self.cache.commit(seq)
        seq.target_table.free(self.allocator)  # a preempted sequence comes back through admit
        self.live.remove(seq)

    @invariant()
    def pages_are_free_held_or_evictable(self):
        assert_books_agree(self.allocator, [s.target_table for s in self.live])

    @invariant()
    def cached_positions_hold_their_own_tokens(self):
        for s in self.live:
            table = s.target_table
            for t in range(table.num_cached):
                assert self.content.get(table.slots(t, t + 1)[0]) == tuple(s.tokens[: t + 1]), "wrong K/V at a cached position"

    @invariant()
    def a_registered_page_never_changes(self):
        registered = {(page, key) for page, key in self.allocator.key_of.items()}
        self.snapshots = {pk: v for pk, v in self.snapshots.items() if pk in registered}  # evicted: reusable
        for page, key in registered:
            now = [self.content.get(page * PAGE + i) for i in range(PAGE)]
            assert self.snapshots.setdefault((page, key), now) == now, f"registered page {page} was written"


SETTINGS = settings(max_examples=150, stateful_step_count=40, deadline=None, derandomize=True, report_multiple_bugs=False,
                    suppress_health_check=list(HealthCheck))
TestPool = PoolMachine.TestCase
TestPool.settings = SETTINGS


def run_machine(machine: type) -> None:
    from hypothesis.stateful import run_state_machine_as_test

    run_state_machine_as_test(machine, settings=SETTINGS)


def test_a_rollback_into_a_shared_page_is_refused():
    """A rollback that goes past a page boundary below the committed tokens (a wrong draft start,
    say) would cut into a registered page that other tables may hold: refused by name."""
    class TooFar(PoolMachine):
        ROLLBACK_PAST = PAGE + 1

    with pytest.raises(ValueError, match="would cut into a registered page"):
        run_machine(TooFar)


def test_a_release_that_frees_a_shared_page_is_caught(monkeypatch):
    """Power: a rollback or a finish that puts a page back on the free list while another table
    still holds it (reference counts ignored) hands that page to a newcomer, which overwrites the
    K/V the other table reads: the machine says so."""
    release = CachingAllocator.release

    def ignoring_refs(self, pages, index=-1):  # the last holder's release, whoever calls it
        self.refs[pages[index]] = min(self.refs[pages[index]], 1)
        return release(self, pages, index)

    monkeypatch.setattr(CachingAllocator, "release", ignoring_refs)
    with pytest.raises(AssertionError, match="refcount|wrong K/V|was written|lost"):
        run_machine(PoolMachine)


def test_keys_of_a_page_alone_are_caught(monkeypatch):
    """Power: a key made of a page's own tokens only (not its chain) finds a page that holds the
    same tokens at other positions or after another prefix: wrong K/V, and the machine says so."""
    import hashlib

    import minispec.runtime.prefix_cache as prefix_cache

    def own_tokens_only(tokens, page_size, num_pages, lookahead=0, parent=b"", first=0):
        return [hashlib.blake2b(bytes(tokens[i * page_size : (i + 1) * page_size + lookahead])).digest()
                for i in range(first, num_pages)]

    monkeypatch.setattr(prefix_cache, "page_keys", own_tokens_only)
    with pytest.raises(AssertionError, match="wrong K/V"):
        run_machine(PoolMachine)


def cached_pool(state: str):
    """An 8-page pool where a 13-token sequence A ran (3 full pages of K/V), set up for one of
    INTERRUPTED_OPS: A "held" (its pages registered), "uncommitted" (not registered yet),
    "reserved ahead" (2 pages past its committed tokens, as for drafts), "evictable" (A left:
    its registered pages kept), or "full" (evictable, and the free list empty: the next page is
    an eviction). Returns (allocator, cache, the live seqs, seq B sharing A's 3 pages)."""
    allocator = CachingAllocator(8)
    cache = PrefixCache([("target", allocator, 0)], PAGE)
    a, b = FakeSeq(list(range(1, 14))), FakeSeq(list(range(1, 14)) + [1])
    a.target_table.reserve(13, allocator)
    a.target_table.num_cached = 13
    if state != "uncommitted":
        cache.commit(a)
    if state == "reserved ahead":
        a.target_table.reserve(21, allocator)
    if state not in ("evictable", "full"):
        return allocator, cache, [a], b
    a.target_table.free(allocator)
    if state == "evictable":
        return allocator, cache, [], b
    filler = FakeSeq([])
    filler.target_table.reserve(PAGE * len(allocator.free), allocator)
    assert not allocator.free and len(allocator.evictable) == 3
    return allocator, cache, [filler], b


INTERRUPTED_OPS = {  # what is interrupted, on which cached_pool state
    "attach evictable pages": ("evictable", lambda cache, live, b: cache.attach(b)),
    "attach held pages": ("held", lambda cache, live, b: cache.attach(b)),
    "reserve by eviction": ("full", lambda cache, live, b: b.target_table.reserve(8, cache.pools[0][1])),
    "commit": ("uncommitted", lambda cache, live, b: cache.commit(live[0])),
    "free registered pages": ("held", lambda cache, live, b: live[0].target_table.free(cache.pools[0][1])),
    "truncate": ("reserved ahead", lambda cache, live, b: live[0].target_table.truncate(13, cache.pools[0][1])),
}


@pytest.mark.parametrize("op", list(INTERRUPTED_OPS))
def test_an_interrupt_at_any_point_leaves_the_books_whole(op):
    """A KeyboardInterrupt (a signal's) before any instruction of attach, commit, reserve (by
    eviction), free or truncate: at that point the books agree with the tables (assert_books_agree:
    no page lost, counted twice, or registered where a table writes), and freeing every table then
    leaves every page free or evictable. Used to fail for attach: reference counts were raised
    before the table held the pages, so an interrupted admission leaked them."""
    state, call = INTERRUPTED_OPS[op]

    def setup():
        allocator, cache, live, b = cached_pool(state)
        return allocator, cache, live + [b], b

    def check(s):
        allocator, cache, tables, b = s[0], s[1], [seq.target_table for seq in s[2]], s[3]
        assert_books_agree(allocator, tables)
        for table in tables:
            table.free(allocator)
        assert_books_agree(allocator, [])
        assert allocator.num_free == allocator.num_pages and not any(allocator.refs)

    tried = every_interrupt(setup, lambda s: call(s[1], s[2][:-1], s[3]), check, kv_cache, prefix_cache)
    assert tried > 10  # (the walk did reach the operation's instructions)


def test_keys_name_the_whole_chain_and_the_lookahead():
    """A page's key depends on every token before it (not its own page only) and, with lookahead
    1, on the token after it; a lookup stops at the first miss."""
    a, b = [1, 2, 3, 4, 5, 6, 7, 8, 9], [9, 2, 3, 4, 5, 6, 7, 8, 9]
    assert page_keys(a, 4, 2)[1] != page_keys(b, 4, 2)[1]  # page 1 agrees, its chain does not
    assert page_keys(a, 4, 2, lookahead=1) != page_keys(a[:8] + [0], 4, 2, lookahead=1)
    assert page_keys(a, 4, 2)[:1] == page_keys(a[:4] + [0] * 5, 4, 2)[:1]
    allocator, pages = CachingAllocator(4), []
    page = allocator.allocate(pages)
    allocator.register(page, page_keys(a, 4, 1)[0])
    assert allocator.lookup(page_keys(a, 4, 2)) == [page] and allocator.lookup(page_keys(b, 4, 2)) == []
    allocator.release(pages)
    assert allocator.num_free == 4 and list(allocator.evictable) == [page]  # kept, evictable
    assert [allocator.allocate(pages) for _ in range(4)][-1] == page and not allocator.page_of  # evicted last, forgotten


DRAFTERS = {
    "plain": {},
    "draft": dict(num_speculative_tokens=3),
    "tree": dict(num_speculative_tokens=3, draft_tree_budget=5, draft_tree_top_k=2),
    "lookup": dict(num_speculative_tokens=3, prompt_lookup_min=2),
    "ngram": dict(num_speculative_tokens=3),
    "eagle": dict(num_speculative_tokens=3),
    "eagle-tree": dict(num_speculative_tokens=3, draft_tree_budget=5, draft_tree_top_k=2),
}  # every kind of drafter -> its LLM options (test_chunked_prefill.py runs them too)


def draft_for(drafter: str, draft_path, eagle_path) -> str | None:
    """LLM's draft_model for a DRAFTERS (or RETRY_DRAFTERS) name: none, n-gram, the EAGLE head or
    the draft model."""
    eagle = str(eagle_path)
    named = {"plain": None, "ngram": "ngram", "eagle": eagle, "eagle-tree": eagle, "eagle-lookup": eagle}
    return named.get(drafter, str(draft_path))


def kv_gib_for(num_pages: int, target, draft, page_size: int, options: dict) -> float:
    """The kv_cache_gib that gives each of the engine's pools about num_pages pages of page_size
    tokens (the budget is split between the pools by their bytes per token)."""
    probe = LLM(target, draft_model=draft, kv_cache_gib=0.02, page_size=page_size, **options)
    per_page = sum(KVCache.bytes_per_page(r.model.cfg, page_size, r.model.dtype) for r, _ in probe.engine.runners)
    return per_page * num_pages / 2**30


@pytest.mark.parametrize("drafter, mode", [("plain", "greedy")] + [(d, m) for d in DRAFTERS for m in ("seeded", "preemption")])
def test_outputs_with_prefix_caching_equal_those_without(tiny_llama, tiny_llama_draft, tiny_llama_eagle, drafter, mode):
    """Requests sharing a 37-token system prompt, run twice (the second call finds the first's
    pages and its own): the same tokens and logprobs as without prefix caching, bit for bit (the
    target row-invariant), and the cache was hit. Greedy requests run in a pool too small for all
    of them ("preemption": hits, then preemptions and readmissions onto cached pages), and with
    room for all (plain decoding only: with a drafter the preemption case covers its steps too)."""
    target = load_checkpoint(tiny_llama, dtype="float32")
    draft = draft_for(drafter, tiny_llama_draft, tiny_llama_eagle)
    g = torch.Generator().manual_seed(3)
    system = torch.randint(2, target[0].cfg.vocab_size, (37,), generator=g).tolist()
    prompts = [system + torch.randint(2, target[0].cfg.vocab_size, (n,), generator=g).tolist() + [5, 6, 5, 6]
               for n in (3, 9, 17, 1)]
    params = SamplingParams(temperature=0 if mode != "seeded" else 0.8, max_tokens=24, ignore_eos=True, logprobs=0,
                            seed=None if mode != "seeded" else 11)

    def run(caching: bool):
        budget = 0.02
        if mode == "preemption":  # 20 pages of 8 tokens in each pool: too few for all four at once
            budget = kv_gib_for(21, target, draft, 8, DRAFTERS[drafter])
        llm = LLM(target, draft_model=draft, row_invariant=True, kv_cache_gib=budget, page_size=8,
                  enable_prefix_caching=caching, **DRAFTERS[drafter])
        first = llm.generate(prompts[:2], params)
        return llm, first + llm.generate(prompts, params)

    plain_llm, plain = run(False)
    llm, cached = run(True)
    assert_same_outputs(plain, cached)
    cache = llm.engine.prefix_cache
    assert cache.hits >= 3 * 32 and cache.queries > cache.hits  # the second call shares at least the system prompt
    if mode == "preemption":
        assert llm.last_metrics.num_preemptions > 0
    if drafter != "plain":  # drafting after a hit goes on as without it (an EAGLE head: from the shared pages of its own pool)
        assert llm.last_metrics.num_drafted >= 0.8 * plain_llm.last_metrics.num_drafted > 0


RETRY_DRAFTERS = {**DRAFTERS, "eagle-lookup": DRAFTERS["lookup"]}  # lookup in front of the EAGLE head as well


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("drafter,seed", [(d, None) for d in RETRY_DRAFTERS] + [(d, 11) for d in ("draft", "eagle", "eagle-lookup",
                                                                                                  "eagle-tree")])
@pytest.mark.parametrize("page_size", [1, 2])
def test_a_preempted_retry_readmitted_onto_its_twins_pages_finishes(tiny_llama, tiny_llama_draft, tiny_llama_eagle,
                                                                    drafter, seed, page_size, monkeypatch):
    """Client retries: one prompt four times, greedy, in pools of about 40 small pages, too few
    for all four, with prefix caching (`minispec serve`'s default). A preempted copy comes back
    to find its twins' pages cached up to its newest token (the two newest with an EAGLE head:
    it drafts from the features of the position before), so nothing more of it is fed before its
    step. What its drafter knew about the pages it lost must go with them: an EAGLE head's
    pending features, if kept over the preemption, send its rollback below the shared pages
    ("would cut into a registered page"), failing every request of the step. Every copy
    finishes, with the tokens of a run without caching or preemption. Seeded (the standard rule
    at T = 0.8, every copy with seed 11) too: a head readmitted with no features to draft from
    skipped a draft, and a skipped draft changes what the standard rule samples."""
    target = load_checkpoint(tiny_llama, dtype="float32")
    draft, options = draft_for(drafter, tiny_llama_draft, tiny_llama_eagle), RETRY_DRAFTERS[drafter]
    prompt = torch.randint(2, target[0].cfg.vocab_size, (9,), generator=torch.Generator().manual_seed(3)).tolist()
    params = SamplingParams(temperature=0 if seed is None else 0.8, max_tokens=24, ignore_eos=True, seed=seed)
    alone = LLM(target, draft_model=draft, row_invariant=True, kv_cache_gib=0.02, page_size=page_size, **options)
    expected = alone.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids

    attach, onto_twin = PrefixCache.attach, []

    def recording(cache, seq):  # readmissions that find cached pages up to the newest token(s)
        hit = attach(cache, seq)
        if seq.num_preemptions and hit == len(seq) - cache.min_fed:
            onto_twin.append(seq.request_id)
        return hit

    monkeypatch.setattr(PrefixCache, "attach", recording)
    llm = LLM(target, draft_model=draft, row_invariant=True, page_size=page_size,
              kv_cache_gib=kv_gib_for(40, target, draft, page_size, options), enable_prefix_caching=True, **options)
    outputs = llm.generate([prompt] * 4, params, use_tqdm=False)
    assert onto_twin, "no preempted copy came back onto its twins' pages: the case is not exercised"
    assert [o.outputs[0].finish_reason for o in outputs] == ["length"] * 4
    assert [o.outputs[0].token_ids for o in outputs] == [expected] * 4
