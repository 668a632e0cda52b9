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

On the device (`stage_trees`, `search_on_device`: speculative_tree.py's one-upload step). Without
a confidence threshold the search's shape is fixed before it runs: each expanded node gets
w = min(top_k, V_d) children, so level 1 has w candidates, every later level w^2, every frontier
w nodes, and which sequences feed at which level follows from their depths. So the host lays
every forward out in the step's upload (each level's nodes are drawn tokens at known positions
and key indices, with placeholder mask rows), and the device runs the levels back to back: the
frontier by a stable sort of -score (the host's sort by (-score, id)), the fed nodes' mask rows
(1 << key | the parent's row) and an EAGLE head's carry rows by gathers, the next candidates by
top-k, scores in fp64 (the host's Python floats). The `budget` best candidates in candidate order
are the tree: the host search's tree, wherever each drafted row is finite and has w finite
logits (tests/test_speculative_tree_device.py compares the two through whole generations). With
a threshold the search stays on the host, which alone can decide not to launch the next level.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..runtime.runner import DrawnTree, Feed, TreeFeed
from ..runtime.sequence import Sequence
from ..runtime.transfers import Upload
from ..core.drafters import drop_nonfinite
from .base import AutoregressiveDrafter, Drafter

MAX_TREE_NODES = 63  # a tree mask row is one int64 bitmask


def tree_slots(budget: int, top_k: int, depth: int) -> int:
    """Cache slots one tree step may write past a sequence, in any pool: the target's tree
    (budget nodes; a looked-up chain: depth) or the drafter's fed frontiers ((depth - 1) * top_k)."""
    return max(budget, depth, max(0, depth - 1) * top_k)


@dataclass
class DraftTree:
    """Drafted tokens of one sequence as a tree, nodes in parents-first order: tokens[i] is node
    i's token, parents[i] its parent node (-1: a child of the root, the sequence's last token)."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.tokens)

    @classmethod
    def chain(cls, tokens: list[int]) -> "DraftTree":
        """A chain of drafts as a tree (prompt lookup's proposal)."""
        return cls(list(tokens), list(range(-1, len(tokens) - 1)))

    def depths(self) -> list[int]:
        """Depth of each node (1 for the root's children)."""
        out: list[int] = []
        for p in self.parents:
            out.append(1 if p < 0 else out[p] + 1)
        return out

    def ancestor_bits(self) -> list[int]:
        """The tree mask rows: bit j of row i is set when node j is node i or one of its ancestors."""
        out: list[int] = []
        for i, p in enumerate(self.parents):
            out.append((1 << i) | (0 if p < 0 else out[p]))
        return out

    def children(self) -> list[list[int]]:
        """children[0]: the root's children; children[i + 1]: node i's (in node order)."""
        out: list[list[int]] = [[] for _ in range(len(self) + 1)]
        for i, p in enumerate(self.parents):
            out[p + 1].append(i)
        return out

    def path_tokens(self, node: int) -> list[int]:
        """The tokens from the root's child down to `node` (none for node -1, the root)."""
        path = []
        while node >= 0:
            path.append(self.tokens[node])
            node = self.parents[node]
        return path[::-1]


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

    def stage_trees(self, seqs: list[Sequence], max_depth: list[int], upload: Upload) -> "StagedTrees | None":
        """Lay `propose_trees`' search out in the step's upload, to run on the device with no
        host round-trip between levels (`run_staged_trees`): which sequences feed at which
        level is known before (their depths), only the nodes are not. None with a confidence
        threshold: stopping a tree at an unsure level is what saves the later forwards, and only
        the host can decide not to launch them (as the chain's `AutoregressiveDrafter.stage`)."""
        if self.confidence_threshold is not None:
            return None
        head = self.head
        levels = [head.draftable(s, d) if d > 0 else 0 for s, d in zip(seqs, max_depth)]
        active = [b for b, d in enumerate(levels) if d > 0]
        w = min(self.top_k, head.vocab_size if head.draft_ids is None else len(head.draft_ids))
        sizes = [min(self.budget, w + (d - 1) * w * w) if d > 0 else 0 for d in levels]
        staged = StagedTrees(levels, sizes, active, w, upload.scope())
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

    def run_staged_trees(self, seqs: list[Sequence], staged: "StagedTrees", sent: dict[str, torch.Tensor]
                         ) -> "DeviceTrees":
        """The device's half of `stage_trees` (`search_on_device`)."""
        return search_on_device(self, seqs, staged, sent)

    def top_children(self, logits: torch.Tensor, w: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`expand` on the device: each row's w best children of logits [R, V_d] as (log q in fp64,
        -inf for a row that is not finite or a child the host would drop), target ids), [R, w] each."""
        logits, ok = drop_nonfinite(logits)
        values, ids = logits.float().log_softmax(-1).topk(w, dim=-1)  # [R, w]
        tokens = self.head.draft_ids[ids] if self.head.draft_ids is not None else ids
        return torch.where(ok[:, None], values.double(), float("-inf")), tokens

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


@dataclass
class StagedTrees:
    """A tree search laid out in a step's upload (`TreeDrafter.stage_trees`), to run on the device
    with no host round-trip between levels. Per sequence b: levels[b] (0: no tree) and sizes[b],
    its tree's node count (min(budget, its candidates): the search always makes width children
    per expanded node, width = min(top_k, the logits' width)); active, the sequences that draft;
    the head's forwards: `feed_ahead`'s pieces, the first (catch-up) forward and one per level
    fed (prepared forward, model arguments); prefix, the upload's names of the search's arrays;
    host_trees, trees of other rows that a drafter in front (prompt lookup) found on the host."""

    levels: list[int]
    sizes: list[int]
    active: list[int]
    width: int
    prefix: str
    ahead: list = field(default_factory=list)
    first: tuple | None = None
    forwards: list = field(default_factory=list)
    host_trees: dict[int, DraftTree] = field(default_factory=dict)  # rows lookup filled on the host


@dataclass
class DeviceTrees:
    """Trees on the device, B rows padded to N = max(1, max sizes) nodes, parents first: tokens
    [B, N] (target ids), parents [B, N] (-1: the root's child; -2: padding), depths [B, N] (1 for
    the root's children) and bits [B, N] (each node's mask row over the tree's nodes: itself and
    its ancestors)."""

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    bits: torch.Tensor


def search_on_device(drafter: TreeDrafter, seqs: list[Sequence], staged: StagedTrees,
                     sent: dict[str, torch.Tensor]) -> DeviceTrees:
    """`propose_trees` on the device (TreeDrafter.run_staged_trees). Candidates of sequence b
    live in a fixed layout [M], M = w + (levels - 1) w^2 (w = staged.width): level 1 at 0..w-1
    (the root's top-w), level l + 1 at w + (l - 1) w^2 + n w + r (the r-th child of level l's
    n-th frontier node), which is the order the host search makes them in. Each level: the
    frontier is the level's w best candidates by score, ties to the earlier (a stable sort of
    -score: the host's sorted(key=(-score, id))); the frontier's tokens are fed as drawn tokens,
    their mask rows (1 << their key in the tree block | their parent's row) written on the device
    (runner.DrawnTree), an EAGLE head's carry gathered at each parent's row; its logits' top-w
    give the next level's candidates, score = the parent's + log q, in fp64 as the host's
    Python floats. Then `select_on_device`. The same trees as the host search wherever each
    drafted row is finite and has w finite logits (elsewhere the host feeds fewer nodes: still a
    tree fixed by the prefix, so still exact)."""
    head, p, w = drafter.head, staged.prefix, staged.width
    device = head.runner.device
    B, N = len(seqs), max(1, max(staged.sizes, default=0))
    out = DeviceTrees(*(torch.full((B, N), fill, dtype=torch.int64, device=device) for fill in (0, -2, 1, 0)))
    if not staged.active:
        return out
    A, levels = len(staged.active), max(staged.levels)
    M = w + (levels - 1) * w * w
    score = torch.full((A, M), float("-inf"), dtype=torch.float64, device=device)  # [A, M]
    token = torch.zeros(A, M, dtype=torch.int64, device=device)  # [A, M] target ids
    parent = torch.full((A, M), -1, dtype=torch.int64, device=device)  # [A, M] candidate ids, -1 the root
    for prepared, args in staged.ahead:
        head.runner.run(prepared, **args)
    prepared, args = staged.first
    logits, carry = head.split(head.runner.run(prepared, **args))  # [A, V_d], the carry or None
    score[:, :w], token[:, :w] = drafter.top_children(logits, w)
    keys = torch.arange(w, device=device)  # [w]
    frontier_bits = torch.zeros(A, w, dtype=torch.int64, device=device)  # [A, w] the last frontier's mask rows
    for level, prepared in enumerate(staged.forwards, start=1):
        rows = sent[f"{p}fed{level}"]  # [F] rows among the active
        F = len(rows)
        lo, hi = (0, w) if level == 1 else (w + (level - 2) * w * w, w + (level - 1) * w * w)  # this level's
        order = torch.sort(-score[rows, lo:hi], dim=-1, stable=True).indices[:, :w]  # [F, w] best first
        frontier = lo + order  # [F, w] candidate ids
        own = torch.bitwise_left_shift(torch.ones_like(keys), (level - 1) * w + keys)  # [w] their keys' bits
        first_row = sent[f"{p}parent_row{level}"][:, None]  # [F, 1] the previous forward's first row of each
        if level == 1:  # (every node's parent is the root: the first forward's row)
            bits, carry_rows = own.expand(F, w), first_row.expand(F, w)
        else:
            slot = order // w  # [F, w] the parent's place in the previous frontier
            bits, carry_rows = own | frontier_bits[rows].gather(1, slot), first_row + slot
        frontier_bits[rows] = bits
        extra = {} if carry is None else head.chain_args(carry[carry_rows.flatten()])
        fed = token[rows].gather(1, frontier)  # [F, w]
        mask = DrawnTree(bits=bits.flatten())
        result = head.runner.run(prepared, drawn=fed.flatten(), drawn_tree=mask, **extra)
        logits, carry = head.split(result)  # [F * w, V_d]
        values, children = drafter.top_children(logits, w)  # [F * w, w]
        made = slice(hi, hi + w * w)  # the next level's candidates
        score[rows, made] = (score[rows].gather(1, frontier)[..., None] + values.view(F, w, w)).flatten(1)
        token[rows, made] = children.view(F, w * w)
        parent[rows, made] = frontier[..., None].expand(F, w, w).flatten(1)
    active = sent[p + "active"]  # [A] batch rows
    found = select_on_device(score, token, parent, sent[p + "sizes"], N, w, levels)
    out.tokens[active], out.parents[active], out.depths[active], out.bits[active] = found
    return out


def select_on_device(score: torch.Tensor, token: torch.Tensor, parent: torch.Tensor, sizes: torch.Tensor, N: int,
                     w: int, levels: int) -> tuple[torch.Tensor, ...]:
    """`TreeDrafter.select` on the device: candidates [A, M] (score fp64, -inf where none; token;
    parent candidate id), sizes [A] nodes wanted -> the tree padded to N nodes: tokens, parents
    (-1 the root, -2 padding), depths, mask rows [A, N]. The sizes[a] best by score (a stable sort:
    ties to the earlier), in candidate order (a child's score is at most its parent's, so its
    parent is kept and comes first); a node's mask row by `levels` steps up its ancestors."""
    A, M = score.shape
    device = score.device
    best = torch.sort(-score, dim=-1, stable=True).indices[:, :N]  # [A, min(M, N)]
    best = torch.nn.functional.pad(best, (0, N - best.shape[1]), value=M)  # [A, N] (a longer chain beside it)
    wanted = torch.arange(N, device=device)[None, :] < sizes[:, None]  # [A, N]
    chosen = torch.where(wanted, best, M).sort(dim=-1).values  # [A, N] candidate order, padding (M) last
    real = chosen < M
    kept = chosen.clamp(max=M - 1)
    nodes = torch.arange(N, device=device).expand(A, N)
    node_of = torch.full((A, M + 2), -1, dtype=torch.int64, device=device)  # column 1 + c: candidate c's node
    node_of.scatter_(1, torch.where(real, 1 + kept, M + 1), nodes)  # (column 0: the root, -1; M + 1: spare)
    parents = torch.where(real, node_of.gather(1, parent.gather(1, kept) + 1), -2)  # [A, N]
    depths = torch.where(kept < w, 1, 2 + (kept - w) // (w * w))  # [A, N] from the candidate layout
    one = torch.ones_like(nodes)
    bits = torch.where(real, torch.bitwise_left_shift(one, nodes), 0)  # [A, N]
    ancestor = parents
    for _ in range(levels):
        up = ancestor >= 0
        bits = bits | torch.where(up, torch.bitwise_left_shift(one, ancestor.clamp(min=0)), 0)
        ancestor = torch.where(up, parents.gather(1, ancestor.clamp(min=0)), -1)
    return token.gather(1, kept), parents, depths, bits
