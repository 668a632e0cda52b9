"""The tree step on the device: speculative_tree.py's four steps in one upload and one download
(runtime/transfers.py), as the chain's step in speculative.py.

The host lays the step out (`lay_out_tree_step`) and ONE copy sends it: the tree drafter's search
(drafters/tree_search_on_device.py: the same trees as its host search), or the trees the host
already has (prompt lookup's chains, a search with a confidence threshold where its head decides
stops on the host), which ride up with the step; the verification (tree_layout.py's feed, with placeholder
rows for the nodes the device will draft); and what the walk needs that the host knows
(`stage_walk`: each slot's row, the keyed lanes of the uniforms, each row's warp). The device then
searches, verifies, walks (tree_walk_on_device.py: the host walk's decisions, so the host walk's
tokens), moves the path's K/V (`move_path_on_device`: the source slots gathered from the path, the
destination slots known when the step was laid out; speculative_tree.py's `move_path`) and gathers
the drafter's features of the path (`observed_rows`); ONE copy brings the tokens, the path and the
trees back. Nothing here changes which token is emitted: the search, the walk and the move are
the host's, laid out for the device. Penalties, min_tokens and logprobs ride in the same upload
and download (tree_options_on_device.py: each row penalised with its sequence's counts and its
path, the path's raw rows' logprobs). The host step (speculative_tree.py `host_tree_step`) is
the reference twin; tests/test_speculative_tree_device.py and tests/test_tree_options_on_device.py
compare the two.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .drafters.base import Drafter
from .drafters.draft_tree import DraftTree
from .drafters.tree_search_on_device import StagedTrees
from .pathwise import noise_lanes
from .randomness import Purpose, row_lanes, uniform
from .penalties import Penalties
from .runtime.layout import Prepared
from .runtime.metrics import StepTimes
from .runtime.runner import DrawnTree, Feed, ModelRunner
from .runtime.sequence import Sequence
from .runtime.transfers import Upload
from .sampling import WARP_DTYPES, WarpParams
from .speculative import StepResult, emit_accepted, roll_back
from .tree_layout import first_rejected, placeholder_feed, tree_feed
from .tree_options_on_device import penalized_tree_on_device, stage_tree_options, tree_logprobs_on_device
from .tree_walk_on_device import WalkShape, walk_on_device, walk_tables
from .verification_options import host_logprobs


def device_tree_step(seqs: list[Sequence], target: ModelRunner, drafter: Drafter, max_depth: list[int],
                     emit: Callable[[Sequence, int], bool], times: StepTimes) -> list[StepResult]:
    """The four steps in one upload and one download (runtime/transfers.py). The host lays the
    step out (`lay_out_tree_step`) and ONE copy sends it; the device searches (`drafted_trees`),
    verifies, builds the walk's tables (`walk_tables`), walks (`walk_on_device`), moves the path's
    K/V (`move_path_on_device`) and gathers the drafter's features; ONE copy brings the tokens,
    the path and the trees back."""
    upload, V = Upload(), target.vocab_size
    new_tokens = stage_tree_options(upload, seqs, V)  # penalties (each one's new tokens), logprobs
    with times.timing("draft_s", target.device):
        plan = lay_out_tree_step(seqs, target, drafter, max_depth, upload)
    sent = target.staging.send(upload)  # THE upload
    penalties = Penalties.from_upload(seqs, sent, new_tokens, V)  # (the counts brought up to date first)
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
        adjust = None if penalties is None else functools.partial(
            penalized_tree_on_device, penalties=penalties, tokens=tokens, parents=parents,
            slot_depth=tables.slot_depth, depth=shape.depth)
        walk = walk_on_device(logits, sent, tables, shape, warp, adjust)  # 3. Accept / reject
        move_path_on_device(target, sent, walk.path)  # 4. KV: needs nothing from the host
        if hidden is not None:
            hidden = hidden[observed_rows(sent, walk.path)]  # [sum(widths), F]
        logprobs = []  # of the raw rows, as the host step's
        if "tree.logprob_rows" in sent:
            logprobs = tree_logprobs_on_device(logits, sent, walk.path, walk.tokens, seqs)
        emitted, num_accepted, path, broken, tree_tokens, tree_parents, *logprobs = target.staging.download(
            [walk.tokens, walk.num_accepted, walk.path, walk.broken.long(), tokens, parents,
             *logprobs])  # THE download
    trees = [plan.host_trees[b] if b in plan.host_trees else DraftTree(t[:n], p[:n])
             for b, (t, p, n) in enumerate(zip(tree_tokens, tree_parents, shape.sizes))]
    num_accepted = [n[0] for n in num_accepted]
    paths = [p[:n] for p, n in zip(path, num_accepted)]
    failures = {b: plan.lengths[b] + n for b, (n, x) in enumerate(zip(num_accepted, broken)) if x[0]}
    drafted = [[t.tokens[i] for i in p] for t, p in zip(trees, paths)]
    depths = [max(t.depths(), default=0) for t in trees]
    top = host_logprobs(seqs, logprobs, num_accepted)
    emit_accepted(seqs, emitted, num_accepted, depths, top, failures, emit)
    roll_back(seqs, target, drafter, plan.starts, shape.widths, hidden)
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
    (a confidence threshold on a CPU; prompt lookup's chains, beside a device search or not) drafts now and
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
