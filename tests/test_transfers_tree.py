"""A tree step's host <-> device traffic (speculative_tree.py `device_tree_step`): one upload,
one download, as a chain step's (tests/test_transfers.py, whose counter this reuses).

The device walk is forced (on a CPU the host walk is the default: there is no device to wait
for). Two measurements:
  * the whole step, with trees that are host data (the tree drafter's search replaced by fixed
    trees, as prompt lookup's chains are): verification, the walk, the path's K/V move, the
    features handed to the drafter and its rollback cross once each way;
  * a step whose trees the EAGLE head or a draft model grows: the target's side again makes one
    upload and one download and nothing else, the search excepted. (The search still reads each
    level's top-k on the host before it feeds the next: drafters/tree.py.)
"""

from __future__ import annotations

import functools
import sys

import pytest

import minispec.engine
import minispec.speculative_tree as tree_module
from minispec import LLM
from minispec.drafters.tree import DraftTree, TreeDrafter
from test_transfers import GREEDY, MIXED, PATHWISE, SAMPLED, TransferCounter, step_transfers

pytestmark = pytest.mark.usefixtures("one_thread")


def tree_llm(model: str, tiny_llama, tiny_llama_draft, tiny_llama_eagle, monkeypatch, lookup: bool = False) -> LLM:
    """Trees of 6 nodes, top-2, depth 3, grown by the draft model or the EAGLE head, static
    shapes, the walk on the device."""
    monkeypatch.setattr("minispec.sampling.PARTIAL_SORT_ON", ())  # the GPU's full sort (a CPU checks on the host)
    monkeypatch.setattr(minispec.engine, "tree_step", functools.partial(tree_module.tree_step, on_device=True))
    draft = {"draft": tiny_llama_draft, "eagle": tiny_llama_eagle}[model]
    return LLM(model=str(tiny_llama), kv_cache_gib=0.01, backend="torch", static_shapes=True, draft_model=str(draft),
               num_speculative_tokens=3, draft_tree_budget=6, draft_tree_top_k=2,
               prompt_lookup_min=1 if lookup else None)


def fixed_trees(self, seqs, max_depth):
    """Root -> 9 (-> 12), 11, cut to each sequence's depth: trees the host knows without asking
    the device (what a host drafter proposes)."""
    tree = DraftTree([9, 11, 12], [-1, -1, 0])
    keep = [[i for i, d in enumerate(tree.depths()) if d <= m] for m in max_depth]
    return [DraftTree([tree.tokens[i] for i in k], [tree.parents[i] for i in k]) for k in keep]


@pytest.mark.parametrize("model", ["draft", "eagle"])
def test_a_tree_step_makes_one_upload_and_one_download(tiny_llama, tiny_llama_draft, tiny_llama_eagle, model,
                                                       monkeypatch):
    """Fixed trees verified by the target (the EAGLE head observes the path's features), greedy,
    sampled, pathwise and a pathwise request beside a standard one: one upload, one download,
    nothing else."""
    llm = tree_llm(model, tiny_llama, tiny_llama_draft, tiny_llama_eagle, monkeypatch)
    monkeypatch.setattr(TreeDrafter, "propose_trees", fixed_trees)
    walks = []
    monkeypatch.setattr(tree_module, "walk_on_device", recorded(tree_module.walk_on_device, walks))
    for params in (GREEDY, SAMPLED, PATHWISE, MIXED):
        for step in step_transfers(llm, params, monkeypatch, steps=2):
            assert (step["uploads"], step["downloads"], step["up"], step["down"]) == (1, 1, 0, 0), step["where"]
    assert walks  # (the device walked)


def recorded(function, calls: list):
    def wrapped(*args, **kwargs):
        calls.append(1)
        return function(*args, **kwargs)

    return wrapped


class OutsideTheSearch(TransferCounter):
    """Counts as TransferCounter does, except inside a tree drafter's search (`propose_trees`)."""

    def count(self, direction: str, what: str) -> None:
        frame = sys._getframe(2)
        while frame is not None:
            if frame.f_code.co_name == "propose_trees":
                return
            frame = frame.f_back
        super().count(direction, what)


@pytest.mark.parametrize("lookup", [False, True], ids=["tree", "lookup+tree"])
@pytest.mark.parametrize("model", ["draft", "eagle"])
def test_past_the_search_a_tree_step_makes_one_upload_and_one_download(tiny_llama, tiny_llama_draft, tiny_llama_eagle,
                                                                      model, lookup, monkeypatch):
    """Trees grown by the draft model or the EAGLE head (prompt lookup in front, or not): the
    target's runner sends one upload and brings one download a step, and nothing else crosses
    outside the search."""
    llm = tree_llm(model, tiny_llama, tiny_llama_draft, tiny_llama_eagle, monkeypatch, lookup)
    target = llm.engine.target
    monkeypatch.setattr("test_transfers.TransferCounter", OutsideTheSearch)
    monkeypatch.setattr("test_transfers.staged", lambda llm: (target.staging.uploads, target.staging.downloads))
    walks = []
    monkeypatch.setattr(tree_module, "walk_on_device", recorded(tree_module.walk_on_device, walks))
    for params in (GREEDY, SAMPLED, PATHWISE, MIXED):
        steps = step_transfers(llm, params, monkeypatch, steps=2, prompts=["a b a b a b a b", "the quick brown fox"])
        for step in steps:
            assert (step["uploads"], step["downloads"], step["up"], step["down"]) == (1, 1, 0, 0), step["where"]
    assert walks
    drafter = llm.engine.drafter
    assert (drafter.model_drafter if lookup else drafter).head.runner.forward_counts["static"] > 0
