"""The core's runtime half (minispec/core/: kv_cache.py, sequence.py, scheduler.py) on its own:
core sequences scheduled over a pair of page pools, with no model. A step is played by hand:
each scheduled sequence has its K/V "written" (num_cached advanced) and gets one token.

What a reader learns: sequences are admitted in arrival order up to max_num_seqs; when a pool
runs dry the newest running sequence is preempted (its pages freed, `preempted()` called) and is
readmitted, output kept, once pages free up; a finished sequence gives every page back."""

import ast
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from minispec.core.kv_cache import KVCache
from minispec.core.scheduler import Scheduler
from minispec.core.sequence import Sequence, Status

CORE = Path(__file__).resolve().parents[1] / "minispec" / "core"
PAGE_SIZE = 2
CFG = SimpleNamespace(num_layers=1, num_kv_heads=1, head_dim=2)  # all a pool reads of a config


@dataclass
class Params:
    """What the core reads of a request's sampling parameters."""

    max_tokens: int
    seed: int | None = 0
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0


class RecordingSequence(Sequence):
    """A core sequence that counts the scheduler's `preempted()` calls."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.preempted_calls = 0

    def preempted(self) -> None:
        self.preempted_calls += 1


def runner_pair(num_pages: int) -> list[tuple[SimpleNamespace, str]]:
    """A target and a draft 'runner': all the scheduler touches is their `.cache`."""
    def cache() -> KVCache:
        return KVCache(CFG, num_pages, PAGE_SIZE, torch.float32, torch.device("cpu"))

    return [(SimpleNamespace(cache=cache()), which) for which in ("target", "draft")]


def sequence(request_id: int, prompt_len: int, max_tokens: int) -> RecordingSequence:
    prompt = list(range(1, prompt_len + 1))
    return RecordingSequence(request_id, prompt, Params(max_tokens), PAGE_SIZE, eos_ids=[0])


def play_step(scheduler: Scheduler, seqs: list[Sequence]) -> None:
    """What a step does to the scheduler's books: K/V written up to the newest token, one token
    appended (never the end token), finished sequences retired."""
    for seq in seqs:
        for _, which in scheduler.runners:
            seq.table(which).num_cached = len(seq)
        if seq.append(7):
            scheduler.finish(seq)


def all_free(scheduler: Scheduler) -> bool:
    return all(r.cache.allocator.num_free == r.cache.num_pages for r, _ in scheduler.runners)


def test_sequences_are_admitted_in_arrival_order_up_to_max_num_seqs():
    scheduler = Scheduler(runner_pair(16), k=2, max_num_seqs=2, max_num_batched_tokens=64)
    seqs = [sequence(i, 3, 4) for i in range(3)]
    for seq in seqs:
        scheduler.add(seq)
    assert scheduler.schedule() == seqs[:2]
    assert [s.status for s in seqs] == [Status.RUNNING, Status.RUNNING, Status.WAITING]
    # Each reserved its tokens and k drafts in both pools: 3 + 2 positions, 3 pages of 2.
    assert all(len(s.table(w).pages) == 3 for s in seqs[:2] for w in ("target", "draft"))


def test_the_newest_sequence_is_preempted_when_pages_run_out_and_is_readmitted():
    """Two 3-token prompts take 2 pages each of a 4-page pool; at 5 tokens the oldest needs a
    third page, so the newest is preempted: its pages freed, its output kept. Once the oldest
    finishes, the newest is readmitted and runs to its end."""
    scheduler = Scheduler(runner_pair(4), k=0, max_num_seqs=4, max_num_batched_tokens=64)
    old, new = sequence(0, 3, 4), sequence(1, 3, 4)
    scheduler.add(old)
    scheduler.add(new)
    assert scheduler.schedule() == [old, new]
    play_step(scheduler, [old, new])  # both at 4 tokens: still 2 pages each
    assert scheduler.schedule() == [old, new]
    play_step(scheduler, [old, new])  # 5 tokens: a third page each, and only 4 pages

    assert scheduler.schedule() == [old]  # a step that preempted admits nobody
    assert new.status is Status.WAITING and list(scheduler.waiting) == [new]
    assert new.preempted_calls == 1 and new.num_preemptions == 1 and scheduler.num_preemptions == 1
    assert all(not new.table(w).pages and new.table(w).num_cached == 0 for w in ("target", "draft"))
    assert new.output_ids == [7, 7]  # kept: it is recomputed from its tokens

    while not old.finished:
        play_step(scheduler, [old])
        if not old.finished:
            assert scheduler.schedule() == [old]
    assert old.finish_reason == "length" and len(old.output_ids) == 4
    assert scheduler.schedule() == [new]  # readmitted onto the pages the oldest freed
    while not new.finished:
        play_step(scheduler, [new])
        if not new.finished:
            assert scheduler.schedule() == [new]
    assert new.output_ids == [7] * 4 and not scheduler.has_unfinished()


def test_finishing_or_aborting_frees_every_page():
    scheduler = Scheduler(runner_pair(8), k=3, max_num_seqs=4, max_num_batched_tokens=64)
    done, dropped = sequence(0, 5, 2), sequence(1, 4, 9)
    scheduler.add(done)
    scheduler.add(dropped)
    assert scheduler.schedule() == [done, dropped]
    assert not all_free(scheduler)
    while not done.finished:
        play_step(scheduler, [done])
    scheduler.abort(dropped)
    assert dropped.finish_reason == "abort" and not scheduler.has_unfinished()
    assert all_free(scheduler)


def test_a_sequence_stops_at_an_end_token_or_at_max_tokens():
    eos = Sequence(0, [5, 6], Params(max_tokens=3), PAGE_SIZE, eos_ids=[2])
    assert not eos.append(9) and eos.append(2) and eos.finish_reason == "stop"
    length = Sequence(1, [5, 6], Params(max_tokens=2), PAGE_SIZE, eos_ids=[2])
    assert not length.append(9) and length.append(9) and length.finish_reason == "length"
    assert length.remaining == 0 and length.tokens == [5, 6, 9, 9] and len(length) == 4


@pytest.mark.parametrize("name", ["kv_cache.py", "sequence.py", "scheduler.py"])
def test_the_core_runtime_imports_nothing_of_minispec_outside_the_core(name):
    tree = ast.parse((CORE / name).read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:  # relative: .x is minispec.core.x, ..x is minispec.x
                package = ["minispec", "core"][: 3 - node.level]
                module = ".".join(package + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            modules = [module]
        elif isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        else:
            continue
        for module in modules:
            assert module.split(".")[0] != "minispec" or module.startswith("minispec.core"), (name, module)
