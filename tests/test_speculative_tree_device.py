"""The tree step on the device (tree_on_device.py `device_tree_step`, tree_walk_on_device.py,
drafters/tree_search_on_device.py `search_on_device`) is the host step.

The host step (the host search `propose_trees`, the host walk `accept_tree`: the reference twin)
is what tests/test_speculative_tree.py shows exact: enumeration of `walk_one`, chi-square over the
whole pipeline, planted bugs. The device step makes the same decisions from the same numbers (the
same rows warped, the same keyed uniforms, the masses subtracted child by child in fp64, the same
final draw; the same frontiers and selection, scores in fp64), so it is checked for IDENTITY with
the host step rather than for its law alone:
  1. the walk draw by draw, on random trees and logits (repeated siblings, non-finite rows,
     greedy, standard and pathwise requests in one batch): the same path, final token and
     failure; the selection of a tree from its candidates: the host's `select`;
  2. end to end, LLM.generate with the step forced on the device against the host step: the same
     tokens and drafted / accepted counts for greedy, seeded sampled and pathwise requests, batch
     1 and 3, trees grown by the EAGLE head and by a draft model (several shapes), prompt lookup
     in front, a mixed batch, a penalised request beside them (its options on the device:
     tests/test_tree_options_on_device.py). On a GPU these run on CUDA (with its CUDA graphs),
     elsewhere on the CPU (`step_models`);
  3. power: a device walk whose tests keep the full mass (the residual not updated) is caught by 1;
  4. the law as a check of its own: test_speculative_tree.py's chi-square cases and planted bugs
     with the device step forced;
  5. the rest of a step's contract on the device: static shapes (no dynamic forward after
     warm-up), interrupts anywhere, non-finite rows the walk never reaches, the end of the
     context, preemption.
"""

from __future__ import annotations

import copy
import dataclasses
import functools

import pytest
import torch

import minispec.drafters.tree
import minispec.engine
import minispec.speculative_tree as tree_module
import minispec.tree_on_device
import minispec.tree_walk_on_device
from minispec import LLM, AttentionBackend, SamplingParams
from minispec.drafters.base import AutoregressiveDrafter
from minispec.drafters.draft_tree import DraftTree
from minispec.io.checkpoint import default_device
from minispec.runtime.sequence import Sequence
from minispec.runtime.transfers import Staging, Upload
from minispec.sampling import WARP_DTYPES, WarpParams
from minispec.speculative_tree import accept_tree
from minispec.tree_layout import tree_feed, tree_offsets
from minispec.tree_on_device import stage_walk
from minispec.tree_walk_on_device import walk_on_device, walk_tables
from test_speculative_statistical import ALPHA, N, PROMPT, models  # noqa: F401
import test_speculative_tree as host_tests
from test_speculative_tree import TREE_CASES, TREE_MUTANTS, full_mass_child_tests, tree_p_value

pytestmark = pytest.mark.usefixtures("one_thread")
SP = SamplingParams
WARPS = [SP(temperature=1.0), SP(temperature=0.6), SP(temperature=1.3, top_k=3), SP(temperature=0.9, top_p=0.8),
         SP(temperature=0.0)]


class SlotTable:
    """A target table's stand-in for `stage_walk`: key index t sits in pool slot 100 + t."""

    def __init__(self, num_cached: int):
        self.num_cached = num_cached

    def slots(self, start: int, end: int) -> list[int]:
        return list(range(100 + start, 100 + end))


def random_batch(seed: int) -> tuple[list[Sequence], list[DraftTree], torch.Tensor]:
    """Three sequences with random trees (parents first; tokens from a vocabulary of 7, so
    siblings often repeat), a mix of warps (every fourth batch all greedy, a pathwise request in
    every third) and logits [sum(N_b + 1), 7], with a NaN row in every fifth batch."""
    gen = torch.Generator().manual_seed(seed)
    V, trees, seqs = 7, [], []
    for b in range(3):
        n = int(torch.randint(0, 8, (), generator=gen))
        parents = [int(torch.randint(-1, i, (), generator=gen)) for i in range(n)]
        trees.append(DraftTree(torch.randint(0, V, (n,), generator=gen).tolist(), parents))
        params = WARPS[(seed + b) % len(WARPS)]
        if seed % 3 == 1 and b == 1:
            params = dataclasses.replace(params, temperature=max(params.temperature, 0.5), pathwise=True)
        if seed % 4 == 3:
            params = SP(temperature=0.0)
        seqs.append(Sequence(b, [1, 2], dataclasses.replace(params, seed=100 * seed + b), 16))
        seqs[-1].target_table = SlotTable(1)
    logits = 2.0 * torch.randn(tree_offsets(trees)[-1], V, generator=gen)
    if seed % 5 == 2:
        logits[int(torch.randint(0, len(logits), (), generator=gen))] = float("nan")
    return seqs, trees, logits


def device_verdicts(seqs: list[Sequence], trees: list[DraftTree], logits: torch.Tensor) -> list[tuple]:
    """(path, final token or None where broken, broken) per sequence from `walk_on_device`."""
    upload = Upload()
    children = max(1, max(len(c) for t in trees for c in t.children()))
    depth = max(1, max(max(t.depths(), default=0) for t in trees))
    shape = stage_walk(upload, seqs, [tree_feed(s, t) for s, t in zip(seqs, trees)], [len(t) for t in trees],
                       logits.shape[-1], children, depth, dict(enumerate(trees)))
    sent = Staging(logits.device).send(upload)
    warp = None
    if not all(s.params.greedy for s in seqs):
        warp = WarpParams.of([s.params for s in seqs for _ in range(shape.nodes + 1)], logits.shape[-1], None,
                             {name: sent["tree.warp." + name] for name in WARP_DTYPES})
    tables = walk_tables(sent["tree.tokens"], sent["tree.parents"], sent, shape)
    walk = walk_on_device(logits, sent, tables, shape, warp)
    out = []
    for b in range(len(seqs)):
        n, broken = int(walk.num_accepted[b]), bool(walk.broken[b])
        out.append((walk.path[b, :n].tolist(), None if broken else int(walk.tokens[b, n]), broken))
    return out


def host_verdicts(seqs: list[Sequence], trees: list[DraftTree], logits: torch.Tensor) -> list[tuple]:
    paths, finals, failures = accept_tree(logits, seqs, trees, tree_offsets(trees))
    return [(p, None if b in failures else f, b in failures) for b, (p, f) in enumerate(zip(paths, finals))]


@pytest.mark.parametrize("seed", range(60))
def test_the_device_walk_decides_as_the_host_walk(seed):
    seqs, trees, logits = random_batch(seed)
    logits = logits.to(default_device(None))  # (on a GPU both walk from CUDA logits, as in a step)
    assert device_verdicts(seqs, trees, logits) == host_verdicts(seqs, trees, logits)


def test_a_device_walk_without_the_residual_update_is_caught(monkeypatch):
    """Power: child tests against the full mass of the row (rejected siblings keep theirs) give
    other paths than the host walk on some of the same batches."""
    monkeypatch.setattr(minispec.tree_walk_on_device, "child_tests", full_mass_child_tests)
    differ = sum(device_verdicts(*random_batch(seed)) != host_verdicts(*random_batch(seed)) for seed in range(60))
    assert differ > 0


# --- 2. end to end --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def step_models(models):
    """test_speculative_statistical.py's models on the device an LLM takes by default: on a CPU
    those models themselves; on a GPU copies on CUDA, where the device step is the default and
    the steps replay CUDA graphs, so the device walk and search run there against the host's.
    The copies attend with the Triton kernels: the torch backend plans each forward on the host
    (fast/attention_plans.py), and a captured graph would keep its capture's plan."""
    device = default_device(None)
    if device.type == "cpu":
        return models
    moved = copy.deepcopy({name: model for name, model in models.items() if name != "tok"})
    for model in moved.values():
        model.backend = AttentionBackend()  # (the Triton kernels on CUDA)
        model.to(device)
    return {**moved, "tok": models["tok"]}


@dataclasses.dataclass
class Run:
    """One LLM.generate: the tokens, (steps, drafted, accepted) from its metrics, and how many
    steps walked on the device and searched on the device."""

    tokens: list[list[int]]
    counts: tuple[int, int, int]
    device_steps: int = 0
    device_searches: int = 0
    looked_up: int = 0  # sequence-steps prompt lookup drafted, in front of the tree drafter


def generate_both(models, drafter: str, params: list[SamplingParams], prompts: list[list[int]],
                  shape: tuple[int, int, int] = (3, 6, 2), threshold: float | None = None) -> tuple[Run, Run]:
    """LLM.generate with the tree step forced on the host (the host search and walk), then on the
    device (the device search where the drafter has one, and the device walk), a fresh LLM each.
    shape: the trees' (depth, budget, top_k); threshold: a confidence threshold, whose stops are
    decided where the step runs (AutoregressiveDrafter.stops_on_device)."""
    draft = (models["near"], models["tok"]) if drafter.startswith("near") else models["eagle"]
    depth, budget, top_k = shape
    options = dict(model=(models["target"], models["tok"]), draft_model=draft, num_speculative_tokens=depth,
                   draft_tree_budget=budget, draft_tree_top_k=top_k, kv_cache_gib=0.01, page_size=4,
                   prompt_lookup_min=2 if drafter.endswith("+lookup") else None, draft_confidence_threshold=threshold,
                   max_num_seqs=4)  # (every batch here fits; on a GPU, fewer batch buckets to capture as graphs)
    runs = []
    for on_device in (False, True):
        steps, searches = [], []
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(AutoregressiveDrafter, "confidence_on_device", on_device)
            patch.setattr(tree_module, "device_tree_step", counted(tree_module.device_tree_step, steps))
            patch.setattr(minispec.drafters.tree, "search_on_device", counted(minispec.drafters.tree.search_on_device, searches))
            patch.setattr(minispec.engine, "tree_step", functools.partial(tree_module.tree_step, on_device=on_device))
            llm = LLM(**options)
            tokens = [o.token_ids for o in llm.generate(prompts, params)]
        m = llm.last_metrics
        looked_up = llm.engine.drafter.lookup_drafts if drafter.endswith("+lookup") else 0
        runs.append(Run(tokens, (m.num_steps, m.num_drafted, m.num_accepted), len(steps), len(searches), looked_up))
    return runs[0], runs[1]


def counted(function, calls: list):
    def wrapped(*args, **kwargs):
        calls.append(1)
        return function(*args, **kwargs)

    return wrapped


BATCH = [PROMPT, [3, 1, 4, 1, 5], [2, 2, 2]]
RULES = {"greedy": SP(temperature=0, max_tokens=16, ignore_eos=True),
         "sampled": SP(temperature=0.9, top_p=0.95, max_tokens=16, ignore_eos=True),
         "pathwise": SP(temperature=0.8, top_k=5, max_tokens=16, ignore_eos=True, pathwise=True)}


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("rule", list(RULES))
@pytest.mark.parametrize("drafter", ["eagle-tree", "near-tree", "eagle-tree+lookup"])
def test_the_device_step_gives_the_host_steps_tokens(step_models, drafter, rule, batch):
    """Greedy, seeded sampled and pathwise requests (seeds differ within a batch), alone and three
    at a time: the device step's tokens are the host step's, token for token, and so are the
    drafted and accepted counts (the trees searched on the device are the host's: a seeded
    sampled request's tokens depend on the tree). The EAGLE head and the draft model search on
    the device, behind prompt lookup too (its chains ride up as host trees)."""
    params = [dataclasses.replace(RULES[rule], seed=7 + i) for i in range(batch)]
    host, device = generate_both(step_models, drafter, params, BATCH[:batch])
    assert device.tokens == host.tokens
    assert device.counts == host.counts and host.counts[2] > 0  # (some node was accepted)
    assert host.device_steps == 0 and device.device_steps > 0
    assert device.device_searches == device.device_steps
    if drafter.endswith("+lookup"):
        assert device.looked_up > 0


def test_a_mixed_batch_and_a_penalised_request(step_models):
    """A greedy, a standard and a pathwise request in one batch step on the device together; a
    batch with a penalised request steps on the device too (its rows penalised there,
    tree_options_on_device.py), with the host step's tokens and counts."""
    mixed = [RULES["greedy"], dataclasses.replace(RULES["sampled"], seed=3), dataclasses.replace(RULES["pathwise"], seed=4)]
    host, device = generate_both(step_models, "eagle-tree", mixed, BATCH)
    assert device.tokens == host.tokens and device.counts == host.counts and device.device_steps > 0
    penalised = [dataclasses.replace(RULES["sampled"], seed=5, repetition_penalty=1.3)] + mixed[1:]
    host, device = generate_both(step_models, "near-tree", penalised, BATCH)
    assert device.tokens == host.tokens and device.counts == host.counts and device.device_steps > 0


@pytest.mark.parametrize("shape", [(4, 12, 3), (5, 9, 1), (2, 3, 4)], ids=lambda s: "d{}-n{}-k{}".format(*s))
@pytest.mark.parametrize("drafter", ["eagle-tree", "near-tree"])
def test_other_tree_shapes_search_the_same_trees(step_models, drafter, shape):
    """Deeper, wider, a chain (top_k 1) and a budget below the first level's candidates: the
    device search keeps the host's trees (the same seeded sampled tokens and counts)."""
    params = [dataclasses.replace(RULES["sampled"], seed=11 + i, max_tokens=20) for i in range(3)]
    host, device = generate_both(step_models, drafter, params, BATCH, shape)
    assert device.tokens == host.tokens and device.counts == host.counts and host.counts[2] > 0
    assert device.device_searches > 0


@pytest.mark.parametrize("rule", ["greedy", "sampled"])
@pytest.mark.parametrize("drafter", ["eagle-tree", "near-tree"])
def test_a_confidence_threshold_stops_the_device_search_where_the_host_search_stops(step_models, drafter, rule):
    """With a confidence threshold the device search runs every level and drops the levels the
    host search would not have grown (`stop_growing`): the same trees, so the same tokens and
    counts. The threshold does cut trees here (fewer nodes drafted than without it), so a device
    search that ignored it would draft more than the host's."""
    params = [dataclasses.replace(RULES[rule], seed=21 + i, max_tokens=20) for i in range(3)]
    shape = (4, 12, 3)
    host, device = generate_both(step_models, drafter, params, BATCH, shape, threshold=0.3)
    assert device.tokens == host.tokens and device.counts == host.counts and host.counts[2] > 0
    assert device.device_searches == device.device_steps > 0
    unbounded, _ = generate_both(step_models, drafter, params, BATCH, shape)
    assert unbounded.counts[1] > host.counts[1]


# --- 4. the law, with the device step forced ----------------------------------------------------


def force_device(monkeypatch) -> None:
    monkeypatch.setattr(minispec.engine, "tree_step", functools.partial(tree_module.tree_step, on_device=True))


@pytest.mark.parametrize("case", TREE_CASES, ids=[f"{c[0]}-d{c[1]}-n{c[2]}-k{c[3]}-T{c[4].temperature}" for c in TREE_CASES])
def test_the_device_step_keeps_the_target_distribution(models, monkeypatch, case):
    """test_speculative_tree.py's chi-square over the whole pipeline, the trees searched and
    walked on the device (the penalised cases' rows penalised there too)."""
    force_device(monkeypatch)
    pval, llm = tree_p_value(models, *case)
    assert pval > ALPHA
    assert llm.last_metrics.num_accepted > 0.3 * N


@pytest.mark.parametrize("drafter,mutant", TREE_MUTANTS, ids=[f"{d}-{m.__name__}" for d, m in TREE_MUTANTS])
def test_the_statistic_rejects_planted_bugs_in_the_device_step(models, monkeypatch, drafter, mutant):
    """Power, on the device step: the same planted bugs (its child tests without the residual
    update, a causal mask over the tree, the path's K/V left in place) are rejected."""
    force_device(monkeypatch)
    mutant(monkeypatch)
    pval, _ = tree_p_value(models, *next(c for c in TREE_CASES if c[0] == drafter))
    assert pval < ALPHA


@pytest.mark.parametrize("seed", range(20))
def test_the_device_selection_is_the_host_selection(seed):
    """`select_on_device` against TreeDrafter.select on random candidates in the search's layout
    (w children per frontier node, a child's score its parent's plus a log q <= 0, ties made on
    purpose by rounding), for trees of every size up to past the candidates (as a lookup chain
    beside the search pads them): the same tokens and parents, depths and mask rows that
    DraftTree computes."""
    from minispec.drafters.tree import Candidate, TreeDrafter
    from minispec.drafters.tree_search_on_device import select_on_device

    class Budget:  # what TreeDrafter.select reads of its drafter
        def __init__(self, budget: int):
            self.budget = budget

    gen = torch.Generator().manual_seed(seed)
    w, levels = int(torch.randint(1, 4, (), generator=gen)), int(torch.randint(1, 4, (), generator=gen))
    found, frontier = [], [-1]
    for level in range(1, levels + 1):
        made = []
        for parent in frontier:
            base = found[parent].score if parent >= 0 else 0.0
            for _ in range(w):
                made.append(len(found))
                step = -float(torch.rand((), generator=gen).mul(4).round().div(2))  # 0, -0.5, .. -2: ties
                found.append(Candidate(int(torch.randint(0, 50, (), generator=gen)), parent, base + step))
        frontier = sorted(made, key=lambda i: (-found[i].score, i))[:w]
    M = len(found)
    score = torch.tensor([[c.score for c in found]], dtype=torch.float64)
    token = torch.tensor([[c.token for c in found]])
    parent = torch.tensor([[c.parent for c in found]])
    for size in range(1, M + 3):
        N = size + 1
        host = TreeDrafter.select(Budget(size), found)
        tokens, parents, depths, bits = select_on_device(score, token, parent, torch.tensor([min(size, M)]), N, w, levels)
        n = len(host)
        assert tokens[0, :n].tolist() == host.tokens and parents[0, :n].tolist() == host.parents
        assert depths[0, :n].tolist() == host.depths() and bits[0, :n].tolist() == host.ancestor_bits()
        assert parents[0, n:].tolist() == [-2] * (N - n)



@pytest.mark.parametrize("where", [("drafter", "run_staged_trees"), ("step", "walk_on_device"),
                                   ("step", "move_path_on_device"), ("drafter", "rollback")], ids=lambda w: w[1])
def test_an_interrupted_device_step_ends_every_request_and_leaves_the_llm_usable(tiny_llama, tiny_llama_eagle,
                                                                                 monkeypatch, where):
    """test_speculative_tree.py's interrupt test with the step forced on the device: a
    KeyboardInterrupt in the search, the walk, the K/V move or the rollback ends every request
    with "error", frees every page of both pools, and the next call equals an uninterrupted one."""
    from test_reliability import PROMPTS, generate_interrupted, idle_and_whole

    force_device(monkeypatch)
    llm = LLM(model=str(tiny_llama), draft_model=str(tiny_llama_eagle), num_speculative_tokens=3, draft_tree_budget=6,
              draft_tree_top_k=3, kv_cache_gib=0.01, dtype="float32")
    params = SP(temperature=0.8, max_tokens=12, ignore_eos=True, seed=3)
    clean = [o.token_ids for o in llm.generate(PROMPTS, params)]
    owner = llm.engine.drafter if where[0] == "drafter" else minispec.tree_on_device  # (where the step looks them up)
    generate_interrupted(llm, PROMPTS, params, owner, where[1], 3)
    assert idle_and_whole(llm)
    assert [o.token_ids for o in llm.generate(PROMPTS, params)] == clean


@pytest.mark.parametrize("drafter", ["draft-tree", "eagle-tree", "lookup+eagle-tree"])
def test_the_device_step_with_static_shapes(tiny_llama, tiny_llama_draft, tiny_llama_eagle, monkeypatch, drafter):
    """With the step on the device, static shapes (what a CUDA graph replays) give the dynamic
    path's tokens, and after warm-up no forward of any runner is dynamic: the search's levels and
    the verification of a searched tree, whose positions and mask rows the device writes into a
    bucket, are static shapes (tests/test_graphs.py's check)."""
    from test_graphs import PROMPTS as GRAPH_PROMPTS
    from test_graphs import REPEATING, drafter_args, trace_forwards

    force_device(monkeypatch)
    args = dict(model=str(tiny_llama), kv_cache_gib=0.01, **drafter_args(drafter, tiny_llama_draft, tiny_llama_eagle))
    dynamic, static = LLM(**args, cuda_graphs=False), LLM(**args, static_shapes=True, max_num_seqs=4)
    log = trace_forwards(static)
    prompts = REPEATING if "lookup" in drafter else GRAPH_PROMPTS
    params = [SP(temperature=0, max_tokens=20, ignore_eos=True)] + [
        SP(temperature=0.9, top_p=0.95, max_tokens=20, ignore_eos=True, seed=i) for i in range(len(prompts) - 1)]
    assert [o.token_ids for o in dynamic.generate(prompts, params)] == [o.token_ids for o in static.generate(prompts, params)]
    warm_up = max(i for i, (_, _, from_start) in enumerate(log) if from_start) + 1
    assert [entry for entry in log[warm_up:] if entry[1] == "dynamic"] == []
    static = ("static", "graph")  # (a GPU replays the static layout as CUDA graphs)
    assert sum(1 for role, path, _ in log[warm_up:] if role == "draft" and path in static) >= 3


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_non_finite_node_rows_the_device_walk_never_reaches_change_nothing(temperature):
    """test_speculative_tree.py's non-finite test, walked on the device: every row past the root is
    NaN. The root prefers 4: both of its children are rejected at its finite row and the step
    emits 4. The root prefers 9: 9 is accepted, the next token would come from its NaN row, so
    the request emits 9 and ends with "error" at that position."""
    from test_reliability import ScriptedTarget
    from test_speculative_tree import FixedTree

    from minispec.runtime.metrics import StepTimes
    from minispec.speculative import StepResult

    class Reserving(ScriptedTarget):
        def prepare(self, feeds, upload):  # (the device step reads the nodes' pool slots)
            for f in feeds:
                f.table.reserve(f.table.num_cached + len(f.tokens), self.cache.allocator)
            return feeds

    def run(best: int):
        seq = Sequence(0, [1, 2, 3], SP(temperature=temperature, max_tokens=5, seed=0, ignore_eos=True), 16)
        target = Reserving(vocab=32, best=best, nan_after_draft=True)
        target.cache.copy_slots = lambda src, dst: None  # no K/V here
        verdicts = tree_module.tree_step([seq], target, FixedTree(), 3, lambda s, t: s.append(t, [], None),
                                         StepTimes(), on_device=True)
        return seq, verdicts

    seq, verdicts = run(best=4)
    assert seq.finish_reason is None and seq.output_ids == [4]
    assert verdicts == [StepResult([9], 0, 2)]
    seq, verdicts = run(best=9)
    assert seq.output_ids == [9] and seq.finish_reason == "error" and "position 4" in seq.error
    assert verdicts == [StepResult([9, 12], 1, 2)]


def test_a_device_step_at_the_end_of_the_context(models, monkeypatch):
    """test_speculative_tree.py's end-of-context test with the step on the device: the last steps'
    trees reach key slots past the context (their verification runs dynamically even with static
    shapes), and the tokens are plain decoding's."""
    force_device(monkeypatch)
    host_tests.test_a_tree_at_the_end_of_the_context(models)


def test_a_device_step_with_preemption(models, monkeypatch):
    """A KV pool small enough to preempt and recompute sequences mid-answer: with the step on the
    device, greedy requests give plain decoding's tokens and seeded sampled ones the host step's."""
    model = (models["target"], models["tok"])
    prompts = [PROMPT, [0, 1], [4, 4, 4, 4], [2, 5, 3], [1], [3, 3, 0, 1, 2]]
    tree = dict(draft_model=models["eagle"], num_speculative_tokens=3, draft_tree_budget=6, draft_tree_top_k=3)
    small = dict(model=model, page_size=4, kv_cache_gib=22 * 512 / 2**30, max_num_seqs=6, **tree)  # ~10 pages a pool
    greedy = SP(temperature=0, max_tokens=20, ignore_eos=True)
    sampled = [SP(temperature=0.9, max_tokens=20, ignore_eos=True, seed=i) for i in range(len(prompts))]
    plain = [o.token_ids for o in LLM(model=model, kv_cache_gib=0.01, page_size=4).generate(prompts, greedy)]
    host = [o.token_ids for o in LLM(**small).generate(prompts, sampled)]
    force_device(monkeypatch)
    llm = LLM(**small)
    assert [o.token_ids for o in llm.generate(prompts, greedy)] == plain
    assert llm.last_metrics.num_preemptions > 0
    assert [o.token_ids for o in llm.generate(prompts, sampled)] == host
