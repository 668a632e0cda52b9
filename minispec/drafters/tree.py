"""Tree drafting: EAGLE-2's dynamic draft tree (Li et al. 2024, arXiv 2406.16858), grown by any
model drafter (the EAGLE-3 head, or a draft model), verified by speculative_tree.py in one target
forward.

A chain of k drafts loses everything after its first wrong guess, though the target's token was
often the head's second or third choice. A tree keeps several guesses per position. With
log q(x | path) the drafter's log-probability (temperature 1, no penalties: the tree is a
deterministic function of the accepted prefix, which is what makes the verification rule exact)
and a node's score = the sum of log q along its path (the draft's own estimate of the chance
the target walks to it):

  level 1:   the root (the sequence's last token) gets its top_k children;
  level d+1: the top_k nodes of level d by score (the frontier) are fed to the drafter in ONE
             forward, each at position root + d, attending to the cached prefix and its own
             ancestors only (a tree mask over the drafter's cache); each gets its top_k children;
  finally:   the `budget` best nodes of all levels by score (ties: the earlier node), in the
             order they were made, so parents come first. A child's score is at most its
             parent's, so every kept node's parent is kept too.

With a confidence threshold c, a sequence's tree stops growing at the first level whose best
frontier node has exp(score) < c: the draft itself gives the target's walk less than c chance
of getting that deep, so a further drafter forward (each one a sizeable part of a step on a
CPU) is unlikely to pay. The tree stays a deterministic function of the prefix.

`budget` nodes are verified by the target whatever the tree's shape (a static shape); depth is
at most `depth` (num_speculative_tokens) and at most what the request may still emit minus one.
The drafter's K/V for the fed nodes are scratch: its rollback drops them, and the next step's
catch-up feeds the accepted tokens again (a draft model) or rewrites the accepted positions from
the target's real features (an EAGLE head, drafters/eagle.py).

On the device (drafters/tree_search_on_device.py, in the tree step's one upload): the search's
shape is fixed before it runs, so `stage_trees` lays every level out in the step's upload and the
device runs them back to back, finding this search's trees; a confidence threshold's stops are
applied after the levels ran (on a CPU they stay on the host, which saves the later forwards).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..runtime.runner import Feed, TreeFeed
from ..runtime.sequence import Sequence
from ..runtime.transfers import Upload
from ..core.drafters import drop_nonfinite
from .base import AutoregressiveDrafter, Drafter
from .draft_tree import DraftTree
from .tree_search_on_device import DeviceTrees, StagedTrees, search_on_device

MAX_TREE_NODES = 63  # a tree mask row is one int64 bitmask


def tree_slots(budget: int, top_k: int, depth: int) -> int:
    """Cache slots one tree step may write past a sequence, in any pool: the target's tree
    (budget nodes; a looked-up chain: depth) or the drafter's fed frontiers ((depth - 1) * top_k)."""
    return max(budget, depth, max(0, depth - 1) * top_k)


@dataclass
class Candidate:
    """A node of the search: its target-id token, parent candidate (-1: the root), score (sum of
    log q on its path), and, once fed to the head, its key in the head's tree block and mask row."""

    token: int
    parent: int
    score: float
    fed: int = -1
    bits: int = 0


class TreeDrafter(Drafter):
    """Grows one dynamic tree per sequence with a model drafter (see the module docstring)."""

    drafts_trees = True

    def __init__(self, head: AutoregressiveDrafter, budget: int, top_k: int, confidence_threshold: float | None = None):
        if not 1 <= budget <= MAX_TREE_NODES:
            raise ValueError(f"draft tree budget must be in 1..{MAX_TREE_NODES} nodes, got {budget}")
        if top_k < 1:
            raise ValueError(f"draft tree top_k must be >= 1, got {top_k}")
        if confidence_threshold is not None and not 0 < confidence_threshold < 1:
            raise ValueError(f"draft tree confidence_threshold must be in (0, 1), got {confidence_threshold}")
        self.head, self.budget, self.top_k = head, budget, top_k  # head: the model drafter (an EAGLE head or not)
        self.confidence_threshold = confidence_threshold
        self.min_score = -math.inf if confidence_threshold is None else math.log(confidence_threshold)  # grow past a level only above it
        self.target_layers = head.target_layers
        self.block_start: dict[int, int] = {}  # per sequence (id) of this step: where its tree block starts in the draft cache

    def tree_slots(self, depth: int) -> int:
        return tree_slots(self.budget, self.top_k, depth)

    def observe(self, seqs: list[Sequence], starts: list[int], num_fed: list[int], hidden: torch.Tensor) -> None:
        self.head.observe(seqs, starts, num_fed, hidden)

    def feed_prompt(self, seqs: list[Sequence], ends: list[int]) -> None:
        self.head.feed_prompt(seqs, ends)

    def rollback(self, seqs: list[Sequence]) -> None:
        """Drop the fed frontiers' K/V (scratch), then the drafter's own rollback."""
        for s in seqs:
            if id(s) in self.block_start:
                s.draft_table.truncate(self.block_start[id(s)], self.head.runner.cache.allocator)
        self.block_start = {}
        self.head.rollback(seqs)

    def propose_trees(self, seqs: list[Sequence], max_depth: list[int]) -> list[DraftTree]:
        """One tree per sequence of at most max_depth[b] levels and `budget` nodes (empty where
        the drafter cannot draft yet, e.g. an EAGLE head in a sequence's first step)."""
        depth = [self.head.draftable(s, d) if d > 0 else 0 for s, d in zip(seqs, max_depth)]
        active = [b for b, d in enumerate(depth) if d > 0]
        found: dict[int, list[Candidate]] = {b: [] for b in active}
        if not active:
            return [DraftTree() for _ in seqs]
        logits, carry = self.head.first_forward(seqs, active)  # [A, V_d], the head's g [A, H] (None: a draft model)
        block_start = {b: seqs[b].draft_table.num_cached for b in active}  # the drafter's tree block
        self.block_start = {id(seqs[b]): start for b, start in block_start.items()}
        root = {b: len(seqs[b]) + self.head.tree_root_offset for b in active}  # the root row's position
        expanding = [(b, -1) for b in active]  # (sequence, candidate) each row of logits expands
        for level in range(1, max(depth) + 1):
            made = self.expand(found, expanding, logits)  # {b: new candidate ids}
            frontier = {b: sorted(ids, key=lambda i: (-found[b][i].score, i))[: self.top_k]
                        for b, ids in made.items() if depth[b] > level and ids}
            frontier = {b: ids for b, ids in frontier.items() if found[b][ids[0]].score >= self.min_score}
            if not frontier:
                break
            row_of = {key: r for r, key in enumerate(expanding)}  # (sequence, candidate) -> row of logits / carry
            feeds, rows, expanding = [], [], []
            for b, ids in frontier.items():
                fed_so_far = seqs[b].draft_table.num_cached - block_start[b]
                for n, i in enumerate(ids):
                    c = found[b][i]
                    c.fed = fed_so_far + n
                    c.bits = (1 << c.fed) | (found[b][c.parent].bits if c.parent >= 0 else 0)
                    rows.append(row_of[(b, c.parent)])  # (an EAGLE head's fed node reads its parent's output g)
                    expanding.append((b, i))
                nodes = [found[b][i] for i in ids]
                feeds.append(Feed(seqs[b].draft_table, [c.token for c in nodes], len(nodes),
                                  TreeFeed(block_start[b], [root[b] + level] * len(nodes), [c.bits for c in nodes])))
            logits, carry = self.head.tree_forward(feeds, carry, rows)
        return [self.select(found.get(b, [])) for b in range(len(seqs))]

    def stage_trees(self, seqs: list[Sequence], max_depth: list[int], upload: Upload) -> StagedTrees | None:
        """Lay `propose_trees`' search out in the step's upload, to run on the device with no
        host round-trip between levels (`run_staged_trees`): which sequences feed at which
        level is known before (their depths), only the nodes are not. With a confidence threshold,
        None where the head decides its stops on the host (`AutoregressiveDrafter.stops_on_device`:
        there, stopping at an unsure level saves the later forwards); on the device every level
        runs and the stops are applied after (tree_search_on_device.py `stop_growing`)."""
        if self.confidence_threshold is not None and not self.head.stops_on_device:
            return None
        head = self.head
        levels = [head.draftable(s, d) if d > 0 else 0 for s, d in zip(seqs, max_depth)]
        active = [b for b, d in enumerate(levels) if d > 0]
        w = min(self.top_k, head.vocab_size if head.draft_ids is None else len(head.draft_ids))
        sizes = [min(self.budget, w + (d - 1) * w * w) if d > 0 else 0 for d in levels]
        staged = StagedTrees(levels, sizes, active, w, upload.scope(), min_score=self.min_score)
        self.block_start = {}
        if not active:
            return staged
        staged.ahead = head.feed_ahead([seqs[b] for b in active], upload)
        feeds, args = head.first_feeds(seqs, active)
        staged.first = (head.runner.prepare(feeds, upload), args)
        block_start = {b: seqs[b].draft_table.num_cached for b in active}  # the drafter's tree block
        self.block_start = {id(seqs[b]): start for b, start in block_start.items()}
        p, previous = staged.prefix, active
        upload.add(p + "active", active)  # [A] batch rows
        upload.add(p + "sizes", [sizes[b] for b in active])  # [A]
        for level in range(1, max(levels)):
            fed = [b for b in active if levels[b] > level]
            # Placeholder mask rows with `level` bits set (as their position says); the device writes them.
            low = (1 << (level - 1)) - 1
            rows = [low | 1 << ((level - 1) * w + n) for n in range(w)]
            feeds = [Feed(seqs[b].draft_table, [0] * w, w,
                          TreeFeed(block_start[b], [len(seqs[b]) + head.tree_root_offset + level] * w, rows), drawn=w)
                     for b in fed]
            staged.forwards.append(head.runner.prepare(feeds, upload))
            upload.add(f"{p}fed{level}", [active.index(b) for b in fed])  # [F] rows among the active
            per_parent = 1 if level == 1 else w  # rows the previous forward gave each sequence
            upload.add(f"{p}parent_row{level}", [previous.index(b) * per_parent for b in fed])  # [F]
            previous = fed
        return staged

    def run_staged_trees(self, seqs: list[Sequence], staged: StagedTrees, sent: dict[str, torch.Tensor]
                         ) -> DeviceTrees:
        """The device's half of `stage_trees` (tree_search_on_device.py `search_on_device`)."""
        return search_on_device(self.head, seqs, staged, sent)

    def expand(self, found: dict[int, list[Candidate]], expanding: list[tuple[int, int]], logits: torch.Tensor
               ) -> dict[int, list[int]]:
        """Give each expanded node (one row of logits [R, V_d]) its top_k children; returns the
        new candidates' ids per sequence. One host copy."""
        if not expanding:
            return {}
        logits, ok = drop_nonfinite(logits)  # a row that is not finite gets no children
        k = min(self.top_k, logits.shape[-1])
        values, ids = logits.float().log_softmax(-1).topk(k, dim=-1)  # [R, k]
        tokens = self.head.draft_ids[ids] if self.head.draft_ids is not None else ids  # [R, k] target ids
        values, tokens, ok = values.tolist(), tokens.tolist(), ok.tolist()
        made: dict[int, list[int]] = {}
        for (b, parent), vals, toks, usable in zip(expanding, values, tokens, ok):
            if not usable:
                continue
            base = found[b][parent].score if parent >= 0 else 0.0
            for v, t in zip(vals, toks):
                if v > float("-inf"):
                    made.setdefault(b, []).append(len(found[b]))
                    found[b].append(Candidate(t, parent, base + v))
        return made

    def select(self, candidates: list[Candidate]) -> DraftTree:
        """The `budget` best candidates by score (ties: the earlier), in creation order."""
        keep = sorted(sorted(range(len(candidates)), key=lambda i: (-candidates[i].score, i))[: self.budget])
        index = {c: n for n, c in enumerate(keep)}
        return DraftTree([candidates[i].token for i in keep],
                         [index[candidates[i].parent] if candidates[i].parent >= 0 else -1 for i in keep])
