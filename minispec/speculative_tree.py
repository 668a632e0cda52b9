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

The step on the device (`device_tree_step`: one upload, one download, as the chain's step in
speculative.py). The tree drafter searches on the device (drafters/tree.py `stage_trees`: the same
trees as its host search), or its trees ride up with the step (prompt lookup's chains, a search
with a confidence threshold, which stays on the host). The walk is sequential in depth, but what
it decides at a node depends only on that node's row and its children's uniforms, never on how the
walk got there: the test of child c_j at v is u_j < r(c_j) / mass_j with mass_0 = sum(p_v),
mass_{j+1} = mass_j - r(c_j), and r(c_j) = 0 for a token an earlier sibling had (it was
rejected). So the device decides, for EVERY node at once, which child the walk would accept there
(or none), subtracting the masses child by child in fp64 exactly as the host walk does in Python
floats, against the same keyed uniforms (u_j = finish(the BRANCH lanes of its position, spread(j)),
made on the device from lanes uploaded per depth: randomness.uniform's bits): next[v] = the first
accepted child of v, or -1 (-1 at a row that is not finite, where the walk stops, broken). Then
next is followed from the root: v_0 = root, v_{d+1} = next[v_d] while it is not -1, a fixed loop
of max-depth gathers with no host branch. Only the decisions at nodes the walk reaches are used,
and those are the host walk's decisions, so the path is the host walk's path. The final token is
drawn at the stopping node from its row with every child's token zeroed (all were rejected) by the
same inverse CDF and the same U(TOKEN) of position L + len(path) (uniforms for every possible
length are uploaded, the right one gathered): the host walk's token. Greedy and pathwise requests
take next[v] = the first child whose token is the target's argmax / Gumbel-max (noise from
uploaded NOISE lanes) at v's row, and the final token is that pick at the stopping node. Every row
is warped (the host walk warps only the rows it reads): a row's warp does not depend on the rows
beside it. The path's K/V then move on the device too (`move_path_on_device`: the source slots
gathered from the path, the destination slots known when the step was laid out), and the
drafter's features of the path are gathered there; one download brings the tokens, the path and
the trees back. The host step (`host_tree_step`) is the reference twin: requests with penalties,
min_tokens or logprobs take it, and on a CPU it is the default (no device to wait for, and it
warps fewer rows). tests/test_speculative_tree_device.py checks that the two give identical
decisions and tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .drafters.base import Drafter
from .drafters.tree import DraftTree, StagedTrees
from .pathwise import gumbel_max, lane_gumbel_max, noise_lanes
from .randomness import Purpose, finish, row_lanes, spread, uniform, uniforms
from .runtime.layout import Prepared
from .runtime.metrics import StepTimes
from .runtime.runner import DrawnTree, Feed, ModelRunner, TreeFeed
from .runtime.sequence import Sequence
from .runtime.transfers import Upload
from .sampling import WARP_DTYPES, WarpParams, finite_rows, penalize, sample, warp_probs
from .speculative import StepResult, emit_accepted, top_logprobs, verify_forward


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
    walk warps only the rows a walk reads. Requests with penalties, min_tokens or logprobs always
    take the host step (`walks_on_host`).
    Precondition (kept by the engine): seq.target_table.num_cached <= len(seq) - 1."""
    # 1. Draft: never deeper than the request may still emit (the final token is free).
    max_depth = [min(depth, s.remaining - 1) for s in seqs]
    if on_device is None:
        on_device = target.device.type != "cpu"
    if on_device and not any(walks_on_host(s) for s in seqs):
        return device_tree_step(seqs, target, drafter, max_depth, emit, times)
    with times.timing("draft_s", target.device):
        trees = drafter.propose_trees(seqs, max_depth)
    return host_tree_step(seqs, target, drafter, trees, emit, times)


def walks_on_host(seq: Sequence) -> bool:
    """Whether seq's tree must be walked on the host: its penalties and min_tokens change each
    node's row by the node's path (`penalized_tree`), its logprobs are read from the path's raw
    rows (`top_logprobs`); the device walk does neither."""
    return seq.params.adjusts_logits or seq.params.logprobs is not None


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


def tree_offsets(trees: list[DraftTree]) -> list[int]:
    """Each sequence's root row in the flat verification logits (node i: root row + 1 + i), and the total."""
    offsets = [0]
    for t in trees:
        offsets.append(offsets[-1] + len(t) + 1)
    return offsets


def first_rejected(tree: DraftTree, path: list[int]) -> list[int]:
    """What a step reports as drafted past its accepted path (for traces and stream events):
    the draft's first choice below the path's end, which the target rejected; none at a leaf."""
    children = tree.children()[path[-1] + 1 if path else 0]
    return [tree.tokens[children[0]]] if children else []


def tree_feed(s: Sequence, tree: DraftTree) -> Feed:
    """The verification feed of one sequence: its uncached tokens (the root last), then the nodes
    at key indices len(s) + i, positions len(s) - 1 + depth, with their ancestor masks."""
    prefix = s.tokens[s.target_table.num_cached :]
    if not tree.tokens:
        return Feed(s.target_table, prefix)
    cached, root = s.target_table.num_cached, len(s) - 1
    mask = TreeFeed(len(s), list(range(cached, len(s))) + [root + d for d in tree.depths()],
                    [0] * len(prefix) + tree.ancestor_bits())
    return Feed(s.target_table, prefix + tree.tokens, len(tree) + 1, mask)


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


# --- The walk on the device: one upload, one download ----------------------------------------


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


def device_tree_step(seqs: list[Sequence], target: ModelRunner, drafter: Drafter, max_depth: list[int],
                     emit: Callable[[Sequence, int], bool], times: StepTimes) -> list[StepResult]:
    """The four steps in one upload and one download (runtime/transfers.py). The host lays the
    step out (`lay_out_tree_step`) and ONE copy sends it; the device searches (`drafted_trees`),
    verifies, builds the walk's tables (`walk_tables`), walks (`walk_on_device`), moves the path's
    K/V (`move_path_on_device`) and gathers the drafter's features; ONE copy brings the tokens,
    the path and the trees back."""
    upload = Upload()
    with times.timing("draft_s", target.device):
        plan = lay_out_tree_step(seqs, target, drafter, max_depth, upload)
    sent = target.staging.send(upload)  # THE upload
    with times.timing("draft_s", target.device):
        tokens, parents, drawn, drawn_tree = drafted_trees(seqs, drafter, plan, sent)  # [B, N], [B, N], ...
    with times.verifying(seqs, target.device):
        layers, shape = drafter.target_layers, plan.shape
        out = target.run(plan.verification, drawn=drawn, drawn_tree=drawn_tree,
                         **({"hidden_layers": layers} if layers else {}))
        logits, hidden = out if layers else (out, None)  # [sum(N_b + 1), V], features or None
        warp = None
        if not all(s.params.greedy for s in seqs):
            rows = [s.params for s in seqs for _ in range(shape.nodes + 1)]
            sent_warp = {name: sent["tree.warp." + name] for name in WARP_DTYPES}
            warp = WarpParams.of(rows, target.vocab_size, None, sent_warp)
        tables = walk_tables(tokens, parents, sent, shape)
        walk = walk_on_device(logits, sent, tables, shape, warp)  # 3. Accept / reject
        move_path_on_device(target, sent, walk.path)  # 4. KV: needs nothing from the host
        if hidden is not None:
            hidden = hidden[observed_rows(sent, walk.path)]  # [sum(widths), F]
        emitted, num_accepted, path, broken, tree_tokens, tree_parents = target.staging.download(
            [walk.tokens, walk.num_accepted, walk.path, walk.broken.long(), tokens, parents])  # THE download
    trees = [plan.host_trees[b] if b in plan.host_trees else DraftTree(t[:n], p[:n])
             for b, (t, p, n) in enumerate(zip(tree_tokens, tree_parents, shape.sizes))]
    paths = [p[: n[0]] for p, n in zip(path, num_accepted)]
    failures = {b: plan.lengths[b] + n[0] for b, (n, x) in enumerate(zip(num_accepted, broken)) if x[0]}
    drafted = [[t.tokens[i] for i in p] for t, p in zip(trees, paths)]
    depths = [max(t.depths(), default=0) for t in trees]
    emit_accepted(seqs, emitted, [n[0] for n in num_accepted], depths, [None] * len(seqs), failures, emit)
    for s in seqs:
        s.target_table.truncate(len(s) - 1, target.cache.allocator)
    if hidden is not None:
        drafter.observe(seqs, plan.starts, shape.widths, hidden)
    drafter.rollback(seqs)
    return [StepResult(d + first_rejected(t, p), len(d), depth)
            for d, t, p, depth in zip(drafted, trees, paths, depths)]


@dataclass
class TreeStepPlan:
    """A device tree step laid out on the host (`lay_out_tree_step`): the drafter's staged search
    (None: every tree is the host's), the trees the host has (by batch row), the verification
    prepared, the walk's shape, and each sequence's cached count and length before the step."""

    staged: StagedTrees | None
    host_trees: dict[int, DraftTree]
    verification: Prepared
    shape: WalkShape
    starts: list[int]
    lengths: list[int]


def lay_out_tree_step(seqs: list[Sequence], target: ModelRunner, drafter: Drafter, max_depth: list[int],
                      upload: Upload) -> TreeStepPlan:
    """The host's half of `device_tree_step`, into `upload`: a tree drafter that searches on the
    device lays its forwards out (`stage_trees`, drafters/tree.py); one that proposes on the host
    (a confidence threshold; prompt lookup's chains, beside a device search or not) drafts now and
    its trees ride up. Then the verification (a device-drafted tree's nodes are drawn tokens with
    placeholder positions and mask rows, `placeholder_feed`) and what the walk needs that the
    host knows (`stage_walk`)."""
    staged = drafter.stage_trees(seqs, max_depth, upload)
    if staged is None:  # every tree is the host's
        host_trees = dict(enumerate(drafter.propose_trees(seqs, max_depth)))
        sizes = [len(host_trees[b]) for b in range(len(seqs))]
    else:  # the search's trees, and prompt lookup's chains in front of it (host data)
        host_trees, sizes = staged.host_trees, staged.sizes
    feeds = [tree_feed(s, host_trees[b]) if b in host_trees else placeholder_feed(s, sizes[b])
             for b, s in enumerate(seqs)]
    starts, lengths = [s.target_table.num_cached for s in seqs], [len(s) for s in seqs]
    verification = target.prepare(feeds, upload)  # (reserves the nodes' key slots)
    children = max([1] + [len(c) for t in host_trees.values() for c in t.children()])
    depth = max([1] + [max(t.depths(), default=0) for t in host_trees.values()])
    if staged is not None:
        children, depth = max(children, staged.width), max([depth] + staged.levels)
    shape = stage_walk(upload, seqs, feeds, sizes, target.vocab_size, children, depth, host_trees)
    return TreeStepPlan(staged, host_trees, verification, shape, starts, lengths)


def drafted_trees(seqs: list[Sequence], drafter: Drafter, plan: TreeStepPlan, sent: dict[str, torch.Tensor]
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, DrawnTree | None]:
    """The step's trees on the device, tokens and parents [B, N]: the host's from the upload, the
    device search's (`run_staged_trees`) in the other rows; and for the verification, the
    searched nodes as drawn tokens in feed order with their positions (the root's + depth) and
    mask rows (None, None where there are none)."""
    tokens, parents = sent["tree.tokens"], sent["tree.parents"]  # [B, N] the host's trees
    if plan.staged is None:
        return tokens, parents, None, None
    found = drafter.run_staged_trees(seqs, plan.staged, sent)
    from_host = sent["tree.from_host"][:, None]  # [B, 1]
    tokens = torch.where(from_host, tokens, found.tokens)
    parents = torch.where(from_host, parents, found.parents)
    nodes = sent["tree.node_index"]  # [sum sizes] each searched node's place in [B, N], in feed order
    if not len(nodes):
        return tokens, parents, None, None
    positions = sent["tree.node_root"] + found.depths.flatten()[nodes]
    return tokens, parents, tokens.flatten()[nodes], DrawnTree(positions, found.bits.flatten()[nodes])


def placeholder_feed(s: Sequence, n: int) -> Feed:
    """`tree_feed` for a tree of n nodes drafted on the device: the nodes are drawn tokens, each a
    child of the root until the device writes its position and mask row."""
    prefix = s.tokens[s.target_table.num_cached :]
    if n == 0:
        return Feed(s.target_table, prefix)
    mask = TreeFeed(len(s), list(range(s.target_table.num_cached, len(s))) + [len(s)] * n,
                    [0] * len(prefix) + [1 << i for i in range(n)])
    return Feed(s.target_table, prefix + [0] * n, n + 1, mask, drawn=n)


def stage_walk(upload: Upload, seqs: list[Sequence], feeds: list[Feed], sizes: list[int], vocab_size: int,
               children: int, depth: int, host_trees: dict[int, DraftTree]) -> WalkShape:
    """What the device walk needs that the host knows, into the step's upload, for B sequences of
    sizes[b] nodes (N = max(1, max sizes) slots, C = `children` child slots, D = `depth` levels:
    `WalkShape`): tree.rows [B, N+1], the flat logits row of each slot (padding: the root's);
    tree.key_slots [B, N] (node i's pool slot, key L + i, which is also where the path's i-th
    node goes) and tree.root_slot [B]; tree.keep_rows / tree.keep_path (`observed_rows`);
    tree.branch_lanes [B, D, 2], the BRANCH lanes of the positions L - 1 + d a node of depth d
    decides (keyed by the step), so that the device makes each child's U(BRANCH, .., its rank)
    (`walk_tables`); the host's trees (host_trees: by batch row) as tree.tokens and tree.parents
    [B, N] (-2: padding, and the rows of trees drafted on the device), tree.from_host [B]; for
    the trees drafted on the device, tree.node_index (each node's place in [B, N], in feed order)
    and tree.node_root (its root's position). Unless every request is greedy, each row's warp and
    tree.token_u [B, D+1] (U(TOKEN) at L + j, for a path of length j); with pathwise requests,
    tree.pathwise_rows [P] and tree.noise_lanes [P, D+1, 2] (the NOISE lanes of L + d)."""
    N, D = max(1, max(sizes)), depth
    greedy = all(s.params.greedy for s in seqs)
    offsets = [0]
    for n in sizes:
        offsets.append(offsets[-1] + n + 1)
    rows, key_slots, root_slot, keep_rows, keep_path, widths, fed_row = [], [], [], [], [], [], 0
    for b, (s, f, n) in enumerate(zip(seqs, feeds, sizes)):
        L = len(s)
        rows.append([offsets[b] + (v if v <= n else 0) for v in range(N + 1)])
        slots = s.target_table.slots(L - 1, L + n)  # the root's key L - 1, then node i's L + i
        key_slots.append(slots[1:] + [slots[0]] * (N - n))
        root_slot.append(slots[0])
        fed_prefix = len(f.tokens) - n  # the feed's rows: its prefix (the root last), then the nodes
        root_row = fed_row + fed_prefix - 1
        keep_rows += list(range(fed_row, root_row + 1)) + [root_row] * D
        keep_path += [-1] * fed_prefix + [b * D + j for j in range(D)]
        widths.append(fed_prefix + D)
        fed_row += len(f.tokens)
    upload.add("tree.rows", rows)  # [B, N+1]
    upload.add("tree.key_slots", key_slots)  # [B, N]
    upload.add("tree.root_slot", root_slot)  # [B]
    upload.add("tree.keep_rows", keep_rows)  # [sum widths]
    upload.add("tree.keep_path", keep_path)  # [sum widths]
    branch = [[row_lanes(s.key, len(s) - 1 + d, Purpose.BRANCH, len(s)) for d in range(1, D + 1)] for s in seqs]
    upload.add("tree.branch_lanes", branch)  # [B, D, 2]
    none = DraftTree()
    upload.add("tree.tokens", [host_trees.get(b, none).tokens + [0] * (N - len(host_trees.get(b, none)))
                               for b in range(len(seqs))])  # [B, N]
    upload.add("tree.parents", [host_trees.get(b, none).parents + [-2] * (N - len(host_trees.get(b, none)))
                                for b in range(len(seqs))])  # [B, N]
    upload.add("tree.from_host", [b in host_trees for b in range(len(seqs))], torch.bool)  # [B]
    drafted = [b for b, n in enumerate(sizes) if b not in host_trees]
    upload.add("tree.node_index", [b * N + i for b in drafted for i in range(sizes[b])])  # [sum sizes]
    upload.add("tree.node_root", [len(seqs[b]) - 1 for b in drafted for _ in range(sizes[b])])  # [sum sizes]
    if not greedy:
        row_params = [s.params for s in seqs for _ in range(N + 1)]
        for name, values in WarpParams.arrays(row_params, vocab_size).items():
            upload.add("tree.warp." + name, values, WARP_DTYPES[name])  # [B * (N+1)]
        token_u = [[uniform(s.key, len(s) + j, Purpose.TOKEN) for j in range(D + 1)] for s in seqs]
        upload.add("tree.token_u", token_u, torch.float64)  # [B, D+1]
        chosen = [b for b, s in enumerate(seqs) if s.pathwise]
        if chosen:
            upload.add("tree.pathwise_rows", chosen)  # [P]
            lanes = [noise_lanes([seqs[b].key] * (D + 1), [len(seqs[b]) + d for d in range(D + 1)]) for b in chosen]
            upload.add("tree.noise_lanes", lanes)  # [P, D+1, 2]
    return WalkShape(sizes, N, children, D, widths)


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
                   warp: WarpParams | None) -> DeviceWalk:
    """Step 3 for every sequence at once, on the device, with no host sync (the module docstring's
    "The walk on the device"): each node's accepted child first (`child_tests`, or
    `matching_child` for greedy and pathwise requests), then `follow` from the root for D
    iterations, then the final token at the node where the walk stopped (`final_draw`, or the
    target's pick there). logits [R, V] the flat verification rows; warp: each slot's row's warp,
    None when every request is greedy (the argmax, as `accept_tree`'s greedy walk)."""
    rows, children, child_tokens = sent["tree.rows"], tables.children, tables.child_tokens  # [B, N+1], [B, N+1, C]
    B, slots = rows.shape
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


def move_path_on_device(target: ModelRunner, sent: dict[str, torch.Tensor], path: torch.Tensor) -> None:
    """`move_path` from the device's path [B, D]: the path's j-th node's K/V (key L + path[j],
    slot tree.key_slots[path[j]]) to key L + j (slot tree.key_slots[j]); entries past the path
    copy the root's slot onto itself. Every source is read before any destination is written."""
    key_slots, root = sent["tree.key_slots"], sent["tree.root_slot"][:, None]  # [B, N], [B, 1]
    moved = path >= 0  # [B, D]
    src = torch.where(moved, key_slots.gather(1, path.clamp(min=0)), root)
    dst = torch.where(moved, key_slots[:, : path.shape[1]], root)
    target.cache.copy_slots(src.flatten(), dst.flatten())


def observed_rows(sent: dict[str, torch.Tensor], path: torch.Tensor) -> torch.Tensor:
    """The rows of the verification's features a drafter observes, [sum widths]: per sequence its
    fed prefix (the root last), then the root's row + 1 + path[j] for each level j (the root's row
    again past the path: positions the rollback drops, as a chain's rejected drafts are)."""
    which = sent["tree.keep_path"]  # [W] index into path.flatten(), -1 for a prefix row
    node = path.flatten()[which.clamp(min=0)]  # [W]
    return sent["tree.keep_rows"] + torch.where(which >= 0, node + 1, 0)
