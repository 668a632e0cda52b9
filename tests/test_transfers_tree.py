"""A tree step's host <-> device traffic (tree_on_device.py `device_tree_step`): one upload,
one download, as a chain step's (tests/test_transfers.py, whose counter this reuses).

The device step is forced (on a CPU the host step is the default: there is no device to wait
for). Counted over every runner (the target's and the drafter's) for the whole step:
  * trees searched on the device by the draft model or the EAGLE head (drafters/tree.py
    `stage_trees`), with prompt lookup in front or not: the search's forwards, the
    verification, the walk, the path's K/V move, the features handed to the drafter and its
    rollback cross once each way;
  * trees the host knows (a drafter that proposes on the host: here fixed trees), the same.
A tree drafter with a confidence threshold searches on the device where its head decides stops
there (CUDA's default, forced here), else on the host (a CPU's: stopping early saves the later
forwards); past a host search its step makes one upload and one download as well.
"""

from __future__ import annotations

import functools
import sys

import pytest

import minispec.drafters.tree
import minispec.engine
import minispec.speculative_tree as tree_module
import minispec.tree_on_device
from minispec import LLM
from minispec.drafters.base import AutoregressiveDrafter
from minispec.drafters.draft_tree import DraftTree
from minispec.drafters.tree import TreeDrafter
from test_transfers import DRAFTER_BACKEND, GREEDY, MIXED, PATHWISE, SAMPLED, TransferCounter, step_transfers

pytestmark = pytest.mark.usefixtures("one_thread")
PROMPTS = ["a b a b a b a b", "the quick brown fox"]  # lookup finds matches in the first, and some steps of the second


def tree_llm(model: str, tiny_llama, tiny_llama_draft, tiny_llama_eagle, monkeypatch, **options) -> LLM:
    """Trees of 6 nodes, top-2, depth 3, grown by the draft model or the EAGLE head, static
    shapes, the tree step on the device."""
    monkeypatch.setattr("minispec.sampling.PARTIAL_SORT_ON", ())  # the GPU's full sort (a CPU checks on the host)
    monkeypatch.setattr(minispec.engine, "tree_step", functools.partial(tree_module.tree_step, on_device=True))
    draft = {"draft": tiny_llama_draft, "eagle": tiny_llama_eagle}[model]
    return LLM(model=str(tiny_llama), kv_cache_gib=0.01, backend=DRAFTER_BACKEND, static_shapes=True,
               draft_model=str(draft), num_speculative_tokens=3, draft_tree_budget=6, draft_tree_top_k=2, **options)


def counted(function, calls: list):
    def wrapped(*args, **kwargs):
        calls.append(1)
        return function(*args, **kwargs)

    return wrapped


@pytest.mark.parametrize("lookup", [False, True, "threshold"], ids=["tree", "lookup+tree", "threshold"])
@pytest.mark.parametrize("model", ["draft", "eagle"])
def test_a_tree_step_makes_one_upload_and_one_download(tiny_llama, tiny_llama_draft, tiny_llama_eagle, model, lookup,
                                                       monkeypatch):
    """Trees searched on the device (prompt lookup in front, or not; with a confidence threshold
    whose stops the device decides, as on CUDA), greedy, sampled, pathwise and a pathwise request
    beside a standard one: one upload, one download, nothing else."""
    options = {"threshold": dict(draft_confidence_threshold=0.05)}.get(lookup, {})
    if options:
        monkeypatch.setattr(AutoregressiveDrafter, "confidence_on_device", True)
        lookup = False
    llm = tree_llm(model, tiny_llama, tiny_llama_draft, tiny_llama_eagle, monkeypatch,
                   prompt_lookup_min=1 if lookup else None, **options)
    searches = []
    monkeypatch.setattr(minispec.drafters.tree, "search_on_device", counted(minispec.drafters.tree.search_on_device, searches))
    for params in (GREEDY, SAMPLED, PATHWISE, MIXED):
        for step in step_transfers(llm, params, monkeypatch, steps=2, prompts=PROMPTS):
            assert (step["uploads"], step["downloads"], step["up"], step["down"]) == (1, 1, 0, 0), step["where"]
    drafter = llm.engine.drafter
    head = (drafter.model_drafter if lookup else drafter).head
    counts = head.runner.forward_counts  # (the search ran, on the device, statically: on a GPU as graphs)
    assert searches and counts["static"] + counts["graph"] > 0
    if lookup:
        assert drafter.lookup_drafts > 0 and drafter.model_drafts > 0


def fixed_trees(self, seqs, max_depth):
    """Root -> 9 (-> 12), 11, cut to each sequence's depth: trees the host knows without asking
    the device (what a host drafter proposes)."""
    tree = DraftTree([9, 11, 12], [-1, -1, 0])
    keep = [[i for i, d in enumerate(tree.depths()) if d <= m] for m in max_depth]
    return [DraftTree([tree.tokens[i] for i in k], [tree.parents[i] for i in k]) for k in keep]


@pytest.mark.parametrize("model", ["draft", "eagle"])
def test_a_step_of_host_trees_makes_one_upload_and_one_download(tiny_llama, tiny_llama_draft, tiny_llama_eagle, model,
                                                                monkeypatch):
    """Fixed trees (a drafter that proposes on the host) verified by the target, the EAGLE head
    observing the path's features: one upload, one download, nothing else."""
    llm = tree_llm(model, tiny_llama, tiny_llama_draft, tiny_llama_eagle, monkeypatch)
    monkeypatch.setattr(TreeDrafter, "stage_trees", lambda self, seqs, max_depth, upload: None)
    monkeypatch.setattr(TreeDrafter, "propose_trees", fixed_trees)
    walks = []
    monkeypatch.setattr(minispec.tree_on_device, "walk_on_device", counted(minispec.tree_on_device.walk_on_device, walks))
    for params in (GREEDY, SAMPLED, PATHWISE, MIXED):
        for step in step_transfers(llm, params, monkeypatch, steps=2):
            assert (step["uploads"], step["downloads"], step["up"], step["down"]) == (1, 1, 0, 0), step["where"]
    assert walks


class OutsideTheSearch(TransferCounter):
    """Counts as TransferCounter does, except inside a host tree search (`propose_trees`)."""

    def count(self, direction: str, what: str) -> None:
        frame = sys._getframe(2)
        while frame is not None:
            if frame.f_code.co_name == "propose_trees":
                return
            frame = frame.f_back
        super().count(direction, what)


def test_past_a_host_search_a_tree_step_makes_one_upload_and_one_download(tiny_llama, tiny_llama_eagle, monkeypatch):
    """With a confidence threshold the EAGLE head searches on the host, level by level; the rest of
    the step (the target's runner) makes one upload and one download, and nothing else crosses."""
    llm = tree_llm("eagle", tiny_llama, None, tiny_llama_eagle, monkeypatch, draft_confidence_threshold=0.05)
    target = llm.engine.target
    monkeypatch.setattr("test_transfers.TransferCounter", OutsideTheSearch)
    monkeypatch.setattr("test_transfers.staged", lambda llm: (target.staging.uploads, target.staging.downloads))
    for params in (GREEDY, SAMPLED):
        for step in step_transfers(llm, params, monkeypatch, steps=2):
            assert (step["uploads"], step["downloads"], step["up"], step["down"]) == (1, 1, 0, 0), step["where"]
