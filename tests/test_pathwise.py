"""Pathwise sampling (minispec/pathwise.py): speculation cannot change a seeded request's tokens.

Invariants taught here:
* a seeded sampled request in pathwise mode emits plain pathwise decoding's tokens, token for
  token, whatever the drafter (a draft model, adaptive length, n-gram, an EAGLE head, lookup in
  front of either, a tree grown by either), k in 1..8, speculation by load, the batch it is in,
  preemption, prefix caching and chunked prefill; a drafter that draws with other noise only
  lowers acceptance; requests with no option that reads tokens mid-step take the one-upload step
  (the noise made on the device from uploaded lanes) and emit the host path's tokens;
* repeated seeded calls with speculation by load (k from the machine's timings) return the same
  tokens, also when k is forced to differ from call to call; under the standard rule they do not;
* the law: the whole pipeline in pathwise mode samples the target's autoregressive law
  (test_speculative_statistical.py's chi-square, ALPHA = 1e-3, N = 2000 seeded requests), and the
  same statistic rejects planted bugs: noise reused across positions, noise keyed by the step
  instead of the position, and a verifier that trusts a drafter's equality under the drafter's own
  noise.
Models: conftest's tiny_llama target, tiny_llama_draft and tiny_llama_eagle (token equality), and
test_speculative_statistical.py's V = 6 models (the law).
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

import minispec.drafters.base
import minispec.drafters.draft_loop_on_device
import minispec.pathwise
import minispec.speculative
from minispec import LLM, SamplingParams, load_checkpoint
from minispec.io.eagle_checkpoint import load_eagle
from minispec.randomness import noise, request_key
from minispec.runtime.speculation_by_load import SpeculationByLoad
from minispec.sampling import warp_probs
from test_prefix_cache import kv_gib_for
from test_speculative_statistical import (ALPHA, LOOKUP_MIN, PROMPT, exact_distribution, models,  # noqa: F401
                                          pooled_chi_square, sample_counts)

pytestmark = pytest.mark.usefixtures("one_thread")

SP = SamplingParams
PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5], [40, 41, 42], [200, 17, 3, 99, 4, 250, 31]]  # the first repeats: lookup fires
PARAMS = [SP(temperature=0.8, top_p=0.9, seed=1), SP(temperature=1.2, top_k=40, repetition_penalty=1.3, seed=2),
          SP(temperature=1.0, min_tokens=4, presence_penalty=0.5, seed=3)]
PARAMS = [dataclasses.replace(p, max_tokens=20, ignore_eos=True, pathwise=True) for p in PARAMS]


@pytest.fixture(scope="module")
def pair(tiny_llama, tiny_llama_draft, tiny_llama_eagle):
    target = load_checkpoint(tiny_llama, dtype="float32")
    return target, load_checkpoint(tiny_llama_draft, dtype="float32"), load_eagle(tiny_llama_eagle, target[0])


DRAFTERS = {  # name -> (draft, LLM options); "draft"/"eagle" stand for the pair's models
    "model": ("draft", {}),
    "adaptive": ("draft", dict(draft_confidence_threshold=0.005)),
    "ngram": ("ngram", {}),
    "eagle": ("eagle", {}),
    "model+lookup": ("draft", dict(prompt_lookup_min=2)),
    "eagle+lookup": ("eagle", dict(prompt_lookup_min=2)),
    "tree": ("draft", dict(draft_tree_budget=6, draft_tree_top_k=2)),
    "eagle-tree": ("eagle", dict(draft_tree_budget=6, draft_tree_top_k=2)),
}
CASES = [(name, k) for name, k in zip(DRAFTERS, range(1, 9))] + [("model", 8), ("eagle", 5), ("ngram", 3)]


def draft_of(pair, drafter: str | None):
    """LLM's draft_model for a DRAFTERS name (None: plain decoding)."""
    if drafter is None:
        return None
    return {"draft": pair[1], "eagle": pair[2], "ngram": "ngram"}[DRAFTERS[drafter][0]]


def build(pair, drafter: str | None, k: int, **options) -> LLM:
    """An LLM over the pair's target with this drafter and k (plain decoding: None)."""
    options = {"kv_cache_gib": 0.01, "page_size": 8, **options}
    if drafter is None:
        return LLM(pair[0], **options)
    return LLM(pair[0], draft_model=draft_of(pair, drafter), num_speculative_tokens=k, **DRAFTERS[drafter][1], **options)


@pytest.fixture(scope="module")
def plain(pair):
    """Plain pathwise decoding of each prompt alone."""
    llm = build(pair, None, 0)
    return [llm.generate([prompt], params, use_tqdm=False)[0].token_ids for prompt, params in zip(PROMPTS, PARAMS)]


@pytest.mark.parametrize("drafter,k", CASES, ids=[f"{d}-k{k}" for d, k in CASES])
def test_speculation_emits_plain_pathwise_decodings_tokens(pair, plain, drafter, k):
    """Every drafter, k from 1 to 8, the three requests in one batch (and penalties, top-k, top-p,
    min_tokens among them): the tokens of plain pathwise decoding of each request alone."""
    llm = build(pair, drafter, k)
    out = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert [o.token_ids for o in out] == plain
    assert llm.last_metrics.num_drafted > 0
    if drafter in ("model", "adaptive", "eagle", "model+lookup", "eagle+lookup"):  # (trees and n-gram hit rarely here)
        assert llm.last_metrics.num_accepted > 0


def test_a_drafter_drawing_with_other_noise_only_lowers_acceptance(pair, plain, monkeypatch):
    """The verifier does not trust the draft: a draft model that draws its tokens with the noise
    of another position (on the host, `draw_from`, and on the device, from its uploaded lanes) is
    accepted less often, and the tokens are still plain decoding's."""
    honest = build(pair, "model", 4)
    assert [o.token_ids for o in honest.generate(PROMPTS, PARAMS, use_tqdm=False)] == plain
    coupled = honest.last_metrics.acceptance_rate
    # The first request alone (no penalties or min_tokens): its steps are laid out for the device.
    assert honest.generate(PROMPTS[:1], PARAMS[0], use_tqdm=False)[0].token_ids == plain[0]
    coupled_alone = honest.last_metrics.acceptance_rate
    original, lanes = minispec.drafters.base.gumbel_max, minispec.drafters.draft_loop_on_device.noise_lanes
    other = lambda positions: [p + 1000 for p in positions]  # noqa: E731
    monkeypatch.setattr(minispec.drafters.base, "gumbel_max",
                        lambda probs, keys, positions, ids=None: original(probs, keys, other(positions), ids))
    monkeypatch.setattr(minispec.drafters.draft_loop_on_device, "noise_lanes", lambda keys, positions: lanes(keys, other(positions)))
    llm = build(pair, "model", 4)
    assert [o.token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)] == plain
    assert llm.last_metrics.acceptance_rate < coupled
    assert llm.generate(PROMPTS[:1], PARAMS[0], use_tqdm=False)[0].token_ids == plain[0]
    assert llm.last_metrics.acceptance_rate < coupled_alone


@pytest.mark.parametrize("drafter", ["model", "eagle", "eagle-tree"])
def test_preemption_prefix_caching_and_chunked_prefill_change_nothing(pair, drafter):
    """Requests sharing a 37-token prefix, run twice in pools too small for all at once, with prefix
    caching and chunked prefill at a 16-token budget: preempted, recomputed, partly served from the
    cache, prompts fed in chunks; every seeded request emits plain decoding's tokens alone."""
    target = pair[0]
    g = torch.Generator().manual_seed(3)
    system = torch.randint(2, target[0].cfg.vocab_size, (37,), generator=g).tolist()
    prompts = [system + torch.randint(2, target[0].cfg.vocab_size, (n,), generator=g).tolist() for n in (3, 9, 17, 1)]
    params = [dataclasses.replace(PARAMS[i % 3], seed=10 + i) for i in range(4)]
    alone = build(pair, None, 0)
    expected = [alone.generate([p], q, use_tqdm=False)[0].token_ids for p, q in zip(prompts, params)]
    options = dict(num_speculative_tokens=3, **DRAFTERS[drafter][1])  # 13 pages of 8 tokens a pool: too few for all four
    llm = build(pair, drafter, 3, enable_prefix_caching=True, enable_chunked_prefill=True, max_num_batched_tokens=16,
                kv_cache_gib=kv_gib_for(13, target, draft_of(pair, drafter), 8, options))
    first = llm.generate(prompts[:2], params[:2], use_tqdm=False)
    again = llm.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in first + again] == expected[:2] + expected
    assert llm.engine.prefix_cache.hits > 0 and llm.last_metrics.num_preemptions > 0


def test_a_mixed_batch_keeps_each_requests_rule(pair, plain):
    """Pathwise, standard and greedy requests in one batch: the pathwise ones emit plain pathwise
    decoding's tokens, the greedy one plain greedy decoding's, the standard one its own alone."""
    llm = build(pair, "model", 3)
    standard = dataclasses.replace(PARAMS[0], pathwise=False, seed=9)
    greedy = SP(temperature=0, max_tokens=20, ignore_eos=True)
    alone = [llm.generate([PROMPTS[0]], p, use_tqdm=False)[0].token_ids for p in (standard, greedy)]
    out = llm.generate(PROMPTS + PROMPTS[:1] * 2, PARAMS + [standard, greedy], use_tqdm=False)
    assert [o.token_ids for o in out] == plain + alone
    assert [llm.engine.pathwise_for(p) for p in (PARAMS[0], standard, greedy)] == [True, False, False]


DEVICE_PARAMS = [PARAMS[0], dataclasses.replace(PARAMS[1], repetition_penalty=1.0)]  # no option reads tokens mid-step


@pytest.mark.parametrize("drafter", ["model", "adaptive", "ngram", "eagle", "model+lookup", "eagle+lookup"])
def test_steps_laid_out_for_the_device_emit_the_host_paths_tokens(pair, drafter, monkeypatch):
    """Pathwise requests without penalties, min_tokens or logprobs take the one-upload step (the
    drafter's Gumbel-max and the verifier's made on the device from uploaded noise lanes), beside
    a standard and a greedy request: the pathwise ones emit plain pathwise decoding's tokens, as
    the host path (pathwise.verify, depth by depth) does for the same batch, and the others their
    own tokens alone."""
    standard = dataclasses.replace(PARAMS[0], pathwise=False, seed=9)
    greedy = SP(temperature=0, max_tokens=20, ignore_eos=True, pathwise=True)
    params, prompts = DEVICE_PARAMS + [standard, greedy], PROMPTS[:2] + PROMPTS[:1] * 2
    plain_llm = build(pair, None, 0)
    expected = [plain_llm.generate([p], q, use_tqdm=False)[0].token_ids for p, q in zip(prompts, params)]
    llm = build(pair, drafter, 4)
    expected[2] = llm.generate([prompts[2]], standard, use_tqdm=False)[0].token_ids  # (the standard rule's depend on k)
    assert [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == expected
    assert llm.last_metrics.num_drafted > 0
    monkeypatch.setattr(minispec.speculative, "needs_host", lambda seq: True)
    host = [o.token_ids for o in build(pair, drafter, 4).generate(prompts[:2], params[:2], use_tqdm=False)]
    assert host == expected[:2]


def test_pathwise_sampling_decides_for_requests_that_do_not_say(pair):
    """LLM(pathwise_sampling=...): "seeded" (minispec serve's default) for requests with a seed,
    "on" for all, "off" for none; a request's own pathwise wins."""
    unsaid = [SP(seed=1), SP(), SP(seed=2, pathwise=False), SP(pathwise=True)]
    for mode, expected in (("off", [False, False, False, True]), ("seeded", [True, False, False, True]),
                           ("on", [True, True, False, True]), (True, [True, True, False, True])):
        engine = build(pair, None, 0, pathwise_sampling=mode).engine
        assert [engine.pathwise_for(p) for p in unsaid] == expected, mode
    with pytest.raises(ValueError, match="pathwise_sampling must be one of off, seeded, on"):
        build(pair, None, 0, pathwise_sampling="always")
    with pytest.raises(ValueError, match="^pathwise must be"):
        SP(pathwise="yes")


def forced_k(monkeypatch, schedule: list[int]) -> None:
    """Speculation by load whose every choice comes from `schedule`, cycled: another machine's timings."""
    choices = itertools.cycle(schedule)
    monkeypatch.setattr(SpeculationByLoad, "choose", lambda self, batch: next(choices))


@pytest.mark.parametrize("pathwise", [True, False], ids=["pathwise", "standard"])
def test_repeated_seeded_calls_with_speculation_by_load_return_the_same_tokens(pair, plain, monkeypatch, pathwise):
    """One seeded request, three calls on one LLM with speculation_by_load=True (each step's k
    from measured timings), then three with k forced to differ (the k's another machine's timings
    would give): pathwise, always plain decoding's tokens. Under the standard rule the forced k's
    give different tokens (what the issue saw from timing alone): the drafts steer the path."""
    params = [dataclasses.replace(p, pathwise=pathwise) for p in PARAMS]
    llm = build(pair, "model", 4, speculation_by_load=True)
    measured = [[o.token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)] for _ in range(3)]
    runs = []
    for schedule in ([4, 0, 2], [1, 3], [0, 4, 4, 1]):
        forced_k(monkeypatch, schedule)
        runs.append([o.token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)])
    if pathwise:
        assert measured == [plain] * 3 and runs == [plain] * 3
    else:
        assert runs[0] != runs[1] or runs[1] != runs[2]


# --- the law, and planted bugs ------------------------------------------------------------------


def test_gumbel_max_draws_p_and_its_kept_tokens_shortcut_changes_nothing(monkeypatch):
    """40k keys, one row p with zeros (a top-k's): Gumbel-max tokens follow p (chi-square
    p > ALPHA), never a zero; noise made for the kept tokens only gives the same tokens as noise
    for every column, and the draft's columns (token ids) key the noise, not the column index."""
    probs = torch.tensor([0.3, 0.0, 0.25, 0.2, 0.15, 0.07, 0.03, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0])
    keys, n = [request_key(s) for s in range(40000)], 40000
    sparse = minispec.pathwise.gumbel_max(probs.expand(n, -1), keys, [7] * n)  # 6 of 16 kept: the shortcut
    monkeypatch.setattr(minispec.pathwise, "SPARSE", 1000)
    dense = minispec.pathwise.gumbel_max(probs.expand(n, -1), keys, [7] * n)
    assert torch.equal(sparse, dense)
    counts = torch.bincount(dense, minlength=16)
    assert counts[probs == 0].sum() == 0 and pooled_chi_square(counts, probs)[0] > ALPHA
    columns = torch.tensor([4, 2, 9])  # a reduced vocabulary: column j is token columns[j]
    picked = minispec.pathwise.gumbel_max(probs[[4, 2, 9]].expand(8, -1), keys[:8], [7] * 8, columns)
    full = torch.zeros(16)
    full[columns] = probs[[4, 2, 9]]
    assert columns[picked].tolist() == minispec.pathwise.gumbel_max(full.expand(8, -1), keys[:8], [7] * 8).tolist()


def test_the_devices_gumbel_max_from_uploaded_lanes_is_gumbel_max():
    """lane_gumbel_max (noise made from each row's uploaded NOISE lanes, as a step laid out for the
    device makes it) picks gumbel_max's token: rows with top-k zeros (gumbel_max's kept-tokens
    shortcut) and without, fp32 and bf16 rows, a draft's columns keyed by their token ids."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 300, generator=g) * 3  # [N, V]
    keys, positions = [request_key(s) for s in range(64)], list(range(100, 164))
    lanes = torch.tensor(minispec.pathwise.noise_lanes(keys, positions))  # [N, 2]
    cut = logits.masked_fill(logits < logits.topk(5, dim=-1).values[:, -1:], float("-inf"))  # 5 of 300 kept
    for probs in (logits.softmax(-1), cut.softmax(-1), cut.bfloat16().softmax(-1)):
        expected = minispec.pathwise.gumbel_max(probs, keys, positions)
        assert torch.equal(minispec.pathwise.lane_gumbel_max(probs, lanes), expected)
    columns = torch.randperm(1000, generator=g)[:300]  # a reduced vocabulary's target ids
    probs = logits.softmax(-1)
    assert torch.equal(minispec.pathwise.lane_gumbel_max(probs, lanes, columns),
                       minispec.pathwise.gumbel_max(probs, keys, positions, columns))


def pathwise_p_value(models, drafter: str, k: int, params: SamplingParams, m: int, **options) -> tuple[float, LLM]:
    """test_speculative_statistical.p_value with every request pathwise (LLM pathwise_sampling="on")."""
    name, lookup = drafter.removesuffix("+lookup"), LOOKUP_MIN if drafter.endswith("+lookup") else None
    named = {"none": None, "ngram": "ngram", "eagle": models["eagle"]}
    draft = named[name] if name in named else (models[name], models["tok"])
    counts, llm = sample_counts(models["target"], draft, k, params, m, models["tok"], lookup=lookup,
                                pathwise_sampling="on", **options)
    pval, stat, df = pooled_chi_square(counts, exact_distribution(models["target"], params, m))
    print(f"\npathwise {drafter} k={k} m={m} {options} {params}: chi2={stat:.1f} df={df} p={pval:.3g} "
          f"acceptance={llm.last_metrics.acceptance_rate:.3f}")
    return pval, llm


TREE = dict(draft_tree_budget=5, draft_tree_top_k=2)
LAW = [  # (drafter, k, params, m, options): every drafted position and the bonus inside the m tokens
    ("none", 1, SP(temperature=1.0), 3, {}),
    ("near", 2, SP(temperature=0.6), 3, {}),  # the mutants below run here
    ("far", 3, SP(temperature=1.0, top_k=5, top_p=0.95, repetition_penalty=1.5), 4, {}),
    ("eagle", 2, SP(temperature=1.0), 4, {}),
    ("near+lookup", 3, SP(temperature=0.9, presence_penalty=0.8), 4, {}),
    ("eagle", 3, SP(temperature=0.8, top_p=0.9), 4, TREE),
]


@pytest.mark.parametrize("drafter,k,params,m,options", LAW, ids=[f"{d}-k{k}-m{m}{'-tree' if o else ''}" for d, k, _, m, o in LAW])
def test_pathwise_speculation_samples_the_target_law(models, drafter, k, params, m, options):
    """Plain and speculative pathwise decoding: the joint law of the m tokens is the target's
    autoregressive law (chi-square p > ALPHA); drafts were both accepted and rejected."""
    pval, llm = pathwise_p_value(models, drafter, k, params, m, **options)
    assert pval > ALPHA
    if drafter != "none":
        assert 0 < llm.last_metrics.acceptance_rate < 1


def noise_reused_across_positions(monkeypatch):
    """(a) every position draws the noise of position 0 (the host's noise and the lanes a step
    uploads for the device, the drafter's and the verifier's)."""
    lanes = minispec.pathwise.noise_lanes
    at_zero = lambda keys, positions: lanes(keys, [0] * len(positions))  # noqa: E731
    monkeypatch.setattr(minispec.pathwise, "noise", lambda keys, positions, ids: noise(keys, [0] * len(positions), ids))
    monkeypatch.setattr(minispec.pathwise, "noise_lanes", at_zero)  # (gumbel_max's race over every column)
    monkeypatch.setattr(minispec.speculative, "noise_lanes", at_zero)
    monkeypatch.setattr(minispec.drafters.draft_loop_on_device, "noise_lanes", at_zero)


def noise_keyed_by_step(monkeypatch):
    """(b) noise keyed by the step (the position of its first new token) instead of each row's
    position: a verification's rows share one noise (plain decoding, one position a step, is
    unaffected). On the device: the verifier's lanes, uploaded per sequence for its positions
    len(s) .. len(s) + K (speculative.stage_rule), are all those of len(s)."""
    original, lanes = minispec.pathwise.verify, minispec.pathwise.noise_lanes

    def by_step(logits, params, keys, lengths, draft_lists, first_rows):
        def step_noise(keys_, positions, ids):  # every row of sequence b: the noise of lengths[b]
            return noise(keys_, [lengths[keys.index(k)] for k in keys_], ids)

        def step_lanes(keys_, positions):  # (the lanes of gumbel_max's race over every column)
            return lanes(keys_, [lengths[keys.index(k)] for k in keys_])

        monkeypatch.setattr(minispec.pathwise, "noise", step_noise)
        monkeypatch.setattr(minispec.pathwise, "noise_lanes", step_lanes)
        try:
            return original(logits, params, keys, lengths, draft_lists, first_rows)
        finally:
            monkeypatch.setattr(minispec.pathwise, "noise", noise)
            monkeypatch.setattr(minispec.pathwise, "noise_lanes", lanes)

    monkeypatch.setattr(minispec.speculative, "pathwise_verify", by_step)
    at_first = lambda keys, positions: lanes(keys, positions[:1] * len(positions))  # noqa: E731
    monkeypatch.setattr(minispec.speculative, "noise_lanes", at_first)


def verifier_trusts_the_drafters_noise(monkeypatch):
    """(c) the drafter draws with other noise (another position's) and reports its draft as the
    target's choice under that noise; the verifier accepts a draft equal to the target's
    Gumbel-max under the DRAFTER's noise, and emits the target's own at the first mismatch.
    (Planted in the host path's verifier, a function of its own to replace: the steps go there.)"""
    monkeypatch.setattr(minispec.speculative, "needs_host", lambda seq: True)
    other = lambda positions: [p + 1000 for p in positions]  # noqa: E731
    gumbel_max = minispec.pathwise.gumbel_max
    monkeypatch.setattr(minispec.drafters.base, "gumbel_max",
                        lambda probs, keys, positions, ids=None: gumbel_max(probs, keys, other(positions), ids))

    def trusting(logits, params, keys, lengths, draft_lists, first_rows):
        tokens, num_accepted = [], []
        for b, drafts in enumerate(draft_lists):
            rows = logits[first_rows[b] : first_rows[b] + len(drafts) + 1]
            probs = warp_probs(rows, [params[b]] * len(rows))
            positions = [lengths[b] + j for j in range(len(rows))]
            reported = gumbel_max(probs, [keys[b]] * len(rows), other(positions)).tolist()
            own = gumbel_max(probs, [keys[b]] * len(rows), positions).tolist()
            n = 0
            while n < len(drafts) and drafts[n] == reported[n]:
                n += 1
            tokens.append(drafts[:n] + [own[n]])
            num_accepted.append(n)
        return tokens, num_accepted

    monkeypatch.setattr(minispec.speculative, "pathwise_verify", trusting)


MUTANTS = [noise_reused_across_positions, noise_keyed_by_step, verifier_trusts_the_drafters_noise]


@pytest.mark.parametrize("mutant", MUTANTS, ids=[m.__name__ for m in MUTANTS])
def test_statistic_rejects_planted_pathwise_bugs(models, monkeypatch, mutant):
    """Power: each mutant's samples are REJECTED (p < ALPHA) in the configuration the real code
    passes (near draft, k = 2, T = 0.6, m = 3)."""
    assert LAW[1] == ("near", 2, SP(temperature=0.6), 3, {})
    mutant(monkeypatch)
    pval, _ = pathwise_p_value(models, "near", 2, SP(temperature=0.6), 3)
    assert pval < ALPHA


# --- where the option is plumbed ----------------------------------------------------------------


def test_the_command_line_and_the_server_plumb_pathwise_sampling(tiny_llama):
    """`minispec serve` samples seeded requests pathwise unless told (--pathwise-sampling), the
    other commands do not; a request body's "pathwise" reaches its SamplingParams (a boolean)."""
    from minispec import cli
    from minispec.server.protocol import ApiError, parse_completion

    def options(*argv: str) -> dict:
        args = cli.build_parser().parse_args([*argv, "--target", str(tiny_llama), "--draft", "ngram"])
        return cli.check_args(args)[3]

    assert options("serve")["pathwise_sampling"] == "seeded"
    assert options("serve", "--pathwise-sampling", "off")["pathwise_sampling"] == "off"
    assert options("generate", "hi")["pathwise_sampling"] == "off"
    assert options("generate", "hi", "--pathwise-sampling", "on")["pathwise_sampling"] == "on"
    assert parse_completion({"prompt": "hi", "pathwise": True}, 512).params.pathwise is True
    assert parse_completion({"prompt": "hi"}, 512).params.pathwise is None
    with pytest.raises(ApiError) as e:
        parse_completion({"prompt": "hi", "pathwise": "yes"}, 512)
    assert e.value.param == "pathwise"
