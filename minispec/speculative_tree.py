"""Tree speculative decoding: one step, top to bottom (the chain step is speculative.py; read it first).

For every running sequence whose last token is x_L (the root of its tree):
  1. Draft a tree (drafters/tree.py): N nodes n_1..n_N, each a token whose parent is the root or
     an earlier node, chosen deterministically from the draft (no random number is drawn).
  2. Verify. ONE target forward over [x_L, n_1, .., n_N]: node i sits at position L + depth(i)
     (siblings share a position) and attends to the cached prefix, the root, its ancestors and
     itself only (the tree mask of kernels/paged_attention.py). Row 0 gives p_root, the target's
     distribution after x_L; row i gives p_i, its distribution after the path to node i.
  3. Accept / reject: walk down from the root. At node v, with r = p_v, try v's children c_1..c_m
     in the order they were drafted (best draft score first):
         accept c_j with probability r(c_j) / sum(r); on acceptance move to c_j and start over
         there; on rejection set r(c_j) = 0 and try c_{j+1}.
     When every child of v is rejected (or v is a leaf), sample one token from r / sum(r) and
     stop. The step emits the accepted path and that token: at least one, at most depth + 1.
  4. KV. The target cached K/V for the root and all N nodes; the path's nodes move to the
     sequence's next positions (at most depth rows per layer, `move_path`) and everything past
     them is truncated, as for a chain. The drafter observes the target's features of the root
     and the path, then forgets its own tree.

Why it is exact. The children of v are fixed before the target's random numbers are drawn, so
at v this is sequential sampling from p_v: P(emit c_1) = p_v(c_1), and given that c_1 was
rejected the procedure restarts on r = p_v( . | X != c_1) with children c_2..c_m, so by induction
on m, P(X = x | X != c_1) = p_v(x) / (1 - p_v(c_1)) for every x != c_1; with no children left X
is drawn from r itself. Hence X ~ p_v whatever the children are. If X is a child, the next token
is decided at X's node with p_X, the target's law given the path; by the chain rule the emitted
tokens follow the target's autoregressive law. A repeated sibling has r = 0 and is never
accepted. (This is EAGLE's `evaluate_posterior`, SpecInfer's rule with a one-hot q per drafted
child. SpecInfer's multi-draft rule with the draft's q, accept with min(1, p/q) and continue on
norm((p - q)^+), is exact only for children drawn i.i.d. from q, and biased for top-k children:
tests/test_speculative_tree.py shows both.)

Greedy (temperature 0): p_v is one-hot at the target's argmax, so the walk follows the child
equal to it and emits the argmax where there is none: the longest root-to-leaf path the target
agrees with, then the target's own token. No random number is drawn.

Randomness: keyed by the request's seed and positions (randomness.py): the test of the j-th
child (in drafted order) of the node at a position uses U(BRANCH, that position, the step, j),
the final token U(TOKEN) of its own position, as the chain's: a seeded request's output does not
depend on what else is in the batch. Penalties and min_tokens apply to p at every node with the
path before it (as speculative.py's chain); the draft's tree ignores them (any tree is exact).

Pathwise requests (pathwise.py) walk as greedy ones do, with the target's Gumbel-max token at
each row in place of its argmax: a node is accepted iff it is the token plain pathwise decoding
emits at its position after its path, so the walk emits plain decoding's tokens.

The walk above, on the host, is the reference (`host_tree_step`, `accept_tree`): it reads the
rows it needs one host copy at a time, with penalties, min_tokens and logprobs. The same step on
the device, one upload and one download, is tree_on_device.py, and its walk, decision for decision
the host walk's, is tree_walk_on_device.py; penalties, min_tokens and logprobs ride in it
(tree_options_on_device.py). On a CPU the host step is the default (no device to wait for, and it
warps fewer rows).
The tree's shared layout (its verification feed, its rows in the flat logits) is tree_layout.py.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .drafters.base import Drafter
from .drafters.draft_tree import DraftTree
from .pathwise import gumbel_max
from .penalties import penalize
from .randomness import Purpose, uniform, uniforms
from .runtime.metrics import StepTimes
from .runtime.runner import ModelRunner
from .runtime.sequence import Sequence
from .sampling import finite_rows, sample, warp_probs
from .speculative import StepResult, emit_accepted, verify_forward
from .tree_layout import first_rejected, tree_feed, tree_offsets
from .tree_on_device import device_tree_step
from .verification_options import top_logprobs


def tree_step(seqs: list[Sequence], target: ModelRunner, drafter: Drafter, depth: int,
              emit: Callable[[Sequence, int], bool], times: StepTimes, on_device: bool | None = None
              ) -> list[StepResult]:
    """Advance every sequence by one tree step. Returns a `StepResult` per sequence: a tree seen
    along its taken branch (the accepted path's tokens plus the draft's first choice that was
    rejected below it; the path's length; the tree's depth).

    on_device: the step on the device (`device_tree_step`: the search where the drafter has one
    there, the walk and the K/V move; one upload, one download) or on the host (the drafter's
    `propose_trees`, then `host_tree_step`: the reference twin, the same tokens). None: on the
    device unless the target runs on the CPU, where there is no device to wait for and the host
    walk warps only the rows a walk reads. Penalties, min_tokens and logprobs ride in the device
    step too (tree_options_on_device.py: the twin of `penalized_tree` and `top_logprobs` here).
    Precondition (kept by the engine): seq.target_table.num_cached <= len(seq) - 1."""
    # 1. Draft: never deeper than the request may still emit (the final token is free).
    max_depth = [min(depth, s.remaining - 1) for s in seqs]
    if on_device is None:
        on_device = target.device.type != "cpu"
    if on_device:
        return device_tree_step(seqs, target, drafter, max_depth, emit, times)
    with times.timing("draft_s", target.device):
        trees = drafter.propose_trees(seqs, max_depth)
    return host_tree_step(seqs, target, drafter, trees, emit, times)


def host_tree_step(seqs: list[Sequence], target: ModelRunner, drafter: Drafter, trees: list[DraftTree],
                   emit: Callable[[Sequence, int], bool], times: StepTimes) -> list[StepResult]:
    """Steps 2-4 with the walk on the host (`accept_tree`): a host copy per decision the walk
    needs, penalties, min_tokens and logprobs included."""
    with times.verifying(seqs, target.device):
        # 2. Verify: one forward; row offsets[b] is sequence b's root row, offsets[b] + 1 + i node i's.
        feeds = [tree_feed(s, t) for s, t in zip(seqs, trees)]
        starts = [s.target_table.num_cached for s in seqs]
        logits, hidden = verify_forward(target, feeds, drafter.target_layers)  # [sum(N_b + 1), V]
        offsets = tree_offsets(trees)
        raw = logits
        logits = penalized_tree(logits, seqs, trees)
        # 3. Accept / reject.
        paths, finals, failures = accept_tree(logits, seqs, trees, offsets)

    path_rows = [[offsets[b]] + [offsets[b] + 1 + i for i in path] for b, path in enumerate(paths)]
    top = top_logprobs(raw[torch.tensor([r for rows in path_rows for r in rows], device=raw.device)], seqs,
                       [len(p) for p in paths])
    drafted = [[t.tokens[i] for i in path] for t, path in zip(trees, paths)]
    lengths = [len(s) for s in seqs]
    emit_accepted(seqs, [d + [f] for d, f in zip(drafted, finals)], [len(p) for p in paths],
                  [max(t.depths(), default=0) for t in trees], top, failures, emit)

    # 4. KV: the path's K/V to the next positions, then roll back as a chain does.
    move_path(target, seqs, lengths, paths)
    for s in seqs:
        s.target_table.truncate(len(s) - 1, target.cache.allocator)
    if hidden is not None:  # the target's features of the fed prefix and of the path, in position order
        keep, kept, row = [], [], 0
        for f, t, path in zip(feeds, trees, paths):
            fed_prefix = len(f.tokens) - len(t)
            keep += [row + j for j in range(fed_prefix)] + [row + fed_prefix + i for i in path]
            kept.append(fed_prefix + len(path))
            row += len(f.tokens)
        drafter.observe(seqs, starts, kept, hidden[torch.tensor(keep, device=hidden.device)])
    drafter.rollback(seqs)
    return [StepResult(d + first_rejected(t, path), len(d), max(t.depths(), default=0))
            for d, t, path in zip(drafted, trees, paths)]


def penalized_tree(logits: torch.Tensor, seqs: list[Sequence], trees: list[DraftTree]) -> torch.Tensor:
    """The verification logits [sum(N_b + 1), V] with each request's penalties and min_tokens:
    the root's row sees the sequence's tokens, node i's row the tokens of its path too."""
    if not any(s.params.adjusts_logits for s in seqs):
        return logits
    return penalize(logits, [s.penalty_row(t.path_tokens(node)) for s, t in zip(seqs, trees) for node in range(-1, len(t))])


def accept_tree(logits: torch.Tensor, seqs: list[Sequence], trees: list[DraftTree], offsets: list[int]
                ) -> tuple[list[list[int]], list[int], dict[int, int]]:
    """Step 3 for every sequence: (accepted path as node ids, final token, {b: position} of the
    sequences whose walk reached a non-finite row: they emit the path and fail there, where plain
    decoding would have met the same logits)."""
    if all(s.params.greedy for s in seqs):
        top, best = logits.max(-1)  # one pass; top is NaN / +inf / -inf where finite_rows is False, best the first argmax
        finite_host, best = torch.stack([top.isfinite().long(), best]).tolist()
        walks = [greedy_walk(t, best[o:], finite_host[o:]) for t, o in zip(trees, offsets)]
        finals = [best[offsets[b] + 1 + path[-1] if path else offsets[b]] for b, (path, _, _) in enumerate(walks)]
    else:
        walks, finals = [None] * len(seqs), [None] * len(seqs)
        finite = finite_rows(logits).tolist()
        standard = [b for b, s in enumerate(seqs) if not s.pathwise]
        pathwise = [b for b, s in enumerate(seqs) if s.pathwise]
        for rule, chosen in ((sample_walks, standard), (pathwise_walks, pathwise)):
            if chosen:
                rows = [r for b in chosen for r in range(offsets[b], offsets[b + 1])]
                local = [0]
                for b in chosen:
                    local.append(local[-1] + offsets[b + 1] - offsets[b])
                some = logits if len(chosen) == len(seqs) else logits[torch.tensor(rows, device=logits.device)]
                got, got_finals = rule(some, [seqs[b] for b in chosen], [trees[b] for b in chosen], local,
                                       [finite[r] for r in rows])
                for b, w, f in zip(chosen, got, got_finals):
                    walks[b], finals[b] = w, f
    failures = {b: len(seqs[b]) + len(path) for b, (path, _, broken) in enumerate(walks) if broken}  # token positions
    return [w[0] for w in walks], finals, failures


def pathwise_walks(logits: torch.Tensor, seqs: list[Sequence], trees: list[DraftTree], offsets: list[int],
                   finite: list[bool]) -> tuple[list[tuple[list[int], list[int], bool]], list[int]]:
    """The walks of pathwise requests, depth by depth: at each sequence's current node (the root
    first) warp its row and take the target's Gumbel-max token for the next position; move to the
    child with that token, or end with it. Only the rows a walk reaches are warped and given noise
    (as many as the tokens emitted); a walk that reaches a non-finite row stops there, broken."""
    children = [t.children() for t in trees]
    node, paths, finals, broken = [-1] * len(seqs), [[] for _ in seqs], [0] * len(seqs), [False] * len(seqs)
    alive = list(range(len(seqs)))
    while alive:
        for b in alive:
            broken[b] = not finite[offsets[b] + 1 + node[b]]  # (the root's row: offsets[b], node -1)
        alive = [b for b in alive if not broken[b]]
        if not alive:
            break
        rows = torch.tensor([offsets[b] + 1 + node[b] for b in alive], device=logits.device)
        probs = warp_probs(logits[rows], [seqs[b].params for b in alive])  # [A, V]
        best = gumbel_max(probs, [seqs[b].key for b in alive], [len(seqs[b]) + len(paths[b]) for b in alive])
        still = []
        for b, token in zip(alive, best.tolist()):
            child = next((c for c in children[b][node[b] + 1] if trees[b].tokens[c] == token), None)
            if child is None:
                finals[b] = token
            else:
                paths[b].append(child)
                node[b] = child
                still.append(b)
        alive = still
    return [(path, [], bad) for path, bad in zip(paths, broken)], finals


def greedy_walk(tree: DraftTree, best: list[int], finite: list[int]) -> tuple[list[int], list[int], bool]:
    """Temperature 0: follow the child that is the target's argmax (best[0] at the root, best[1 + i]
    after node i). Returns (path, rejected tokens at its end (unused), whether it met a non-finite row)."""
    children, path, node = tree.children(), [], -1
    while True:
        if not finite[node + 1]:
            return path, [], True
        nxt = next((c for c in children[node + 1] if tree.tokens[c] == best[node + 1]), None)
        if nxt is None:
            return path, [], False
        path.append(nxt)
        node = nxt


def sample_walks(logits: torch.Tensor, seqs: list[Sequence], trees: list[DraftTree], offsets: list[int],
                 finite: list[bool]) -> tuple[list[tuple[list[int], list[int], bool]], list[int]]:
    """The sampled walk of every sequence (module docstring, step 3) on the logits [R, V]. A walk
    tests children against their parent's row only, so just the rows with children (the roots
    and the inner nodes) are warped first: one host copy of p_parent(node) for every node and of
    each such row's total. A leaf's row is warped only where a walk ends on it (on a CPU,
    warping a row costs about as much as a drafter's matmul); the final tokens are sampled on
    the device from the residual of the row where each walk ended."""
    params = [s.params for s, t in zip(seqs, trees) for _ in range(len(t) + 1)]
    edges = [offsets[b] + 1 + p for b, t in enumerate(trees) for p in t.parents]  # row of each node's parent
    tokens = [x for t in trees for x in t.tokens]
    device = logits.device
    inner = sorted(set(edges))  # the rows with children
    index = {row: i for i, row in enumerate(inner)}
    probs = warp_rows(logits, inner, params, finite)  # [I, V]
    tested = probs[torch.tensor([index[e] for e in edges], dtype=torch.int64, device=device),
                   torch.tensor(tokens, dtype=torch.int64, device=device)]
    host = torch.cat([tested.double(), probs.sum(-1, dtype=torch.float64)]).tolist()
    node_p, totals = host[: len(tokens)], [0.0] * len(params)  # totals: read at rows with children only
    for row, total in zip(inner, host[len(tokens):]):
        totals[row] = total
    walks, final_rows, node_base = [], [], 0
    for b, (s, t) in enumerate(zip(seqs, trees)):
        u = [uniform(s.key, len(s) - 1 + depth, Purpose.BRANCH, len(s), rank) for depth, rank in zip(t.depths(), sibling_ranks(t))]
        walk = walk_one(t, node_p[node_base : node_base + len(t)], totals[offsets[b] : offsets[b + 1]], u,
                        finite[offsets[b] : offsets[b + 1]])
        node_base += len(t)
        walks.append(walk)
        final_rows.append(offsets[b] + 1 + walk[0][-1] if walk[0] else offsets[b])
    leaves = sorted(set(final_rows) - set(index))  # walks that ended on a leaf: their rows too
    if leaves:
        index.update({row: len(index) + i for i, row in enumerate(leaves)})
        probs = torch.cat([probs, warp_rows(logits, leaves, params, finite)])
    final_probs = probs[torch.tensor([index[r] for r in final_rows], device=device)]  # [B, V] (a copy)
    residual = final_probs.clone()
    for b, (_, rejected, _) in enumerate(walks):
        if rejected:
            residual[b, torch.tensor(rejected, device=device)] = 0.0
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, final_probs)
    ends = [len(s) + len(path) for s, (path, _, _) in zip(seqs, walks)]  # the final token's position
    finals = sample(residual, uniforms([s.key for s in seqs], ends, Purpose.TOKEN, device)).tolist()
    return walks, finals


def sibling_ranks(tree: DraftTree) -> list[int]:
    """Each node's place among its parent's children, in drafted order (0 for the first)."""
    ranks = [0] * len(tree)
    for children in tree.children():
        for rank, node in enumerate(children):
            ranks[node] = rank
    return ranks


def warp_rows(logits: torch.Tensor, rows: list[int], params: list, finite: list[bool]) -> torch.Tensor:
    """warp_probs of the given rows of logits [R, V] -> [len(rows), V]; a non-finite row is
    zeroed first (kept in range: no walk uses its probabilities)."""
    picked = logits[torch.tensor(rows, dtype=torch.int64, device=logits.device)]  # [n, V]
    ok = torch.tensor([finite[r] for r in rows], dtype=torch.bool, device=logits.device)
    return warp_probs(torch.where(ok[:, None], picked, 0.0), [params[r] for r in rows])


def walk_one(tree: DraftTree, node_p: list[float], totals: list[float], u: list[float], finite: list[bool]
             ) -> tuple[list[int], list[int], bool]:
    """One sequence's sampled walk. node_p[i] = p_parent(i)(token i); totals[0] / totals[1 + i]:
    the mass of the root's / node i's row (1 up to rounding); u[i]: node i's uniform.
    Returns (path, the tokens rejected at its end, whether it met a non-finite row)."""
    children, path, node = tree.children(), [], -1
    while True:
        if not finite[node + 1]:
            return path, [], True
        mass, rejected = totals[node + 1], []
        accepted = None
        for c in children[node + 1]:
            p_c = 0.0 if tree.tokens[c] in rejected else node_p[c]
            if mass > 0 and u[c] < p_c / mass:
                accepted = c
                break
            rejected.append(tree.tokens[c])
            mass -= p_c
        if accepted is None:
            return path, rejected, False
        path.append(accepted)
        node = accepted


def move_path(target: ModelRunner, seqs: list[Sequence], lengths: list[int], paths: list[list[int]]) -> None:
    """The K/V of each accepted path to its sequence's next positions: node i sat at key index
    L + i (L = the sequence's length when verified); the path's j-th node goes to L + j. Nodes
    are in parents-first order, so a path's nodes only move down and never onto each other."""
    src, dst = [], []
    for s, L, path in zip(seqs, lengths, paths):
        if any(i != j for j, i in enumerate(path)):
            slots = s.target_table.slots(L, L + max(path) + 1)  # [key L .. the deepest moved node]
            src += [slots[i] for i in path]
            dst += [slots[j] for j in range(len(path))]
    target.cache.copy_slots(src, dst)
