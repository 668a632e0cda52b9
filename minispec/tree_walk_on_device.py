"""The tree walk on the device: speculative_tree.py's walk (`walk_one`, `greedy_walk`,
`pathwise_walks`), decision for decision, for every sequence at once with no host sync.

Why it is the host walk. The walk is sequential in depth, but what it decides at a node depends
only on that node's row and its children's uniforms, never on how the walk got there: the test of
child c_j at v is u_j < r(c_j) / mass_j with mass_0 = sum(p_v), mass_{j+1} = mass_j - r(c_j), and
r(c_j) = 0 for a token an earlier sibling had (it was rejected). So the device decides, for EVERY
node at once, which child the walk would accept there, or none (`child_tests`), subtracting the
masses child by child in fp64 exactly as the host walk does in Python floats, against the same
keyed uniforms (u_j = finish(the BRANCH lanes of its position, spread(j)), made on the device from
lanes uploaded per depth: randomness.uniform's bits, `walk_tables`): next[v] = the first accepted
child of v, or -1 (-1 at a row that is not finite, where the walk stops, broken). Then next is
followed from the root (`follow`): v_0 = root, v_{d+1} = next[v_d] while it is not -1, a fixed
loop of max-depth gathers with no host branch. Only the decisions at nodes the walk reaches are
used, and those are the host walk's decisions, so the path is the host walk's path. The final
token is drawn at the stopping node from its row with every child's token zeroed (all were
rejected) by the same inverse CDF and the same U(TOKEN) of position L + len(path) (uniforms for
every possible length are uploaded, the right one gathered; `final_draw`): the host walk's token.
Greedy and pathwise requests take next[v] = the first child whose token is the target's argmax /
Gumbel-max (noise from uploaded NOISE lanes) at v's row (`matching_child`), and the final token is
that pick at the stopping node. Every row is warped (the host walk warps only the rows it reads):
a row's warp does not depend on the rows beside it. tests/test_speculative_tree_device.py checks
that the two walks give identical decisions and tokens. Penalties and min_tokens change the rows
before the walk reads them (`walk_on_device`'s adjust: tree_options_on_device.py), as the host
walk reads `penalized_tree`'s rows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .pathwise import lane_gumbel_max
from .randomness import finish, spread
from .sampling import WarpParams, finite_rows, sample, warp_probs


@dataclass
class WalkShape:
    """A step's trees padded to one shape on the device: sizes[b] the nodes of sequence b's tree,
    `nodes` = max(1, max sizes) node slots past the root (slot 0 the root, slot 1 + i node i),
    `children` >= 1 child slots per node, `depth` >= 1 levels (the walk's iterations), `widths`
    per sequence the rows it hands the drafter's `observe` (its fed prefix, then `depth` rows)."""

    sizes: list[int]
    nodes: int
    children: int
    depth: int
    widths: list[int]


@dataclass
class WalkTables:
    """Each slot's children in drafted order, [B, N+1, C]: their node ids (-1 past them), tokens
    (0 past them), whether a token repeats an earlier sibling's, their BRANCH uniforms; and
    slot_depth [B, N+1] (the root's 0). Built on the device from the trees (`walk_tables`)."""

    children: torch.Tensor
    child_tokens: torch.Tensor
    repeat: torch.Tensor
    branch_u: torch.Tensor
    slot_depth: torch.Tensor


@dataclass
class DeviceWalk:
    """The walk's verdict on the device: path [B, D] node ids (-1 past the path), num_accepted [B]
    (the path's length), tokens [B, D+1] (row b emits tokens[b, :num_accepted[b] + 1]: the path's
    tokens, then the final token) and broken [B] (the walk stopped at a non-finite row)."""

    path: torch.Tensor
    num_accepted: torch.Tensor
    tokens: torch.Tensor
    broken: torch.Tensor


def walk_tables(tokens: torch.Tensor, parents: torch.Tensor, sent: dict[str, torch.Tensor], shape: WalkShape
                ) -> WalkTables:
    """The walk's tables from the trees on the device: tokens, parents [B, N] (parents first; -1
    the root's child, -2 padding). A node's rank among its siblings is the number of earlier nodes
    with its parent (`sibling_ranks`), it repeats a sibling when one of those has its token, its
    depth is found by D steps up its ancestors, and its BRANCH uniform is finish(the lanes of its
    depth's position, spread(its rank)): randomness.uniform's number, bit for bit."""
    B, N = tokens.shape
    C, D = shape.children, shape.depth
    device = tokens.device
    real = parents >= -1  # [B, N]
    index = torch.arange(N, device=device)
    earlier = index[None, :] < index[:, None]  # [N(i), N(j)]: j < i
    siblings = (parents[:, :, None] == parents[:, None, :]) & real[:, None, :] & earlier  # [B, N, N]
    rank = siblings.sum(-1)  # [B, N]
    repeat = (siblings & (tokens[:, :, None] == tokens[:, None, :])).any(-1)  # [B, N]
    depth = real.long()  # [B, N]
    ancestor = parents
    for _ in range(D):
        up = ancestor >= 0
        depth = depth + up.long()
        ancestor = torch.where(up, parents.gather(1, ancestor.clamp(min=0)), -1)
    lanes = sent["tree.branch_lanes"].gather(1, (depth - 1).clamp(min=0)[..., None].expand(B, N, 2))  # [B, N, 2]
    u = finish(lanes[..., 0], lanes[..., 1], spread(rank))  # [B, N] fp64
    # Scatter node i to (slot parent + 1, its rank); padding and ranks past C go to a spare column.
    place = torch.where(real & (rank < C), (parents + 1) * (C + 1) + rank, (N + 1) * (C + 1) + C)  # [B, N]
    children = torch.full((B, (N + 2) * (C + 1)), -1, dtype=torch.int64, device=device)
    children.scatter_(1, place, torch.arange(N, device=device).expand(B, N))
    children = children.view(B, N + 2, C + 1)[:, : N + 1, :C]  # [B, N+1, C]
    at = children.clamp(min=0)
    has = children >= 0
    return WalkTables(children, torch.where(has, tokens.gather(1, at.flatten(1)).view_as(at), 0),
                      has & repeat.gather(1, at.flatten(1)).view_as(at),
                      torch.where(has, u.gather(1, at.flatten(1)).view_as(at), 1.0),
                      torch.cat([depth.new_zeros(B, 1), depth], dim=1))


def walk_on_device(logits: torch.Tensor, sent: dict[str, torch.Tensor], tables: WalkTables, shape: WalkShape,
                   warp: WarpParams | None, adjust: Callable[[torch.Tensor], torch.Tensor] | None = None
                   ) -> DeviceWalk:
    """Step 3 for every sequence at once, on the device, with no host sync (the module
    docstring): each node's accepted child first (`child_tests`, or
    `matching_child` for greedy and pathwise requests), then `follow` from the root for D
    iterations, then the final token at the node where the walk stopped (`final_draw`, or the
    target's pick there). logits [R, V] the flat verification rows; warp: each slot's row's warp,
    None when every request is greedy (the argmax, as `accept_tree`'s greedy walk); adjust: what
    changes each slot's row [B, N+1, V] before the walk reads it (the penalties and min_tokens,
    tree_options_on_device.py `penalized_tree_on_device`; None: nothing)."""
    rows, children, child_tokens = sent["tree.rows"], tables.children, tables.child_tokens  # [B, N+1], [B, N+1, C]
    B, slots = rows.shape
    if adjust is not None:  # the adjusted rows become the logits the walk reads, slot by slot
        logits = adjust(logits[rows]).flatten(0, 1)  # [B (N+1), V]
        rows = torch.arange(B * slots, device=rows.device).view(B, slots)  # [B, N+1]
    if warp is None:
        top, best = logits.max(-1)  # [R], [R] (accept_tree's: the first argmax)
        finite, picks = top.isfinite()[rows], best[rows]  # [B, N+1]
        accepted = matching_child(picks, children, child_tokens)  # [B, N+1]
    else:
        finite = finite_rows(logits)[rows]  # [B, N+1]
        target_logits = torch.where(finite[..., None], logits[rows], 0.0)  # [B, N+1, V] (warp_rows's zeroing)
        probs = warp_probs(target_logits.flatten(0, 1), warp).view(B, slots, -1)  # [B, N+1, V]
        accepted = child_tests(probs, children, child_tokens, tables.repeat, tables.branch_u)
        if "tree.pathwise_rows" in sent:
            chosen = sent["tree.pathwise_rows"]  # [P]
            P = len(chosen)
            depth = tables.slot_depth[chosen]  # [P, N+1]
            lanes = sent["tree.noise_lanes"].gather(1, depth[..., None].expand(P, slots, 2))  # [P, N+1, 2]
            picks = lane_gumbel_max(probs[chosen].flatten(0, 1), lanes.flatten(0, 1)).view(P, slots)  # [P, N+1]
            accepted[chosen] = matching_child(picks, children[chosen], child_tokens[chosen])
    accepted = torch.where(finite, accepted, -1)  # a walk stops at a non-finite row, broken
    path, num_accepted, end = follow(accepted, shape.depth)  # [B, D], [B], [B]
    at_end = torch.arange(B, device=rows.device), end
    if warp is None:
        final = picks[at_end]  # [B]
    else:
        final = final_draw(probs[at_end], children[at_end], child_tokens[at_end],
                           sent["tree.token_u"].gather(1, num_accepted[:, None]).squeeze(1))  # [B]
        if "tree.pathwise_rows" in sent:
            final[chosen] = picks[torch.arange(P, device=rows.device), end[chosen]]
    node_tokens = tables.child_tokens.new_zeros(B, shape.nodes + 1)  # [B, N+1] each slot's token (the root's 0)
    node_tokens.scatter_(1, (children + 1).clamp(min=0).flatten(1), child_tokens.flatten(1))
    path_tokens = node_tokens.gather(1, path + 1)  # [B, D]
    tokens = torch.cat([path_tokens, path_tokens.new_zeros(B, 1)], dim=1)  # [B, D+1]
    tokens.scatter_(1, num_accepted[:, None], final[:, None])
    return DeviceWalk(path, num_accepted, tokens, ~finite[at_end])


def child_tests(probs: torch.Tensor, children: torch.Tensor, child_tokens: torch.Tensor, repeat: torch.Tensor,
                branch_u: torch.Tensor) -> torch.Tensor:
    """The sampled walk's tests at every node at once (`walk_one`'s, vectorised over nodes):
    probs [B, N+1, V] each slot's warped row; children, child_tokens, repeat, branch_u
    [B, N+1, C]. At slot v with r = its row, child j is accepted iff children 0..j-1 were
    rejected, mass_j > 0 and u_j < p_j / mass_j, where p_j = r(token_j) (0 for a token an
    earlier sibling had: rejected already) and mass_0 = sum(r), mass_{j+1} = mass_j - p_j: the
    residual's mass once the earlier siblings' tokens are zeroed. The masses are subtracted one
    child at a time in fp64, as `walk_one` does in Python floats, so every test is the same
    comparison of the same numbers. Returns each slot's accepted child (node id), or -1."""
    tested = probs.gather(-1, child_tokens).double()  # [B, N+1, C] r(token_j)
    real = children >= 0
    tested = torch.where(real & ~repeat, tested, 0.0)
    mass = probs.sum(-1, dtype=torch.float64)  # [B, N+1] (sample_walks's totals)
    accepted = torch.full_like(children[..., 0], -1)  # [B, N+1]
    for j in range(children.shape[-1]):
        hit = real[..., j] & (accepted < 0) & (mass > 0) & (branch_u[..., j] < tested[..., j] / mass)
        accepted = torch.where(hit, children[..., j], accepted)
        mass = mass - tested[..., j]
    return accepted


def matching_child(picks: torch.Tensor, children: torch.Tensor, child_tokens: torch.Tensor) -> torch.Tensor:
    """Greedy and pathwise: each slot's first child (in drafted order) whose token is the target's
    pick at that slot's row (the argmax, the Gumbel-max). picks [B, N+1]; children, child_tokens
    [B, N+1, C]. Returns [B, N+1] node ids, -1 where no child matches."""
    match = (children >= 0) & (child_tokens == picks[..., None])  # [B, N+1, C]
    first = match.long().argmax(-1, keepdim=True)  # [B, N+1, 1] the first match (or 0)
    return torch.where(match.any(-1), children.gather(-1, first).squeeze(-1), -1)


def follow(accepted: torch.Tensor, depth: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Walk down from the root along each slot's accepted child (accepted [B, N+1] node ids or -1)
    for `depth` iterations, a fixed loop of gathers: once a walk reaches a slot with none it stays
    there. Returns path [B, depth] (node ids, -1 past its end), num_accepted [B], end [B] (the
    slot where it stopped: 0 the root, 1 + i node i)."""
    B = accepted.shape[0]
    end = accepted.new_zeros(B)  # [B]
    num_accepted = accepted.new_zeros(B)
    path = accepted.new_full((B, depth), -1)
    for level in range(depth):
        child = accepted.gather(1, end[:, None]).squeeze(1)  # [B]
        path[:, level] = child
        moved = child >= 0
        end = torch.where(moved, child + 1, end)
        num_accepted += moved.long()
    return path, num_accepted, end


def final_draw(row: torch.Tensor, children: torch.Tensor, child_tokens: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The final token of a sampled walk: from the row where it stopped (row [B, V] warped) with
    every child's token zeroed (all were rejected; a leaf has none), or from the row itself should
    that leave nothing, by inverse CDF with the TOKEN uniform u [B] of the final position: the
    draw `sample_walks` makes. children, child_tokens [B, C] that node's."""
    hits = torch.zeros_like(row).scatter_add_(-1, child_tokens, (children >= 0).to(row.dtype))  # [B, V]
    residual = torch.where(hits > 0, 0.0, row)
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, row)
    return sample(residual, u)
