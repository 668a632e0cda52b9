"""vLLM's options on the tree step laid out for the device (tree_options_on_device.py): penalties,
min_tokens and logprobs give the host tree step's tokens and logprobs, in one upload and one
download.

The host tree step (speculative_tree.py `host_tree_step`: `penalized_tree` penalises node i's row
with the sequence's tokens and its path, root's child down to i; `top_logprobs` reads the path's
raw rows) is the reference twin, shown exact by tests/test_speculative_tree.py (its chi-square
has penalised cases; tests/test_speculative_tree_device.py runs them with the device step forced).
The device step makes the same rows from the same history, so it is checked for IDENTITY:
  1. end to end, LLM.generate with the tree step forced on the device against the host step:
     the same tokens, drafted / accepted counts and logprobs (the same top ids and ranks, values
     within fp tolerance) for penalties, min_tokens and logprobs, greedy, seeded sampled and
     pathwise, trees grown by the EAGLE head and by a draft model, prompt lookup's chains in
     front, fixed trees the host knows, and a batch mixing them with plain requests; each option
     acts (the tokens are not plain decoding's); preemption mid-answer leaves the counts right;
     penalised greedy trees a target drafts for itself are plain penalised decoding;
  2. power: a device step that leaves the path's tokens out of a row's counts, or the node's
     own token, or masks min_tokens one token short, gives other tokens than the host step; and
     the chi-square over the whole pipeline rejects the node's own token left out;
  3. one upload and one download a step with these options, after warm-up.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

import minispec.tree_on_device
import minispec.tree_options_on_device as options_module
from minispec import LLM, SamplingParams
from minispec.drafters.tree import TreeDrafter
from test_speculative_statistical import ALPHA, PROMPT, models  # noqa: F401
from test_speculative_tree import TREE_CASES, tree_p_value
from test_speculative_tree_device import BATCH, RULES, Run, force_device, generate_both
from test_transfers import step_transfers
from minispec.drafters.draft_tree import DraftTree
from test_transfers_tree import PROMPTS, tree_llm

pytestmark = pytest.mark.usefixtures("one_thread")
PENALISED = dict(repetition_penalty=1.5, frequency_penalty=0.7, presence_penalty=0.4)


def generate_both_with_logprobs(models, drafter: str, params: list[SamplingParams],
                                prompts: list[list[int]], **options) -> tuple[Run, Run, list, list]:
    """`generate_both` (the tree step forced on the host, then on the device), with each run's
    logprobs per request (None where a request did not ask)."""
    outputs, original = [], LLM.generate

    def recorded(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        outputs.append([o.logprobs for o in out])
        return out

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(LLM, "generate", recorded)
        host, device = generate_both(models, drafter, params, prompts, **options)
    return host, device, outputs[0], outputs[1]


def assert_same_logprobs(device: list, host: list) -> None:
    """The same positions, top ids (in order) and ranks; values within fp tolerance."""
    for d, h in zip(device, host):
        assert (d is None) == (h is None)
        assert len(d or []) == len(h or [])
        for dl, hl in zip(d or [], h or []):
            assert list(dl) == list(hl)
            assert [x.rank for x in dl.values()] == [x.rank for x in hl.values()]
            values = [x.logprob for x in hl.values()]
            assert [x.logprob for x in dl.values()] == pytest.approx(values, abs=1e-5)


def plain_tokens(models, drafter: str, params: list[SamplingParams]) -> list[list[int]]:
    """The host step's tokens for params without any option (what an option must change)."""
    bare = [dataclasses.replace(p, repetition_penalty=1.0, frequency_penalty=0.0, presence_penalty=0.0,
                                min_tokens=0, stop_token_ids=[], logprobs=None) for p in params]
    return generate_both(models, drafter, bare, BATCH[: len(params)])[0].tokens


def with_option(option: str, rule: str, batch: int, stop: int) -> list[SamplingParams]:
    """Seeded requests of the rule (seeds differ within a batch) with one option: penalties,
    min_tokens 10 with stop token `stop` (plain decoding emits it early), or 3 logprobs."""
    extra = {"penalties": PENALISED, "min_tokens": dict(min_tokens=10, stop_token_ids=[stop]),
             "logprobs": dict(logprobs=3)}[option]
    return [dataclasses.replace(RULES[rule], seed=7 + i, **extra) for i in range(batch)]


def first_stop(models, drafter: str, rule: str) -> int:
    """A token the first request emits early without options: min_tokens must hold it back."""
    return plain_tokens(models, drafter, [dataclasses.replace(RULES[rule], seed=7)])[0][1]


@pytest.mark.parametrize("rule", list(RULES))
@pytest.mark.parametrize("option", ["penalties", "min_tokens", "logprobs"])
@pytest.mark.parametrize("drafter", ["eagle-tree", "near-tree", "eagle-tree+lookup"])
def test_the_device_step_with_options_gives_the_host_steps_tokens_and_logprobs(models, drafter, option,
                                                                                 rule):
    """Three requests of one rule with one option: the device step's tokens, counts and logprobs
    are the host step's; the option acts (penalties and min_tokens change the tokens, min_tokens
    keeps the stop token out of the first 10; logprobs come for every emitted token)."""
    stop = first_stop(models, drafter, rule) if option == "min_tokens" else 0
    params = with_option(option, rule, 3, stop)
    host, device, host_lp, device_lp = generate_both_with_logprobs(models, drafter, params, BATCH)
    assert device.tokens == host.tokens
    assert device.counts == host.counts and host.counts[2] > 0  # (some node was accepted)
    assert host.device_steps == 0 and device.device_steps > 0
    assert_same_logprobs(device_lp, host_lp)
    if option == "penalties":
        assert host.tokens != plain_tokens(models, drafter, params)
    if option == "min_tokens":
        assert stop not in host.tokens[0][:10]
        assert stop in plain_tokens(models, drafter, params[:1])[0][:10]
    if option == "logprobs":
        assert all(len(lp) == len(t) for lp, t in zip(host_lp, host.tokens))


@pytest.mark.parametrize("drafter", ["eagle-tree", "near-tree"])
def test_a_mixed_batch_with_every_option(models, drafter):
    """Greedy with penalties and logprobs, seeded sampled with min_tokens, pathwise with
    penalties, and a plain request, in one batch: the host step's tokens, counts and logprobs."""
    stop = first_stop(models, drafter, "sampled")
    params = [dataclasses.replace(RULES["greedy"], logprobs=2, **PENALISED),
              dataclasses.replace(RULES["sampled"], seed=7, min_tokens=10, stop_token_ids=[stop]),
              dataclasses.replace(RULES["pathwise"], seed=9, repetition_penalty=1.3, logprobs=1),
              dataclasses.replace(RULES["sampled"], seed=11)]
    prompts = BATCH + [[4, 4]]
    host, device, host_lp, device_lp = generate_both_with_logprobs(models, drafter, params, prompts)
    assert device.tokens == host.tokens and device.counts == host.counts and host.counts[2] > 0
    assert host.device_steps == 0 and device.device_steps > 0
    assert_same_logprobs(device_lp, host_lp)
    assert device_lp[3] is None and device_lp[0] is not None


def repeating_trees(self, seqs, max_depth):
    """Root -> 1 (-> 1 -> 1, -> 2), 0, cut to each sequence's depth: trees the host knows without
    asking the device (what a host drafter proposes), a token repeated down a path."""
    tree = DraftTree([1, 0, 1, 1, 2], [-1, -1, 0, 2, 0])
    keep = [[i for i, d in enumerate(tree.depths()) if d <= m] for m in max_depth]
    return [DraftTree([tree.tokens[i] for i in k], [tree.parents[i] for i in k]) for k in keep]


@pytest.mark.parametrize("rule", ["greedy", "sampled"])
def test_host_trees_with_options_on_the_device(models, rule, monkeypatch):
    """Trees the host knows (a drafter that proposes on the host: fixed trees with a repeated
    token on a path), penalised on the device: the host step's tokens, counts and logprobs."""
    monkeypatch.setattr(TreeDrafter, "stage_trees", lambda self, seqs, max_depth, upload: None)
    monkeypatch.setattr(TreeDrafter, "propose_trees", repeating_trees)
    params = [dataclasses.replace(RULES[rule], seed=7 + i, logprobs=2, min_tokens=4, **PENALISED)
              for i in range(3)]
    host, device, host_lp, device_lp = generate_both_with_logprobs(models, "near-tree", params, BATCH)
    assert device.tokens == host.tokens and device.counts == host.counts
    assert host.device_steps == 0 and device.device_steps > 0
    assert_same_logprobs(device_lp, host_lp)


def test_preemption_leaves_the_counts_right(models, monkeypatch):
    """A KV pool small enough to preempt and recompute sequences mid-answer, penalised and
    min_tokens requests: a preempted sequence keeps its tokens and its counts on the device,
    and the device step gives the host step's tokens."""
    prompts = [PROMPT, [0, 1], [4, 4, 4, 4], [2, 5, 3], [1], [3, 3, 0, 1, 2]]
    tree = dict(draft_model=models["eagle"], num_speculative_tokens=3, draft_tree_budget=6,
                draft_tree_top_k=3)
    small = dict(model=(models["target"], models["tok"]), page_size=4, kv_cache_gib=22 * 512 / 2**30,
                 max_num_seqs=6, **tree)  # ~10 pages a pool
    params = [SamplingParams(temperature=0.9, max_tokens=20, ignore_eos=True, seed=i, min_tokens=3 * i,
                             stop_token_ids=[1], **PENALISED) for i in range(len(prompts))]
    host = [o.token_ids for o in LLM(**small).generate(prompts, params)]
    force_device(monkeypatch)
    llm = LLM(**small)
    assert [o.token_ids for o in llm.generate(prompts, params)] == host
    assert llm.last_metrics.num_preemptions > 0


SELF = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, repetition_penalty=1.8),
        SamplingParams(temperature=0, max_tokens=16, min_tokens=10, repetition_penalty=0.8, frequency_penalty=-1.0)]


@pytest.mark.filterwarnings("ignore:draft_model .* is not smaller")  # (a target drafting for itself)
@pytest.mark.parametrize("params", SELF, ids=["repetition", "min_tokens+negative"])
def test_penalised_greedy_self_trees_on_the_device_are_plain_decoding(tiny_llama, params, monkeypatch):
    """A target drafting trees for itself (its trees ignore penalties, so the accepted paths run
    deep where the penalties agree with its own choice, and node rows decide) with the step
    on the device: penalised greedy output is plain penalised decoding's, a reference that is not
    the host tree step (test_sampling_options.py's check, there on the host step)."""
    prompts = ["the quick brown fox", "to be or not to be, that is"]
    plain = [o.token_ids for o in LLM(model=tiny_llama, kv_cache_gib=0.01).generate(prompts, params)]
    force_device(monkeypatch)
    llm = LLM(model=tiny_llama, draft_model=tiny_llama, num_speculative_tokens=3, draft_tree_budget=8,
              draft_tree_top_k=3, kv_cache_gib=0.01)
    assert [o.token_ids for o in llm.generate(prompts, params)] == plain
    assert llm.last_metrics.num_accepted > 0


# --- 2. power ------------------------------------------------------------------------------------


def without_ancestors(path_counts, tokens, parents, depth, vocab_size):
    """A planted bug: a node's row counts its own token only, not its ancestors'."""
    return path_counts(tokens, parents, 1, vocab_size)


def without_the_node(path_counts, tokens, parents, depth, vocab_size):
    """A planted bug: a node's row counts its ancestors' tokens, not its own."""
    counts = path_counts(tokens, parents, depth, vocab_size)  # [B, N+1, V]
    own = torch.zeros_like(counts)
    own[:, 1:].scatter_(-1, tokens[..., None], (parents >= -1)[..., None].float())
    return counts - own


def min_tokens_one_short(penalized, target_logits, *, penalties, tokens, parents, slot_depth, depth):
    """A planted bug: each row counts one token more before it (min_tokens releases a token early)."""
    return penalized(target_logits, penalties=penalties, tokens=tokens, parents=parents,
                     slot_depth=slot_depth + 1, depth=depth)


MUTANTS = [(without_ancestors, "greedy"), (without_the_node, "greedy"), (without_ancestors, "sampled"),
           (min_tokens_one_short, "sampled")]


@pytest.mark.parametrize("mutant,rule", MUTANTS, ids=lambda x: getattr(x, "__name__", x))
def test_a_device_step_that_misses_part_of_the_path_is_caught(models, monkeypatch, mutant, rule):
    """Power: each planted bug gives the device step other tokens than the host step on a batch
    the real step passes (test_the_device_step_with_options_..., the draft model's trees, whose
    paths are often accepted deep enough for a node's row to decide): penalties, and min_tokens
    10 with a stop token plain decoding emits early."""
    if mutant is min_tokens_one_short:
        module, name = minispec.tree_on_device, "penalized_tree_on_device"
        params = with_option("min_tokens", rule, 3, first_stop(models, "near-tree", rule))
    else:
        module, name = options_module, "path_counts"
        params = with_option("penalties", rule, 3, 0)
    monkeypatch.setattr(module, name, functools.partial(mutant, getattr(module, name)))
    host, device = generate_both(models, "near-tree", params, BATCH)
    assert device.device_steps > 0
    assert device.tokens != host.tokens


def test_the_statistic_rejects_a_path_count_bug_in_the_device_step(models, monkeypatch):
    """Power of test_speculative_tree.py's chi-square (its penalised draft-model case, which
    test_speculative_tree_device.py runs on the device step and passes): a device step whose
    node rows leave the node's own token out of the counts is rejected."""
    force_device(monkeypatch)
    planted = functools.partial(without_the_node, options_module.path_counts)
    monkeypatch.setattr(options_module, "path_counts", planted)
    case = next(c for c in TREE_CASES if c[0] == "near-tree" and c[4].adjusts_logits)
    pval, llm = tree_p_value(models, *case)
    assert pval < ALPHA


# --- 3. transfers --------------------------------------------------------------------------------


OPTIONS = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2, **PENALISED),
           SamplingParams(temperature=0.8, top_p=0.9, max_tokens=12, ignore_eos=True, seed=1,
                          min_tokens=6, stop_token_ids=[5], repetition_penalty=1.2),
           SamplingParams(temperature=0.8, top_k=20, max_tokens=12, ignore_eos=True, seed=2,
                          pathwise=True, logprobs=1, presence_penalty=0.5)]


@pytest.mark.parametrize("lookup", [False, True], ids=["tree", "lookup+tree"])
@pytest.mark.parametrize("model", ["draft", "eagle"])
def test_a_tree_step_with_options_makes_one_upload_and_one_download(tiny_llama, tiny_llama_draft,
                                                                    tiny_llama_eagle, model, lookup,
                                                                    monkeypatch):
    """Penalties, min_tokens and logprobs, greedy, sampled and pathwise, trees searched on the
    device (prompt lookup in front or not): one upload, one download, nothing else."""
    llm = tree_llm(model, tiny_llama, tiny_llama_draft, tiny_llama_eagle, monkeypatch,
                   prompt_lookup_min=1 if lookup else None)
    for params in (OPTIONS[:2], OPTIONS[1:]):
        for step in step_transfers(llm, params, monkeypatch, steps=2, prompts=PROMPTS):
            counts = (step["uploads"], step["downloads"], step["up"], step["down"])
            assert counts == (1, 1, 0, 0), step["where"]
