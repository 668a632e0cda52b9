"""The tree drafter's search on the device: drafters/tree.py's host search, laid out so that the
device runs every level back to back with no host round-trip (the tree step's one upload,
tree_on_device.py).

Without a confidence threshold the search's shape is fixed before it runs: each expanded node gets
w = min(top_k, V_d) children, so level 1 has w candidates, every later level w^2, every frontier
w nodes, and which sequences feed at which level follows from their depths. So the host lays
every forward out in the step's upload (`TreeDrafter.stage_trees`: each level's nodes are drawn
tokens at known positions and key indices, with placeholder mask rows, `StagedTrees`), and the
device runs the levels back to back (`search_on_device`): the frontier by a stable sort of -score
(the host's sort by (-score, id)), the fed nodes' mask rows (1 << key | the parent's row) and an
EAGLE head's carry rows by gathers, the next candidates by top-k (`top_children`, the host's
`expand`), scores in fp64 (the host's Python floats). The `budget` best candidates in candidate
order are the tree (`select_on_device`, the host's `select`): the host search's tree, wherever
each drafted row is finite and has w finite logits (tests/test_speculative_tree_device.py compares
the two through whole generations). Elsewhere the host feeds fewer nodes; either way the tree is
fixed by the prefix before the target's random numbers are drawn, so the verification stays exact.

With a confidence threshold (on CUDA: `AutoregressiveDrafter.stops_on_device`) every level still
runs, and the stop is applied after the fact (`stop_growing`): the candidates of the levels the
host would not have fed are dropped, so the tree is the host's; only the forwards are spent.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..core.drafters import drop_nonfinite
from ..runtime.runner import DrawnTree
from ..runtime.sequence import Sequence
from .base import AutoregressiveDrafter
from .draft_tree import DraftTree


@dataclass
class StagedTrees:
    """A tree search laid out in a step's upload (`TreeDrafter.stage_trees`), to run on the device
    with no host round-trip between levels. Per sequence b: levels[b] (0: no tree) and sizes[b],
    its tree's node count (min(budget, its candidates): the search always makes width children
    per expanded node, width = min(top_k, the logits' width)); active, the sequences that draft;
    the head's forwards: `feed_ahead`'s pieces, the first (catch-up) forward and one per level
    fed (prepared forward, model arguments); prefix, the upload's names of the search's arrays;
    host_trees, trees of other rows that a drafter in front (prompt lookup) found on the host;
    min_score, the log of the confidence threshold (-inf: none)."""

    levels: list[int]
    sizes: list[int]
    active: list[int]
    width: int
    prefix: str
    ahead: list = field(default_factory=list)
    first: tuple | None = None
    forwards: list = field(default_factory=list)
    host_trees: dict[int, DraftTree] = field(default_factory=dict)  # rows lookup filled on the host
    min_score: float = -math.inf


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


def search_on_device(head: AutoregressiveDrafter, seqs: list[Sequence], staged: StagedTrees,
                     sent: dict[str, torch.Tensor]) -> DeviceTrees:
    """`TreeDrafter.propose_trees` on the device (TreeDrafter.run_staged_trees), with its head.
    Candidates of sequence b live in a fixed layout [M], M = w + (levels - 1) w^2
    (w = staged.width): level 1 at 0..w-1
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
    p, w = staged.prefix, staged.width
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
    score[:, :w], token[:, :w] = top_children(head, logits, w)
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
        values, children = top_children(head, logits, w)  # [F * w, w]
        made = slice(hi, hi + w * w)  # the next level's candidates
        score[rows, made] = (score[rows].gather(1, frontier)[..., None] + values.view(F, w, w)).flatten(1)
        token[rows, made] = children.view(F, w * w)
        parent[rows, made] = frontier[..., None].expand(F, w, w).flatten(1)
    active = sent[p + "active"]  # [A] batch rows
    score, sizes = stop_growing(score, sent[p + "sizes"], staged.min_score, w, levels)
    found = select_on_device(score, token, parent, sizes, N, w, levels)
    out.tokens[active], out.parents[active], out.depths[active], out.bits[active] = found
    return out


def stop_growing(score: torch.Tensor, sizes: torch.Tensor, min_score: float, w: int, levels: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The host search's stops, applied to a search that ran every level: a sequence's tree grows
    past level l only if l's best candidate scores >= min_score (the log of the confidence
    threshold; a level with no finite candidate stops it too), so the candidates of the levels
    after its first failing one are dropped (score -inf). A tree then keeps at most its finite
    candidates, as the host's `select` does among the candidates it made. score [A, M] in the
    candidate layout (`search_on_device`), sizes [A] -> (score, sizes)."""
    level = torch.arange(score.shape[1], device=score.device)  # [M] candidate ids ...
    level = torch.where(level < w, 0, 1 + (level - w).div(w * w, rounding_mode="floor"))  # [M] ... -> level - 1
    best = torch.full((score.shape[0], levels), float("-inf"), dtype=score.dtype, device=score.device)
    best = best.scatter_reduce(1, level.expand_as(score), score, "amax")  # [A, levels] each level's best
    grows = torch.cat([torch.ones_like(best[:, :1], dtype=torch.bool), (best >= min_score)[:, :-1]], 1)
    kept = grows.cumprod(1).bool()  # [A, levels]: every level before it grew
    score = score.masked_fill(~kept.gather(1, level.expand_as(score)), float("-inf"))
    return score, torch.minimum(sizes, (score > float("-inf")).sum(-1))


def top_children(head: AutoregressiveDrafter, logits: torch.Tensor, w: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`TreeDrafter.expand` on the device: each row's w best children of logits [R, V_d] as (log q in fp64,
    -inf for a row that is not finite or a child the host would drop), target ids), [R, w] each."""
    logits, ok = drop_nonfinite(logits)
    values, ids = logits.float().log_softmax(-1).topk(w, dim=-1)  # [R, w]
    tokens = head.draft_ids[ids] if head.draft_ids is not None else ids
    return torch.where(ok[:, None], values.double(), float("-inf")), tokens


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
