"""Tree speculation (speculative_tree.py, drafters/tree.py) is exact.

1. The rule, by exact enumeration of the real `walk_one`: its coins are scripted objects that
   record each acceptance threshold and branch both ways, so every outcome of one tree step is
   enumerated with its exact probability (each node's uniform may be compared once: a walk that
   reuses one, whose comparisons would not be independent, fails loudly). For every node v (the
   root included) and token x:
       P(the emitted tokens start with v's path, then x) = P_target(path to v) * p_v(x),
   which is the target's law for the step's emitted tokens (the next token after v is x with
   p_v(x), for every v the walk can reach). Checked for several tree shapes (repeated siblings
   included: nodes with the same path get the same row, as a real target gives them),
   temperatures, top-k and top-p, to float tolerance; four wrong rules are shown to fail the
   same check (power).
2. The whole pipeline, statistically: LLM.generate with trees grown by the EAGLE head and by a
   draft model, the chi-square harness of test_speculative_statistical.py (ALPHA = 1e-3,
   N = 2000 seeded requests, the same exact law by enumeration); planted mutants (the residual
   not updated after a rejected sibling, a node attending to non-ancestors, the accepted path's
   K/V left where the tree put them) are rejected at the same ALPHA, and the last two also by a
   deterministic greedy test whose every accepted path runs off the first branch.
3. Greedy: identical to plain decoding (fp32, hypothesis over prompts and tree shapes), and a
   seeded sampled request gives the same tokens alone and in a batch.
4. The tree mask in the attention kernel and its twin, against a float64 masked softmax.
5. Reliability: an interrupt anywhere in a tree step, and non-finite rows the walk never reaches
   (a request with non-finite logits among tree-drafted ones: test_reliability.py).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import minispec.speculative_tree
import minispec.tree_on_device
import minispec.tree_walk_on_device
from minispec import LLM, SamplingParams
from minispec.drafters.base import Drafter
from minispec.drafters.draft_tree import DraftTree
from minispec.randomness import Purpose, request_key, uniform
from minispec.runtime.layout import tree_layout
from minispec.runtime.runner import Feed, TreeFeed
from minispec.sampling import warp_probs
from minispec.speculative_tree import walk_one
import minispec.fast.attention_plans
import minispec.kernels.reference
from minispec.fast.attention_plans import paged_attention_cpu
from minispec.kernels.paged_attention import paged_attention, paged_attention_ref
from minispec.kernels.reference import visible_keys
from test_kernels import PagedBatch
from test_speculative_statistical import ALPHA, N, PROMPT, V, exact_distribution, models, pooled_chi_square, sample_counts  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_thread")
SP = SamplingParams


# --- 1. the rule, enumerated -----------------------------------------------------------------


class Coin:
    """A node's uniform whose comparison `coin < threshold` is scripted: it records the threshold
    and answers what the enumeration's tape (shared by the step's coins, one entry per comparison)
    says (False past the tape's end). Comparisons of different coins are independent; a second
    comparison of the same coin would not be, so it is refused."""

    def __init__(self, tape: list[bool], seen: list[float]):
        self.tape, self.seen, self.used = tape, seen, False

    def __lt__(self, threshold: float) -> bool:
        if self.used:
            raise AssertionError("a node's uniform was compared twice: the walk's tests are not independent")
        self.used = True
        i = len(self.seen)
        self.seen.append(float(threshold))
        return self.tape[i] if i < len(self.tape) else False


def enumerate_step(tree: DraftTree, probs: torch.Tensor, walk=walk_one) -> dict[tuple[int, ...], float]:
    """Every outcome of one tree step (the emitted tokens) with its exact probability.
    probs: [N + 1, V] fp64, row 0 the root's p, row 1 + i node i's."""
    node_p = [float(probs[p + 1, t]) for t, p in zip(tree.tokens, tree.parents)]
    totals = probs.sum(-1).tolist()
    law: dict[tuple[int, ...], float] = {}
    tapes = [[]]
    while tapes:
        tape = tapes.pop()
        seen: list[float] = []
        path, rejected, broken = walk(tree, node_p, totals, [Coin(tape, seen) for _ in tree.tokens], [True] * (len(tree) + 1))
        assert not broken
        tapes += [tape + [False] * (i - len(tape)) + [True] for i in range(len(tape), len(seen))]  # the other branches
        outcomes = tape + [False] * (len(seen) - len(tape))
        chance = math.prod(min(max(t, 0.0), 1.0) if o else 1 - min(max(t, 0.0), 1.0) for t, o in zip(seen, outcomes))
        residual = probs[path[-1] + 1 if path else 0].clone()
        residual[rejected] = 0.0
        for x in range(probs.shape[1]):
            if residual[x] > 0:
                key = tuple(tree.tokens[i] for i in path) + (x,)
                law[key] = law.get(key, 0.0) + chance * float(residual[x] / residual.sum())
    return law


def check_target_law(tree: DraftTree, probs: torch.Tensor, law: dict[tuple[int, ...], float]) -> float:
    """Largest |P(emit v's path, then x) - P_target(path v) p_v(x)| over the nodes v a walk can
    pass (not a sibling repeating an earlier sibling's token, whose path that sibling already
    takes, nor a node below one) and tokens x."""
    worst = 0.0
    passable = {-1}
    for i, parent in enumerate(tree.parents):  # parents first
        earlier = [c for c in tree.children()[parent + 1] if c < i]
        if parent in passable and all(tree.tokens[c] != tree.tokens[i] for c in earlier):
            passable.add(i)
    for node in sorted(passable):
        path = tree.path_tokens(node)
        chance = math.prod(float(probs[(tree.parents[i] + 1), tree.tokens[i]]) for i in ancestors(tree, node))
        for x in range(probs.shape[1]):
            got = sum(pr for out, pr in law.items() if list(out[: len(path)]) == path and len(out) > len(path)
                      and out[len(path)] == x)
            worst = max(worst, abs(got - chance * float(probs[node + 1, x])))
    return worst


def ancestors(tree: DraftTree, node: int) -> list[int]:
    out = []
    while node >= 0:
        out.append(node)
        node = tree.parents[node]
    return out[::-1]


def same_row_for_same_path(tree: DraftTree, probs: torch.Tensor) -> torch.Tensor:
    """probs with every node's row replaced by the first row of a node with the same path tokens
    (repeated siblings): a target's next-token law depends on the tokens before, not on the node."""
    first: dict[tuple[int, ...], int] = {}
    out = probs.clone()
    for i in range(len(tree)):
        out[i + 1] = out[first.setdefault(tuple(tree.path_tokens(i)), i) + 1]
    return out


TREES = {
    "chain": DraftTree([1, 2, 3], [-1, 0, 1]),
    "star": DraftTree([0, 1, 2, 3], [-1, -1, -1, -1]),
    "two levels": DraftTree([0, 1, 2, 0, 3, 1, 4], [-1, -1, 0, 0, 1, 1, 2]),
    "deep and wide": DraftTree([2, 0, 1, 3, 3, 4, 0, 1], [-1, -1, 0, 0, 1, 2, 2, 4]),
    "repeated siblings": DraftTree([1, 1, 2, 2, 0], [-1, -1, 0, 0, 1]),
}
WARPS = [SP(temperature=1.0), SP(temperature=0.6), SP(temperature=1.3, top_k=3), SP(temperature=0.9, top_p=0.8),
         SP(temperature=0.0)]


@pytest.mark.parametrize("params", WARPS, ids=lambda p: f"T{p.temperature}-k{p.top_k}-p{p.top_p}")
@pytest.mark.parametrize("name", list(TREES))
def test_one_tree_step_emits_the_target_law_exactly(name, params):
    tree = TREES[name]
    gen = torch.Generator().manual_seed(len(name))
    logits = 2.0 * torch.randn(len(tree) + 1, 5, generator=gen)  # V = 5: the target puts mass off the tree
    probs = warp_probs(logits, [params] * (len(tree) + 1)).double()
    probs = same_row_for_same_path(tree, probs / probs.sum(-1, keepdim=True))  # rows summing to 1 in fp64: 1e-9 can be asked
    law = enumerate_step(tree, probs)
    assert abs(sum(law.values()) - 1) < 1e-9
    assert check_target_law(tree, probs, law) < 1e-9


def residual_not_updated(tree, node_p, totals, u, finite):
    """Mutant: each sibling is tested against the full p (no renormalisation, rejected siblings
    keep their mass in the final draw)."""
    children, path, node = tree.children(), [], -1
    while True:
        nxt = next((c for c in children[node + 1] if u[c] < node_p[c] / totals[node + 1]), None)
        if nxt is None:
            return path, [], False
        path.append(nxt)
        node = nxt


def specinfer_with_q(q: torch.Tensor):
    """Mutant: SpecInfer's multi-draft rule with the draft's q (accept min(1, p/q), continue on
    norm((p - q)^+)), applied to deterministic top-k children at the root (a star tree)."""
    def walk(tree, node_p, totals, u, finite):
        p = torch.tensor(PROBS_FOR_MUTANT["p"], dtype=torch.float64)
        for c in tree.children()[0]:
            x = tree.tokens[c]
            if u[c] < min(1.0, float(p[x] / q[x])):
                return [c], [], False
            p = (p - q).clamp(min=0)
            p = p / p.sum()
        return [], [x for x in range(len(p)) if p[x] == 0], False
    return walk


PROBS_FOR_MUTANT: dict = {}


def one_uniform_per_level(tree, node_p, totals, u, finite):
    """Mutant: every sibling tested against the first child's uniform (the rule otherwise right)."""
    shared = [u[tree.children()[tree.parents[c] + 1][0]] for c in range(len(tree))]
    return walk_one(tree, node_p, totals, shared, finite)


def repeats_rejected_at_the_root_only(tree, node_p, totals, u, finite):
    """Mutant: a sibling repeating a rejected token is skipped (p 0) among the root's children only;
    below the root it is tested again with its full p."""
    children, path, node = tree.children(), [], -1
    while True:
        mass, rejected, accepted = totals[node + 1], [], None
        for c in children[node + 1]:
            p_c = 0.0 if node < 0 and tree.tokens[c] in rejected else node_p[c]
            if mass > 0 and u[c] < p_c / mass:
                accepted = c
                break
            rejected.append(tree.tokens[c])
            mass -= p_c
        if accepted is None:
            return path, rejected, False
        path.append(accepted)
        node = accepted


def test_a_reused_uniform_and_repeats_handled_at_the_root_only_fail_too():
    """Power, for the two gaps a review found: a walk testing siblings against one uniform (its
    tests are not independent; the enumeration used to count them as if they were, and passed
    it) and repeated siblings handled at the root only (only the first token's law was checked
    on repeated siblings, which it passes)."""
    tree = TREES["repeated siblings"]
    probs = warp_probs(2.0 * torch.randn(len(tree) + 1, 5, generator=torch.Generator().manual_seed(4)),
                       [SP(temperature=1.0)] * (len(tree) + 1)).double()
    probs = same_row_for_same_path(tree, probs / probs.sum(-1, keepdim=True))
    with pytest.raises(AssertionError, match="compared twice"):
        enumerate_step(TREES["star"], probs[:5], walk=one_uniform_per_level)
    wrong = enumerate_step(tree, probs, walk=repeats_rejected_at_the_root_only)
    first = [sum(pr for out, pr in wrong.items() if out[0] == x) for x in range(5)]
    torch.testing.assert_close(torch.tensor(first, dtype=torch.float64), probs[0], atol=1e-9, rtol=0)  # (the old check)
    assert check_target_law(tree, probs, wrong) > 0.01


def test_wrong_rules_fail_the_same_enumeration():
    """Power. TREES.md's case: p = (.5, .5), q = (.9, .1), children {a, b} fixed: SpecInfer's rule
    with q emits a with probability .556 (biased); ours .5. And a rule that does not update the
    residual after a rejected sibling misses the target law on a random tree."""
    star = DraftTree([0, 1], [-1, -1])
    p = torch.tensor([[0.5, 0.5], [0.5, 0.5], [0.5, 0.5]], dtype=torch.float64)
    def first(law):  # P(the first emitted token is a)
        return sum(pr for out, pr in law.items() if out[0] == 0)

    assert first(enumerate_step(star, p)) == pytest.approx(0.5, abs=1e-12)
    PROBS_FOR_MUTANT["p"] = [0.5, 0.5]
    biased = enumerate_step(star, p, walk=specinfer_with_q(torch.tensor([0.9, 0.1], dtype=torch.float64)))
    assert first(biased) == pytest.approx(5 / 9, abs=1e-9)  # .556, not .5

    tree = TREES["two levels"]
    probs = warp_probs(2.0 * torch.randn(len(tree) + 1, 5, generator=torch.Generator().manual_seed(3)),
                       [SP(temperature=1.0)] * (len(tree) + 1)).double()
    probs = probs / probs.sum(-1, keepdim=True)
    assert check_target_law(tree, probs, enumerate_step(tree, probs, walk=residual_not_updated)) > 0.01


@pytest.mark.parametrize("seed", range(8))
def test_sample_walks_follows_the_rule_draw_by_draw(seed):
    """The batched sampled walk against the rule written out here: node c, the j-th child of its
    parent, is tested with its request's keyed uniform U(BRANCH, its position, the step, j)
    (randomness.py), u_c < p_parent(token_c) / (the parent's mass left after the siblings rejected
    before it; 0 for a token already rejected there), then U(TOKEN) of the final position draws
    the final token from the residual of the row where the walk ended; each request's draws are
    keyed by its own seed only. (The enumeration above checks walk_one's law; this checks that
    sample_walks feeds it the right uniforms and rows.)"""
    from minispec.runtime.sequence import Sequence
    from minispec.speculative_tree import sample_walks

    gen = torch.Generator().manual_seed(seed)
    B, V = 3, 5
    trees, params = [], []
    for b in range(B):
        n = int(torch.randint(0, 7, (), generator=gen))
        parents = [int(torch.randint(-1, i, (), generator=gen)) for i in range(n)]  # parents first
        trees.append(DraftTree(torch.randint(0, V, (n,), generator=gen).tolist(), parents))
        params.append(WARPS[(seed + b) % len(WARPS)])
    offsets = [0]
    for t in trees:
        offsets.append(offsets[-1] + len(t) + 1)
    logits = 2.0 * torch.randn(offsets[-1], V, generator=gen)
    seqs = [Sequence(b, [1, 2], dataclasses.replace(p, seed=100 * seed + b), 16) for b, p in enumerate(params)]
    walks, finals = sample_walks(logits, seqs, trees, offsets, [True] * offsets[-1])
    for b, (t, p) in enumerate(zip(trees, params)):
        key, L = request_key(100 * seed + b), 2  # the sequence [1, 2]: its tree's children decide position 2 on
        rank = [[c for c, q in enumerate(t.parents) if q == t.parents[i]].index(i) for i in range(len(t))]
        u = [uniform(key, L - 1 + d, Purpose.BRANCH, L, r) for d, r in zip(t.depths(), rank)]
        probs = warp_probs(logits[offsets[b] : offsets[b + 1]], [p] * (len(t) + 1)).double()  # row 0 the root's
        path, node = [], -1
        while True:
            row, mass, rejected, nxt = probs[node + 1], float(probs[node + 1].sum()), [], None
            for c in [c for c, q in enumerate(t.parents) if q == node]:
                p_c = 0.0 if t.tokens[c] in rejected else float(row[t.tokens[c]])
                if mass > 0 and u[c] < p_c / mass:
                    nxt = c
                    break
                rejected.append(t.tokens[c])
                mass -= p_c
            if nxt is None:
                break
            path.append(nxt)
            node = nxt
        residual = row.clone()
        residual[rejected] = 0.0
        residual = residual if residual.sum() > 0 else row
        cdf = residual.cumsum(-1)
        u_final = torch.tensor([uniform(key, L + len(path), Purpose.TOKEN)], dtype=torch.float64)
        final = int(torch.searchsorted(cdf, u_final * cdf[-1:], right=True))
        assert (walks[b][0], walks[b][1], finals[b]) == (path, rejected, final), b


def test_greedy_walk_is_the_sampled_walk_at_temperature_zero():
    tree = TREES["deep and wide"]
    logits = torch.randn(len(tree) + 1, 5, generator=torch.Generator().manual_seed(1))
    probs = warp_probs(logits, [SP(temperature=0.0)] * (len(tree) + 1)).double()
    law = enumerate_step(tree, probs)
    (outcome,) = [o for o, pr in law.items() if pr > 0]
    best = logits.argmax(-1).tolist()
    path, _, _ = minispec.speculative_tree.greedy_walk(tree, best, [1] * (len(tree) + 1))
    assert outcome == tuple(tree.tokens[i] for i in path) + (best[path[-1] + 1 if path else 0],)


def test_draft_tree_helpers():
    t = TREES["two levels"]  # root -> 0 (-> 2, 3), 1 (-> 4, 5); 2 -> 6
    assert t.depths() == [1, 1, 2, 2, 2, 2, 3]
    assert t.ancestor_bits()[6] == (1 << 6) | (1 << 2) | (1 << 0)
    assert t.children()[0] == [0, 1] and t.children()[3] == [6]
    assert t.path_tokens(6) == [0, 2, 4] and t.path_tokens(-1) == []
    assert DraftTree.chain([7, 8]).parents == [-1, 0]


def test_a_tree_feed_must_put_its_nodes_where_the_window_assumes():
    """The kernels measure a sliding window from a node's position = its block's start - 1 + its
    depth (its bits set); the runner refuses a tree feed that says otherwise, naming the key."""
    def layout(positions):
        feed = Feed(None, [1, 2, 3, 4], 4, TreeFeed(6, positions, [0, 1, 2, 6]))  # [root, n0, n1, n1's child]
        return tree_layout([feed], np.array([9]), np.array([0, 4]), np.zeros(4, dtype=np.int64))

    assert layout([5, 6, 6, 7])[1].tolist() == [0, 1, 2, 6]
    with pytest.raises(ValueError, match="token at key 8 has position 8"):
        layout([5, 6, 6, 8])
    with pytest.raises(ValueError, match="token at key 5 has position 4"):
        layout([4, 6, 6, 7])


# --- 2. the whole pipeline, statistically ---------------------------------------------------

TREE_CASES = [
    # (drafter, depth, budget, top_k, params, m): the head drafts from the second step on
    ("eagle-tree", 2, 4, 2, SP(temperature=0.6), 4),  # the mutants below run here
    ("eagle-tree", 3, 8, 4, SP(temperature=1.0, top_k=5, top_p=0.95), 5),
    ("eagle-tree", 3, 6, 3, SP(temperature=1.0, repetition_penalty=1.5, frequency_penalty=0.7), 4),
    ("eagle-tree", 4, 5, 1, SP(temperature=1.3), 5),  # top_k 1: a chain, verified by the tree rule
    ("eagle-tree+lookup", 3, 6, 2, SP(temperature=1.0, top_k=5, top_p=0.95), 5),
    ("near-tree", 3, 8, 2, SP(temperature=0.6), 5),  # a draft model grows the tree; the mutants run here too
    ("near-tree", 2, 5, 2, SP(temperature=1.0, top_k=4, presence_penalty=0.8), 3),
]


def tree_p_value(models, drafter, depth, budget, top_k, params, m, **options) -> tuple[float, LLM]:
    draft = (models["near"], models["tok"]) if drafter.startswith("near") else models["eagle"]
    counts, llm = sample_counts(models["target"], draft, depth, params, m, models["tok"],
                                lookup=2 if drafter.endswith("+lookup") else None, kv_cache_gib=0.05,
                                draft_tree_budget=budget, draft_tree_top_k=top_k, **options)
    pval, stat, df = pooled_chi_square(counts, exact_distribution(models["target"], params, m))
    metrics = llm.last_metrics
    print(f"\n{drafter} depth={depth} budget={budget} top_k={top_k} m={m} {params}: chi2={stat:.1f} df={df} "
          f"p={pval:.3g} tokens/step={metrics.num_generated / metrics.num_steps:.2f}")
    return pval, llm


@pytest.mark.parametrize("case", TREE_CASES, ids=[f"{c[0]}-d{c[1]}-n{c[2]}-k{c[3]}-T{c[4].temperature}" for c in TREE_CASES])
def test_tree_drafting_keeps_the_target_distribution(models, case):
    pval, llm = tree_p_value(models, *case)
    assert pval > ALPHA
    assert llm.last_metrics.num_accepted > 0.3 * N  # the tree's paths are really taken


def no_residual_update(monkeypatch):
    """In the host walk and in the device walk (where the target runs on a GPU)."""
    monkeypatch.setattr(minispec.speculative_tree, "walk_one", residual_not_updated)
    monkeypatch.setattr(minispec.tree_walk_on_device, "child_tests", full_mass_child_tests)


def full_mass_child_tests(probs, children, child_tokens, repeat, branch_u):
    """The device walk's `child_tests` with residual_not_updated's mistake: every child tested
    against the full mass of its parent's row."""
    tested = torch.where(children >= 0, probs.gather(-1, child_tokens).double(), 0.0)
    mass = probs.sum(-1, dtype=torch.float64)
    accepted = torch.full_like(children[..., 0], -1)
    for j in range(children.shape[-1]):
        hit = (children[..., j] >= 0) & (accepted < 0) & (branch_u[..., j] < tested[..., j] / mass)
        accepted = torch.where(hit, children[..., j], accepted)
    return accepted


def non_ancestor_attention(monkeypatch):
    """Each node sees every earlier node (a causal mask over the tree), not only its ancestors."""
    def causal(query, key, sliding_window, bits=None, start=None):
        return visible_keys(query, key, sliding_window)

    for module in (minispec.fast.attention_plans, minispec.kernels.reference):  # the torch backend's mask
        monkeypatch.setattr(module, "visible_keys", causal)


def path_kv_not_moved(monkeypatch):
    monkeypatch.setattr(minispec.speculative_tree, "move_path", lambda *args: None)
    monkeypatch.setattr(minispec.tree_on_device, "move_path_on_device", lambda *args: None)


TREE_MUTANTS = [("eagle-tree", no_residual_update), ("near-tree", no_residual_update),
                ("near-tree", non_ancestor_attention), ("near-tree", path_kv_not_moved)]


@pytest.mark.parametrize("drafter,mutant", TREE_MUTANTS, ids=[f"{d}-{m.__name__}" for d, m in TREE_MUTANTS])
def test_statistic_rejects_planted_tree_bugs(models, monkeypatch, drafter, mutant):
    """Power: each mutant is REJECTED (p < ALPHA) in a configuration the real code passes. The
    attention-side mutants need the draft model's trees, whose paths often run off the first
    branch (with the random head's, p = 0.05-0.7 when tried: few accepted paths leave it)."""
    case = next(c for c in TREE_CASES if c[0] == drafter)
    mutant(monkeypatch)
    pval, _ = tree_p_value(models, *case)
    assert pval < ALPHA


GREEDY_PROMPTS = [[1, 2, 3, 1, 2], [0], [5, 4, 3, 2, 1, 0], [2, 2, 2], [3, 0, 4, 1], [1, 5, 1, 5, 1]]


class OffBranchTrees(Drafter):
    """A stub tree drafter that knows the greedy answer `answer`: each step its tree puts a wrong
    sibling FIRST at every level and the right token second, so every accepted path runs off the
    first branch (its nodes sit at key indices 1, 3, 5, ... and must move to 0, 1, 2, ...)."""

    drafts_trees = True

    def __init__(self, answer: list[int], vocab: int):
        self.answer, self.vocab = answer, vocab

    def tree_slots(self, depth: int) -> int:
        return 2 * depth

    def propose_trees(self, seqs, max_depth):
        trees = []
        for s, depth in zip(seqs, max_depth):
            done, tokens, parents, parent = len(s.output_ids), [], [], -1
            for d in range(min(depth, len(self.answer) - done)):
                right = self.answer[done + d]
                tokens += [(right + 1) % self.vocab, right]
                parents += [parent, parent]
                parent = len(tokens) - 1
            trees.append(DraftTree(tokens, parents))
        return trees


def off_branch_run(tiny_llama, backend: str = "torch"):
    """Greedy with logprobs, plain and with OffBranchTrees (depth 3), on `backend`: the two
    outputs and the tree run's metrics."""
    params = SP(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2)
    prompt = [5, 17, 3, 99, 42]
    plain = LLM(model=str(tiny_llama), dtype="float32", device="cpu", backend=backend, kv_cache_gib=0.01, page_size=4)
    want = plain.generate([prompt], params)[0]
    llm = LLM(model=str(tiny_llama), dtype="float32", device="cpu", backend=backend, kv_cache_gib=0.01, page_size=4)
    engine = llm.engine
    engine.drafter, engine.k = OffBranchTrees(want.token_ids, engine.target.model.cfg.vocab_size), 3
    engine.scheduler.extra_slots = engine.drafter.tree_slots(3)
    got = llm.generate([prompt], params)[0]
    return want, got, llm.last_metrics


@pytest.mark.parametrize("target", [("llama", {}), ("mistral", {"sliding_window": 4})], ids=["llama", "window4"])
@pytest.mark.parametrize("backend", ["torch", "invariant"])
def test_off_branch_paths_are_exact_and_their_kv_moves(checkpoint_factory, backend, target):
    """Every step accepts a path off the first branch: the tokens and their logprobs equal plain
    decoding's (each node's row saw exactly its ancestors; the next step read the moved K/V), on
    the torch backend and on the batch-invariant one (what int8 models use). Also for a Mistral
    with a 4-token sliding window, which must measure a node's distance from its position (its
    root's plus its depth), not from its key index (node i sits at key root + 1 + i)."""
    arch, overrides = target
    want, got, metrics = off_branch_run(checkpoint_factory(arch, seed=0, **overrides), backend)
    assert got.token_ids == want.token_ids
    assert metrics.num_accepted >= 6  # paths of several nodes were taken
    for a, b in zip(want.outputs[0].logprobs, got.outputs[0].logprobs):
        assert a.keys() == b.keys()
        assert all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a)


@pytest.mark.parametrize("mutant", [non_ancestor_attention, path_kv_not_moved], ids=lambda f: f.__name__)
def test_planted_mask_and_kv_bugs_change_the_output(tiny_llama, monkeypatch, mutant):
    """Power for the attention side, deterministically and on a multi-layer target: a node
    attending to non-ancestors, or the accepted path's K/V left where the tree put them, change
    the tokens or their logprobs of greedy decoding."""
    mutant(monkeypatch)
    want, got, _ = off_branch_run(tiny_llama)
    same_logprobs = all(a.keys() == b.keys() and all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a)
                        for a, b in zip(want.outputs[0].logprobs, got.outputs[0].logprobs))
    assert got.token_ids != want.token_ids or not same_logprobs


# --- 3. greedy identity and batch invariance ----------------------------------------------------


@settings(max_examples=10, deadline=None)
@given(prompt=st.lists(st.integers(0, V - 1), min_size=1, max_size=8), depth=st.integers(1, 5),
       budget=st.integers(1, 20), top_k=st.integers(1, 4), drafter=st.sampled_from(["eagle", "near"]),
       threshold=st.sampled_from([None, 0.2, 0.6]))
def test_greedy_tree_decoding_equals_plain_decoding(models, prompt, depth, budget, top_k, drafter, threshold):
    params = SP(temperature=0, max_tokens=12, ignore_eos=True)
    model = (models["target"], models["tok"])
    plain = LLM(model=model, kv_cache_gib=0.01, page_size=4).generate([prompt], params)[0].token_ids
    top_k = min(top_k, 63 // max(depth - 1, 1))
    draft = (models["near"], models["tok"]) if drafter == "near" else models["eagle"]
    llm = LLM(model=model, draft_model=draft, num_speculative_tokens=depth, draft_tree_budget=budget,
              draft_tree_top_k=top_k, draft_confidence_threshold=threshold, kv_cache_gib=0.01, page_size=4)
    assert llm.generate([prompt], params)[0].token_ids == plain


@pytest.mark.parametrize("drafter", ["eagle", "near"])
def test_a_confidence_threshold_stops_growing_unlikely_trees(models, monkeypatch, drafter):
    """With draft_confidence_threshold a tree grows past a level only where that level's likeliest
    node has path probability >= the threshold: fewer drafter forwards, plain decoding's greedy
    tokens, and (a tree still fixed before the target's coins) the target's law."""
    from minispec.drafters.tree import TreeDrafter

    model, params = (models["target"], models["tok"]), SP(temperature=0, max_tokens=16, ignore_eos=True)
    plain = [o.token_ids for o in LLM(model=model, kv_cache_gib=0.01, page_size=4).generate(GREEDY_PROMPTS, params)]
    draft = (models["near"], models["tok"]) if drafter == "near" else models["eagle"]
    levels, scores = [], []  # per propose_trees call: levels grown, best level-1 node's probability
    expand = TreeDrafter.expand

    def recording_expand(self, found, expanding, logits):
        made = expand(self, found, expanding, logits)
        if expanding and expanding[0][1] == -1:  # level 1
            levels.append(0)
            scores.append(max((math.exp(c.score) for c in found[expanding[0][0]]), default=0.0))
        if made:
            levels[-1] += 1
        return made

    monkeypatch.setattr(TreeDrafter, "expand", recording_expand)
    forwards = {}
    for threshold in (None, 0.5):
        levels.clear(), scores.clear()
        llm = LLM(model=model, draft_model=draft, num_speculative_tokens=4, draft_tree_budget=8, draft_tree_top_k=2,
                  draft_confidence_threshold=threshold, kv_cache_gib=0.01, page_size=4, max_num_seqs=1)
        assert [o.token_ids for o in llm.generate(GREEDY_PROMPTS, params)] == plain
        forwards[threshold] = sum(levels)
        if threshold is not None:  # a level-1 node below the threshold: the tree stopped there
            assert all(n == 1 for n, p in zip(levels, scores) if p < threshold)
            assert any(n > 1 for n, p in zip(levels, scores) if p >= threshold)
    assert 0 < forwards[0.5] < forwards[None]
    batched = LLM(model=model, draft_model=draft, num_speculative_tokens=4, draft_tree_budget=8, draft_tree_top_k=2,
                  draft_confidence_threshold=0.5, kv_cache_gib=0.01, page_size=4)  # trees stop at different levels per sequence
    assert [o.token_ids for o in batched.generate(GREEDY_PROMPTS, params)] == plain
    pval, llm = tree_p_value(models, f"{drafter}-tree", 3, 6, 3, SP(temperature=1.0, top_p=0.95), 4,
                             draft_confidence_threshold=0.3)
    assert pval > ALPHA and llm.last_metrics.num_accepted > 0.3 * N


def test_a_tree_of_top_k_one_is_the_chain(models):
    """top_k 1: each level's one child is the head's argmax, which is the greedy chain's draft; the
    same drafts are accepted step for step (the tree search adds nothing and loses nothing)."""
    model, params = (models["target"], models["tok"]), SP(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = GREEDY_PROMPTS
    chain = LLM(model=model, draft_model=models["eagle"], num_speculative_tokens=3, kv_cache_gib=0.01, page_size=4)
    tree = LLM(model=model, draft_model=models["eagle"], num_speculative_tokens=3, draft_tree_budget=3,
               draft_tree_top_k=1, kv_cache_gib=0.01, page_size=4)
    assert [o.token_ids for o in tree.generate(prompts, params)] == [o.token_ids for o in chain.generate(prompts, params)]
    a, b = chain.last_metrics, tree.last_metrics
    assert (a.num_steps, a.num_accepted, a.num_drafted) == (b.num_steps, b.num_accepted, b.num_drafted)
    assert a.num_accepted > 0


def test_a_seeded_request_gives_the_same_tokens_alone_and_in_a_batch(models):
    llm = LLM(model=(models["target"], models["tok"]), draft_model=models["eagle"], num_speculative_tokens=3,
              draft_tree_budget=8, draft_tree_top_k=3, kv_cache_gib=0.01, page_size=4)
    params = SP(temperature=0.9, top_p=0.95, max_tokens=16, ignore_eos=True, seed=7)
    alone = llm.generate([PROMPT], params)[0].token_ids
    others = [dataclasses.replace(params, seed=s) for s in range(5)]
    batch = llm.generate([[3, 1], PROMPT, [5, 5, 2], [0], [1, 2, 3, 4]], [others[0], params, *others[2:]])
    assert batch[1].token_ids == alone
    assert llm.last_metrics.num_accepted > 0


def test_static_shapes_preemption_streaming_and_stop_strings_with_trees(models):
    """A tree verification is a static shape (the node budget): with static_shapes the tree steps
    run the static path and give plain decoding's tokens; so do a KV pool small enough to preempt
    and recompute sequences mid-answer, streaming, and a stop string."""
    model = (models["target"], models["tok"])
    params = SP(temperature=0, max_tokens=20, ignore_eos=True)
    prompts = [PROMPT, [0, 1], [4, 4, 4, 4], [2, 5, 3], [1], [3, 3, 0, 1, 2]]
    plain = [o.token_ids for o in LLM(model=model, kv_cache_gib=0.01, page_size=4).generate(prompts, params)]
    tree = dict(draft_model=models["eagle"], num_speculative_tokens=3, draft_tree_budget=6, draft_tree_top_k=3)
    static = LLM(model=model, kv_cache_gib=0.01, page_size=4, static_shapes=True, **tree)
    assert [o.token_ids for o in static.generate(prompts, params)] == plain
    counts = static.engine.target.forward_counts
    assert counts["static"] > 0 and counts["dynamic"] == 0  # tree verifications (and these short prompts) all static
    small = LLM(model=model, page_size=4, kv_cache_gib=22 * 512 / 2**30, max_num_seqs=6, **tree)  # ~10 pages of 512 bytes a pool
    assert [o.token_ids for o in small.generate(prompts, params)] == plain
    assert small.last_metrics.num_preemptions > 0
    streamed = {}
    for e in LLM(model=model, kv_cache_gib=0.01, page_size=4, **tree).stream(prompts, params):
        streamed.setdefault(e.index, []).extend(e.new_token_ids)
    assert [streamed[i] for i in range(len(prompts))] == plain  # streaming: the same tokens, step by step
    text = models["tok"].decode(plain[0])
    stop = text.split()[3]
    out = LLM(model=model, kv_cache_gib=0.01, page_size=4, **tree).generate([PROMPT], SP(temperature=0, max_tokens=20, stop=[stop]))[0]
    ref = LLM(model=model, kv_cache_gib=0.01, page_size=4).generate([PROMPT], SP(temperature=0, max_tokens=20, stop=[stop]))[0]
    assert (out.text, out.token_ids, out.outputs[0].finish_reason) == (ref.text, ref.token_ids, "stop")


def test_a_tree_at_the_end_of_the_context(models):
    """A sequence that fills the model's context: its last steps' trees reach key slots past the
    context (never positions past it), with static shapes sized for the context and one sequence."""
    model = (models["target"], models["tok"])
    params = SP(temperature=0, max_tokens=64 - len(PROMPT), ignore_eos=True)  # prompt + answer = the context (64)
    plain = LLM(model=model, kv_cache_gib=0.01, page_size=4).generate([PROMPT], params)[0].token_ids
    for static in (False, True):
        llm = LLM(model=model, draft_model=models["eagle"], num_speculative_tokens=4, draft_tree_budget=12,
                  draft_tree_top_k=3, kv_cache_gib=0.01, page_size=4, max_num_seqs=1, static_shapes=static)
        assert llm.generate([PROMPT], params)[0].token_ids == plain


def test_the_server_names_a_tree_drafter(models):
    from minispec.server.metrics import drafter_name

    config = {"method": "eagle3", "model": models["eagle"], "num_speculative_tokens": 3, "tree_budget": 8, "tree_top_k": 2,
              "prompt_lookup_min": 2}
    llm = LLM(model=(models["target"], models["tok"]), speculative_config=config, kv_cache_gib=0.01)
    assert drafter_name(llm.engine.drafter) == "prompt lookup, then the EAGLE-3 head, trees of 8 nodes"
    assert (llm.engine.drafter.model_drafter.budget, llm.engine.drafter.model_drafter.top_k) == (8, 2)


def test_tree_options_are_checked_by_name(models):
    model = (models["target"], models["tok"])
    with pytest.raises(ValueError, match="draft_tree_budget must be"):
        LLM(model=model, draft_model=models["eagle"], num_speculative_tokens=2, draft_tree_budget=64)
    with pytest.raises(ValueError, match="needs a draft model or an EAGLE-3 head"):
        LLM(model=model, draft_model="ngram", num_speculative_tokens=2, draft_tree_budget=8)
    with pytest.raises(ValueError, match="at most 63 fit"):
        LLM(model=model, draft_model=models["eagle"], num_speculative_tokens=6, draft_tree_budget=8, draft_tree_top_k=16)
    with pytest.raises(ValueError, match="draft_confidence_threshold must be in"):
        LLM(model=model, draft_model=models["eagle"], num_speculative_tokens=2, draft_tree_budget=8,
            draft_confidence_threshold=1.0)
    with pytest.raises(ValueError, match="disagrees"):
        LLM(model=model, speculative_config={"method": "eagle3", "model": models["eagle"], "tree_budget": 8},
            draft_tree_budget=4)


# --- 4. the tree mask in the kernel and its twin ------------------------------------------------


@settings(max_examples=12, deadline=None)
@given(data=st.data(), page_size=st.sampled_from([1, 4, 16]), group=st.sampled_from([1, 2, 4]),
       seed=st.integers(0, 2**31 - 1))
def test_tree_mask_in_kernel_twin_and_cpu_plan_matches_a_float64_masked_softmax(data, page_size, group, seed):
    """Sequences with and without a tree in one launch: a node sees the prefix and its ancestors,
    and a sliding window measures positions (a node's is its root's plus its depth), not keys."""
    B = data.draw(st.integers(1, 3))
    window = data.draw(st.sampled_from([None, 1, 2, 3, 5, 64]))
    trees, prefixes, q_lens = [], [], []
    for _ in range(B):
        n = data.draw(st.integers(0, 20))
        parents = [data.draw(st.integers(-1, i - 1)) for i in range(n)]
        trees.append(DraftTree([0] * n, parents))
        prefixes.append(data.draw(st.integers(1, 12)))
        q_lens.append(data.draw(st.integers(1, prefixes[-1])) + n)
    seq_lens = [p + len(t) for p, t in zip(prefixes, trees)]
    batch = PagedBatch(seq_lens, q_lens, page_size=page_size, num_q_heads=2 * group, num_kv_heads=2, head_dim=16,
                       dtype=torch.float32, seed=seed)
    bits = [b for t, q in zip(trees, q_lens) for b in [0] * (q - len(t)) + t.ancestor_bits()]
    tree = dict(tree_start=torch.tensor(prefixes, dtype=torch.int32), tree_bits=torch.tensor(bits, dtype=torch.int64))
    out = paged_attention(*batch.args(), sm_scale=0.25, sliding_window=window, **tree, block_n=16)
    ref = paged_attention_ref(*batch.args(), sm_scale=0.25, sliding_window=window, **tree)
    cpu = paged_attention_cpu(*batch.args(), sm_scale=0.25, sliding_window=window, **tree)  # the torch backend's
    expected = []
    starts = batch.query_start_loc.tolist()
    for b, (t, q_len) in enumerate(zip(trees, q_lens)):
        k, v, L = batch.dense_k[b].double(), batch.dense_v[b].double(), seq_lens[b]
        start = prefixes[b]
        position = list(range(start)) + [start - 1 + d for d in t.depths()]  # of every key
        for r in range(q_len):
            row = L - q_len + r
            visible = [bool(j <= row and (j < start or (t.ancestor_bits()[row - start] >> (j - start)) & 1)
                            and (window is None or position[row] - position[j] < window))
                       for j in range(L)]
            keys = torch.tensor(visible)
            q = batch.q[starts[b] + r].double().view(2, group, 16)  # [Hkv, g, D]
            scores = torch.einsum("hgd,lhd->hgl", q, k) * 0.25
            weights = scores.masked_fill(~keys, float("-inf")).softmax(-1)
            expected.append(torch.einsum("hgl,lhd->hgd", weights, v).reshape(2 * group, 16))
    expected = torch.stack(expected)
    torch.testing.assert_close(ref.double(), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cpu.double(), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.double(), expected, atol=1e-4, rtol=1e-4)


# --- 5. reliability with trees: interrupts and non-finite logits ---------------------------------


@pytest.mark.parametrize("where", [("drafter", "propose_trees"), ("module", "accept_tree"), ("module", "move_path"),
                                   ("drafter", "rollback")], ids=lambda w: w[1])
def test_an_interrupted_tree_step_ends_every_request_and_leaves_the_llm_usable(tiny_llama, tiny_llama_eagle, where):
    """A KeyboardInterrupt at any point of a tree step: every request ends with "error", every page
    of both pools is free, and the next call equals an uninterrupted one."""
    from test_reliability import PROMPTS, generate_interrupted, idle_and_whole

    llm = LLM(model=str(tiny_llama), draft_model=str(tiny_llama_eagle), num_speculative_tokens=3, draft_tree_budget=6,
              draft_tree_top_k=3, kv_cache_gib=0.01, dtype="float32")
    params = SP(temperature=0.8, max_tokens=12, ignore_eos=True, seed=3)
    clean = [o.token_ids for o in llm.generate(PROMPTS, params)]
    owner = llm.engine.drafter if where[0] == "drafter" else minispec.speculative_tree
    name = where[1]
    if llm.engine.target.device.type != "cpu":  # (the search, the walk and the K/V move run on the device there)
        name = {"propose_trees": "run_staged_trees", "accept_tree": "walk_on_device",
                "move_path": "move_path_on_device"}.get(name, name)
        owner = owner if where[0] == "drafter" else minispec.tree_on_device  # (where the device step looks them up)
    generate_interrupted(llm, PROMPTS, params, owner, name, 3)  # the third call: mid-answer, after the head's first trees
    assert idle_and_whole(llm)
    assert [o.token_ids for o in llm.generate(PROMPTS, params)] == clean


class FixedTree(Drafter):
    """Always the same tree: two children of the root (9, then 11), 9 with a child 12."""

    drafts_trees = True

    def tree_slots(self, depth):
        return 3

    def propose_trees(self, seqs, max_depth):
        return [DraftTree([9, 11, 12], [-1, -1, 0]) for _ in seqs]


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_non_finite_node_rows_the_walk_never_reaches_change_nothing(temperature):
    """As for chains (test_reliability): a node's row is used only if the walk reaches the node.
    Every row past the root is NaN here. The root prefers 4: both children are rejected at the
    root's finite row, and the step emits 4 like plain decoding. The root prefers 9: 9 is accepted,
    the next token would come from its NaN row, so the request emits 9 and ends with "error"."""
    from test_reliability import ScriptedTarget

    from minispec.runtime.metrics import StepTimes
    from minispec.runtime.sequence import Sequence
    from minispec.speculative import StepResult
    from minispec.speculative_tree import tree_step

    def run(best: int):
        seq = Sequence(0, [1, 2, 3], SP(temperature=temperature, max_tokens=5, seed=0, ignore_eos=True), 16)
        target = ScriptedTarget(vocab=32, best=best, nan_after_draft=True)
        target.cache.copy_slots = lambda src, dst: None  # no K/V here (and no path moves: 9 is node 0)
        verdicts = tree_step([seq], target, FixedTree(), 3, lambda s, t: s.append(t, [], None), StepTimes())
        return seq, verdicts

    seq, verdicts = run(best=4)
    assert seq.finish_reason is None and seq.output_ids == [4]
    assert verdicts == [StepResult([9], 0, 2)]  # nothing accepted; the draft's first choice reported; depth 2 counted
    seq, verdicts = run(best=9)
    assert seq.output_ids == [9] and seq.finish_reason == "error" and "position 4" in seq.error
    assert verdicts == [StepResult([9, 12], 1, 2)]
