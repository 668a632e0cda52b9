"""Full pipeline, statistically: `LLM.generate` with speculation samples exactly what the target
alone would sample.

Setting. A tiny random target (vocabulary V = 6, one layer, logits scaled up so distributions are
far from uniform and depend on the context) and two drafts: a perturbed copy of the target
(acceptance ~0.6-0.8) and an independent random model (low acceptance), plus the n-gram drafter,
an EAGLE-3 head (random, reading the target's hidden states) whose draft vocabulary holds 4 of
the 6 tokens, so the target puts mass where q is 0, and prompt lookup in front of a draft model
or of the head ("+lookup", drafters/lookup.py: one-hot q on some steps, the model's on others), and int4
drafts (fast/int4.py) in front of the full-precision target, one with a reduced vocabulary (FR-Spec).
For each configuration we sample N = 2000 requests of m tokens in one batch, each with its own
seed, and compare the empirical distribution of the m-token continuations with the exact one,
P(y_1..y_m) = prod_j warp(target logits | prompt, y_<j)(y_j), computed by enumerating all V^m
continuations with a cache-free dense forward of the target (a second attention implementation,
independent of the paged KV cache, the rollback and the drafters under test).

Statistic. Pearson chi-square over the V^m cells; cells with expected count < 5 are pooled (in
order of expected count, a data-independent partition) into bins of expected count >= 5; any
count in a cell of probability 0 (e.g. a token outside top-k) is an outright rejection. The
p-value is the chi-square survival function, torch.special.gammaincc in fp64 (checked below
against closed forms). Significance level ALPHA = 1e-3, fixed seeds: every run is deterministic.

Power. The same statistic at the same ALPHA must REJECT each planted bug (mutants of
minispec.speculative / minispec.drafters, monkeypatched): no residual, always accept, bonus from
the wrong position, temperature missing from the target's p, a draft that samples from one q
but reports another, a hybrid that reports no q (zeros) for its looked-up tokens, and penalties
applied by the verifier with a stale history (without the drafts before each position), and an
int4 draft that samples from its unquantized weights' law but reports its int4 q. A control shows what is NOT a bug: a draft that consistently ignores the
temperature is still exact (speculative sampling is exact for any q it is told truthfully).
"""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

import minispec.drafters.base
import minispec.drafters.draft_loop_on_device
import minispec.drafters.lookup
import minispec.core.speculative
import minispec.speculative
from minispec import LLM, AttentionBackend, BatchMetadata, ModelConfig, SamplingParams, Tokenizer, Transformer
from minispec.drafters.base import Drafter
from minispec.drafters.draft_model import ModelDrafter
from minispec.drafters.reduced_vocab import reduce_vocab
from minispec.fast.int4 import cpu_int4_available, quantize_int4_model
from minispec.fast.int8 import quantize_model
from minispec.model.eagle import init_eagle
from minispec.penalties import penalize
from minispec.sampling import WarpParams, sample, warp_probs

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: a 2nd OpenMP thread only contends

ALPHA = 1e-3  # significance level of every test in this file
N = 2000  # requests per configuration
V = 6  # vocabulary size
PROMPT = [1, 2, 3, 1, 2]  # repeats, so the n-gram drafter finds matches
EAGLE_VOCAB = torch.tensor([0, 2, 3, 5])  # the EAGLE head's draft vocabulary: tokens 1 and 4 are outside
MIN_EXPECTED = 5.0  # chi-square cells are pooled up to this expected count


# --- the statistic ------------------------------------------------------------------------------


def chi2_sf(x: float, df: int) -> float:
    """P(X >= x) for X ~ chi-square(df): the regularized upper incomplete gamma Q(df/2, x/2)."""
    return torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(x / 2, dtype=torch.float64)).item()


def pooled_chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, float, int]:
    """Pearson chi-square of observed `counts` [C] against cell probabilities `probs` [C].

    Returns (p_value, statistic, df). Cells with expected count < MIN_EXPECTED are merged, in
    increasing order of expected count, into bins reaching MIN_EXPECTED (an underfull last bin
    joins the previous one). Counts in zero-probability cells give p = 0.
    """
    counts, probs = counts.double().flatten(), probs.double().flatten()
    n = counts.sum().item()
    if counts[probs == 0].sum() > 0:
        return 0.0, math.inf, 0
    expected = probs * n
    big = expected >= MIN_EXPECTED
    obs_bins, exp_bins = counts[big].tolist(), expected[big].tolist()
    small_obs, small_exp = [], []
    order = torch.argsort(expected)
    o_acc = e_acc = 0.0
    for i in order[~big[order] & (probs[order] > 0)].tolist():
        o_acc, e_acc = o_acc + counts[i].item(), e_acc + expected[i].item()
        if e_acc >= MIN_EXPECTED:
            small_obs.append(o_acc), small_exp.append(e_acc)
            o_acc = e_acc = 0.0
    if e_acc > 0:  # leftover below MIN_EXPECTED: fold into a neighbouring bin
        if small_obs:
            small_obs[-1] += o_acc
            small_exp[-1] += e_acc
        else:
            i = min(range(len(exp_bins)), key=lambda j: exp_bins[j])
            obs_bins[i] += o_acc
            exp_bins[i] += e_acc
    obs = torch.tensor(obs_bins + small_obs, dtype=torch.float64)
    exp = torch.tensor(exp_bins + small_exp, dtype=torch.float64)
    stat = ((obs - exp) ** 2 / exp).sum().item()
    df = len(obs) - 1
    return (chi2_sf(stat, df) if df > 0 else 1.0), stat, df


def test_chi2_survival_function_matches_closed_forms():
    """gammaincc gives the chi-square tail to ~1e-8 relative: exact forms are erfc for df = 1 and
    a finite Poisson sum for even df."""
    for x in (0.3, 1.0, 4.0, 10.83, 25.0):
        assert chi2_sf(x, 1) == pytest.approx(math.erfc(math.sqrt(x / 2)), rel=1e-8)
    for df in (2, 4, 10, 50, 200):
        for x in (0.5 * df, df, df + 3 * math.sqrt(2 * df), df + 6 * math.sqrt(2 * df)):
            exact = math.exp(-x / 2) * sum((x / 2) ** i / math.factorial(i) for i in range(df // 2))
            assert chi2_sf(x, df) == pytest.approx(exact, rel=1e-7)


def test_pooled_chi_square_accepts_the_truth_and_rejects_a_small_shift():
    """The statistic itself, on multinomial draws: p > ALPHA for the true law, p < ALPHA for a law
    moved by 0.02 in total variation; mass in a zero-probability cell rejects outright."""
    g = torch.Generator().manual_seed(0)
    probs = torch.tensor([0.5, 0.2, 0.1, 0.1, 0.05, 0.03, 0.015, 0.005, 0.0])
    shifted = probs + torch.tensor([-0.02, 0.02, 0, 0, 0, 0, 0, 0, 0])
    draw = lambda law, n: torch.bincount(torch.multinomial(law, n, replacement=True, generator=g), minlength=9)  # noqa: E731
    assert pooled_chi_square(draw(probs, 20000), probs)[0] > ALPHA
    assert pooled_chi_square(draw(shifted, 20000), probs)[0] < ALPHA
    counts = draw(probs, 1000)
    counts[-1] += 1
    assert pooled_chi_square(counts, probs)[0] == 0.0


# --- tiny models --------------------------------------------------------------------------------

CFG = ModelConfig(
    architecture="llama", vocab_size=V, hidden_size=32, intermediate_size=64, num_layers=1,
    num_heads=2, num_kv_heads=1, head_dim=16, max_position_embeddings=64,
)


def random_target(seed: int) -> Transformer:
    """Random init, with the output and attention scaled up: peaked, context-dependent p."""
    torch.manual_seed(seed)
    model = Transformer(CFG, backend=minispec.AttentionBackend("torch")).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)
        for layer in model.layers:
            layer.self_attn.q_proj.weight.mul_(3.0)
            layer.self_attn.o_proj.weight.mul_(3.0)
    return model


def perturbed(model: Transformer, sigma: float, seed: int) -> Transformer:
    """A copy with Gaussian noise of sigma x each weight tensor's std: a good but imperfect draft."""
    torch.manual_seed(seed)
    draft = copy.deepcopy(model)
    with torch.no_grad():
        for w in draft.parameters():
            w.add_(sigma * w.std() * torch.randn_like(w))
    return draft


def word_tokenizer() -> Tokenizer:
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers

    tok = HFTokenizer(models.WordLevel({f"w{i}": i for i in range(V)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return Tokenizer(tok, eos_token_ids=[])



@pytest.fixture(scope="module")
def models():
    target = random_target(0)
    eagle = init_eagle(target, EAGLE_VOCAB, aux_layers=(0, 1, 1), seed=5)
    with torch.no_grad():
        eagle.lm_head.weight.mul_(2.0)  # acceptance ~0.3: the mutants' q matters often enough to be seen
    return {"target": target, "near": perturbed(target, 0.3, 1), "far": random_target(2), "tok": word_tokenizer(),
            "eagle": eagle}


class DenseCausal(AttentionBackend):
    """Attention for B equal-length, cache-free sequences with plain SDPA (reference only); the
    rest of the layer (norms, RoPE, SwiGLU) as the torch backend runs it."""

    def __init__(self, seq_len: int):
        super().__init__("torch")
        self.seq_len = seq_len

    def __call__(self, q, k, v, kv_cache, meta, sm_scale, sliding_window):
        T, Hq, D = q.shape
        B, L, group = T // self.seq_len, self.seq_len, Hq // k.shape[1]
        q, k, v = (x.view(B, L, -1, D).transpose(1, 2) for x in (q, k, v))  # [B, H, L, D]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # [B, Hq, L, D]
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=sm_scale)  # [B, Hq, L, D]
        return out.transpose(1, 2).reshape(T, Hq, D)


def dense_logits(model: Transformer, seqs: torch.Tensor) -> torch.Tensor:
    """seqs [B, L] -> logits [B, L, V] at every position, without any KV cache. A quantized model
    runs its own (batch-invariant) backend: through int8 activations another attention's rounding
    would be a slightly different model."""
    B, L = seqs.shape
    meta = BatchMetadata.for_prompts([L] * B)
    if getattr(model, "quantization", None):
        return model(seqs.flatten(), meta).view(B, L, V)
    backend, model.backend = model.backend, DenseCausal(L)
    try:
        logits = model(seqs.flatten(), meta)  # [B * L, V]
    finally:
        model.backend = backend
    few = min(B, 4)  # the dense reference is the same model as the product's own backend computes
    mine = model(seqs[:few].flatten(), BatchMetadata.for_prompts([L] * few))
    torch.testing.assert_close(logits[: few * L], mine, rtol=1e-4, atol=1e-4)
    return logits.view(B, L, V)


def exact_distribution(model: Transformer, params: SamplingParams, m: int, prompt=PROMPT) -> torch.Tensor:
    """P(y_1..y_m) of plain autoregressive sampling, [V^m] fp64, y_1 the most significant digit."""
    if m == 1:
        conts = torch.zeros(1, 0, dtype=torch.int64)
    else:
        conts = torch.cartesian_prod(*[torch.arange(V)] * (m - 1)).view(-1, m - 1)  # [V^(m-1), m-1]
    seqs = torch.cat([torch.tensor(prompt).expand(len(conts), -1), conts], dim=1)  # [V^(m-1), P+m-1]
    logits = dense_logits(model, seqs)[:, len(prompt) - 1 :].reshape(-1, V)  # [V^(m-1) * m, V]
    # penalties / min_tokens: row (c, j) sees the prompt and c's first j tokens
    logits = penalize(logits, [(params, len(prompt), list(prompt) + c[:j], []) for c in conts.tolist() for j in range(m)])
    probs = warp_probs(logits, [params] * (len(conts) * m)).double().view(-1, m, V)
    prefix = probs[:, : m - 1].gather(-1, conts[..., None]).squeeze(-1).prod(-1)  # [V^(m-1)]
    return (prefix[:, None] * probs[:, m - 1]).flatten()  # [V^m]


def sample_counts(target, draft, k: int, params: SamplingParams, m: int, tok, n: int = N, threshold: float | None = None,
                  lookup: int | None = None, **options):
    """Generate n requests of m tokens (seeds 0..n-1) in one batch; counts [V^m] and the LLM.
    threshold: the draft's confidence threshold (adaptive draft length), None for fixed k;
    lookup: prompt_lookup_min (prompt lookup first, the draft where it finds nothing);
    options: more LLM options, or other values for these (a draft tree's, a bigger KV budget)."""
    llm = LLM(**{
        "model": (target, tok), "draft_model": draft, "num_speculative_tokens": k if draft is not None else None,
        "max_num_seqs": n, "max_num_batched_tokens": n * (len(PROMPT) + m + k), "kv_cache_gib": 0.02, "page_size": 8,
        "draft_confidence_threshold": threshold, "prompt_lookup_min": lookup, **options,
    })
    requests = [dataclasses.replace(params, max_tokens=m, seed=i, ignore_eos=True) for i in range(n)]
    outs = llm.generate([PROMPT] * n, requests)
    ids = torch.tensor([o.token_ids for o in outs])  # [n, m]
    index = (ids * V ** torch.arange(m - 1, -1, -1)).sum(-1)  # [n]
    return torch.bincount(index, minlength=V**m), llm


LOOKUP_MIN = 2  # "<drafter>+lookup": prompt lookup of >= 2 tokens first (PROMPT repeats "1 2"), the drafter otherwise


def p_value(models, drafter: str, k: int, params: SamplingParams, m: int, threshold: float | None = None) -> tuple[float, LLM]:
    name, lookup = drafter.removesuffix("+lookup"), LOOKUP_MIN if drafter.endswith("+lookup") else None
    if name in ("none", "ngram", "eagle"):
        draft = {"none": None, "ngram": "ngram", "eagle": models["eagle"]}[name]
    else:
        draft = (models[name], models["tok"])
    counts, llm = sample_counts(models["target"], draft, k, params, m, models["tok"], threshold=threshold, lookup=lookup)
    metrics = llm.last_metrics
    pval, stat, df = pooled_chi_square(counts, exact_distribution(models["target"], params, m))
    print(f"\n{drafter} k={k} m={m} threshold={threshold} {params}: chi2={stat:.1f} df={df} p={pval:.3g} "
          f"acceptance={metrics.acceptance_rate:.3f} per_position={[round(x, 2) for x in metrics.per_position_acceptance]}")
    return pval, llm


# --- the correct implementation passes ----------------------------------------------------------

SP = SamplingParams
PENALISED = SP(temperature=1.0, repetition_penalty=2.0, presence_penalty=1.0, frequency_penalty=0.8)
CASES = [
    # (drafter, k, params, m generated tokens): every drafted position, the rejection and the
    # bonus paths are inside the m tokens (the first step drafts min(k, m - 1) tokens; an EAGLE
    # head drafts from the second step on, min(k, m - 2), so its cases take one token more).
    ("none", 1, SP(temperature=1.0), 3),
    ("none", 1, SP(temperature=0.7, top_k=4, top_p=0.9), 3),
    ("near", 1, SP(temperature=1.0), 3),
    ("near", 2, SP(temperature=0.6), 3),  # the configuration the mutants below run in
    ("near", 2, SP(temperature=1.3, top_k=3), 3),
    ("far", 2, SP(temperature=1.0, top_k=5, top_p=0.95), 3),
    ("ngram", 2, SP(temperature=1.0), 3),
    ("ngram", 1, SP(temperature=0.9, top_k=5, top_p=0.95), 3),
    ("near", 3, SP(temperature=0.8, top_p=0.9), 4),
    ("ngram", 4, SP(temperature=1.2, top_k=4), 5),
    ("near", 5, SP(temperature=1.0, top_k=5), 6),
    ("eagle", 2, SP(temperature=0.6), 4),  # the EAGLE mutants below run here
    ("eagle", 3, SP(temperature=1.0, top_k=5, top_p=0.95), 5),
    ("eagle", 1, SP(temperature=1.3), 3),
    ("near+lookup", 2, SP(temperature=0.6), 3),  # the lookup mutant below runs here
    ("eagle+lookup", 3, SP(temperature=1.0, top_k=5, top_p=0.95), 5),
    # penalties and min_tokens, applied at every position with the drafts before it
    ("none", 1, SP(temperature=0.9, repetition_penalty=1.8, presence_penalty=0.8), 3),
    ("near", 2, PENALISED, 3),  # the stale-history mutant below runs here
    ("eagle", 2, SP(temperature=1.0, repetition_penalty=1.5, frequency_penalty=0.7), 4),
    ("ngram", 2, SP(temperature=1.0, presence_penalty=1.2, top_k=5), 3),
    ("near+lookup", 3, SP(temperature=1.0, repetition_penalty=0.6, frequency_penalty=-0.5), 4),
    ("near", 2, SP(temperature=1.0, min_tokens=2, stop_token_ids=[3], repetition_penalty=1.3), 3),
]


@pytest.mark.parametrize("drafter,k,params,m", CASES, ids=[f"{d}-k{k}-m{m}-T{p.temperature}-k{p.top_k}-p{p.top_p}" for d, k, p, m in CASES])
def test_generated_sequences_follow_the_target_distribution(models, drafter, k, params, m):
    """Speculative (model or n-gram drafter, any k) and plain decoding: the joint law of the m
    generated tokens is the target's autoregressive law (chi-square p > ALPHA)."""
    pval, llm = p_value(models, drafter, k, params, m)
    assert pval > ALPHA
    if drafter != "none":
        assert 0 < llm.last_metrics.acceptance_rate < 1  # both the accept and the reject paths were taken
    if drafter.endswith("+lookup"):  # both halves of the hybrid drafted, many times
        assert min(llm.engine.drafter.lookup_drafts, llm.engine.drafter.model_drafts) > N // 4


@pytest.fixture(scope="module")
def int8_models(models):
    """The same models with int8 weights and per-row activation scales (fast/int8.py)."""
    target = quantize_model(copy.deepcopy(models["target"]))
    eagle = copy.deepcopy(models["eagle"])
    eagle.embed_weight = target.embed_tokens.weight
    return {"target": target, "near": quantize_model(copy.deepcopy(models["near"])), "tok": models["tok"],
            "eagle": quantize_model(eagle)}


INT8_CASES = [("near", 2, SP(temperature=0.6), 3), ("eagle", 2, SP(temperature=1.0, top_k=5, top_p=0.95), 4),
              ("ngram", 2, SP(temperature=1.0), 3)]


@pytest.mark.parametrize("drafter,k,params,m", INT8_CASES, ids=[f"{d}-k{k}-m{m}" for d, k, _, m in INT8_CASES])
def test_with_int8_weights_the_law_is_the_int8_targets(int8_models, drafter, k, params, m):
    """Quantization changes the target, not the exactness: speculative decoding with int8 target
    and draft samples the int8 target's autoregressive law (chi-square p > ALPHA)."""
    pval, llm = p_value(int8_models, drafter, k, params, m)
    assert pval > ALPHA
    assert 0 < llm.last_metrics.acceptance_rate < 1


def with_outliers(model: Transformer, scale: float) -> Transformer:
    """A copy whose every 32nd input column of each linear layer is `scale` x larger: the outliers
    LLM weights have, which stretch an int4 group's range so its other weights lose precision.
    Its int4 law is then far from its own (TV ~0.14 at scale 8), what a planted bug must show."""
    model = copy.deepcopy(model)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.Linear):
                m.weight[:, ::32] *= scale
    return model


@pytest.fixture(scope="module")
def int4_models(models):
    """The full-precision target with int4 drafts (fast/int4.py): the near draft, and a draft with
    weight outliers (the unquantized one kept as "outlier_fp", for the mutant below)."""
    if not cpu_int4_available():
        pytest.skip("this torch build has no CPU int4 kernel")
    outlier = with_outliers(models["near"], 8.0)
    reduced = quantize_int4_model(reduce_vocab(copy.deepcopy(models["near"]), EAGLE_VOCAB))  # FR-Spec: q = 0 on 1 and 4
    return {"target": models["target"], "near": quantize_int4_model(copy.deepcopy(models["near"])),
            "outlier": quantize_int4_model(copy.deepcopy(outlier)), "outlier_fp": outlier, "tok": models["tok"],
            "reduced": reduced}


INT4_CASES = [("near", 2, SP(temperature=0.6), 3), ("outlier", 2, SP(temperature=0.6), 3),  # the mutant below runs here
              ("near", 3, SP(temperature=1.0, top_k=5, top_p=0.95), 4), ("outlier", 4, SP(temperature=1.2), 5),
              ("reduced", 2, SP(temperature=1.0), 3), ("reduced", 3, SP(temperature=0.8, top_p=0.9), 4)]


@pytest.mark.parametrize("drafter,k,params,m", INT4_CASES, ids=[f"{d}-k{k}-m{m}" for d, k, _, m in INT4_CASES])
def test_an_int4_draft_keeps_the_full_precision_targets_law(int4_models, drafter, k, params, m):
    """A quantized DRAFT is just another q: the m tokens follow the (unquantized) target's law
    (chi-square p > ALPHA), whatever the quantization did to the draft."""
    pval, llm = p_value(int4_models, drafter, k, params, m)
    assert pval > ALPHA
    assert 0 < llm.last_metrics.acceptance_rate < 1
    assert any(type(x).__name__ == "Int4Linear" for x in int4_models[drafter].modules())
    if drafter == "reduced":  # a reduced vocabulary (drafters/reduced_vocab.py): q = 0 off EAGLE_VOCAB
        assert torch.equal(llm.engine.drafter.draft_ids, EAGLE_VOCAB)


def samples_unquantized_reports_int4(monkeypatch, unquantized: Transformer):
    """(h) the int4 draft runs (its KV cache, its logits, the q it reports), but each token is drawn
    from the UNquantized draft's law at the same context (a cache-free forward): a drafter that
    samples with one copy of its weights and reports another's q."""
    stash = {}
    first, following = ModelDrafter.first_forward, ModelDrafter.next_forward

    def full_precision(contexts: list[list[int]]) -> torch.Tensor:
        return torch.stack([dense_logits(unquantized, torch.tensor([c]))[0, -1] for c in contexts])  # [n, V]

    def first_forward(self, seqs, active):
        stash["logits"] = full_precision([seqs[b].tokens for b in active])
        return first(self, seqs, active)

    def next_forward(self, seqs, active, tokens, carry):
        stash["logits"] = full_precision([seqs[b].tokens + tokens[b] for b in active])
        return following(self, seqs, active, tokens, carry)

    def warp(logits, params):
        stash["params"] = params
        return warp_probs(logits, params)  # the int4 q, reported

    monkeypatch.setattr(ModelDrafter, "first_forward", first_forward)
    monkeypatch.setattr(ModelDrafter, "next_forward", next_forward)
    # (the mutant reads each context on the host: it drafts with the host loop, `propose`)
    monkeypatch.setattr(ModelDrafter, "stage", Drafter.stage)
    monkeypatch.setattr(ModelDrafter, "run_staged", Drafter.run_staged)
    monkeypatch.setattr(minispec.drafters.base, "warp_probs", warp)
    monkeypatch.setattr(minispec.drafters.base, "sample",
                        lambda probs, u: sample(warp_probs(stash["logits"], stash["params"]), u))


def test_statistic_rejects_a_draft_that_samples_unquantized_and_reports_int4_q(int4_models, monkeypatch):
    """Power for the quantized draft: (h) is REJECTED (p < ALPHA) where the real code passes."""
    assert ("outlier", 2, SP(temperature=0.6), 3) in INT4_CASES
    samples_unquantized_reports_int4(monkeypatch, int4_models["outlier_fp"])
    pval, _ = p_value(int4_models, "outlier", 2, SP(temperature=0.6), 3)
    assert pval < ALPHA


ADAPTIVE = [  # (drafter, k, params, m, confidence threshold): draft lengths vary step by step
    ("near", 4, SP(temperature=1.0), 5, 0.6),
    ("far", 3, SP(temperature=0.8, top_k=4), 4, 0.5),
    ("eagle", 3, SP(temperature=1.0), 5, 0.6),  # an EAGLE head drafts from the second step
]


@pytest.mark.parametrize("drafter,k,params,m,threshold", ADAPTIVE, ids=[f"{d}-k{k}-m{m}-conf{t}" for d, k, _, m, t in ADAPTIVE])
def test_adaptive_draft_length_keeps_the_target_distribution(models, drafter, k, params, m, threshold):
    """A draft that stops early after a low-confidence token (a stopping rule that looks only at
    what was already drafted) leaves the joint law of the m tokens the target's (p > ALPHA)."""
    pval, llm = p_value(models, drafter, k, params, m, threshold)
    metrics = llm.last_metrics
    assert pval > ALPHA
    drafted = metrics.drafted_per_position
    # The rule really varied the length: some steps stopped at position 1, some went further.
    assert len(drafted) >= 2 and drafted[0] > drafted[1] > 0
    assert 0 < metrics.acceptance_rate < 1


# --- ... and each planted bug is rejected by the same statistic ---------------------------------

MUTANT_PARAMS = SP(temperature=0.6)  # far from 1, so a missing temperature shows
MUTANT_K = 2
MUTANT_M = {"near": 3, "eagle": 4, "near+lookup": 3}  # tokens per request: an EAGLE head drafts from the second step on, so it
# takes one more to draft both positions. (drafter, 2, MUTANT_PARAMS, m) is in CASES: the real code passes it


def _untempered(params: list[SamplingParams] | WarpParams) -> list[SamplingParams] | WarpParams:
    if isinstance(params, WarpParams):  # (the step's device verification passes its rows' tensors)
        return dataclasses.replace(params, temperature=torch.ones_like(params.temperature))
    return [p if p.greedy else dataclasses.replace(p, temperature=1.0) for p in params]


def no_residual(monkeypatch):
    """(a) after a rejection, resample from p instead of norm(max(0, p - q))."""
    monkeypatch.setattr(minispec.core.speculative, "residual_distribution", lambda target_probs, draft_probs: target_probs)


def always_accept(monkeypatch):
    """(b) accept every draft token."""
    monkeypatch.setattr(minispec.core.speculative, "accept_probability", lambda t, d: torch.ones_like(t))


def bonus_off_by_one(monkeypatch):
    """(c) when all n drafts are accepted, draw the bonus from p_n instead of p_{n+1}."""
    original = minispec.core.speculative.rejection_sample

    def broken(draft_tokens, num_draft, draft_probs, target_probs, accept_u, token_u):
        target_probs = target_probs.clone()
        rows = torch.nonzero(num_draft > 0).squeeze(-1)
        target_probs[rows, num_draft[rows]] = target_probs[rows, num_draft[rows] - 1]
        return original(draft_tokens, num_draft, draft_probs, target_probs, accept_u, token_u)

    monkeypatch.setattr(minispec.core.speculative, "rejection_sample", broken)


def target_ignores_temperature(monkeypatch):
    """(d) temperature applied to the draft's q only; the target's p is warped at temperature 1."""
    monkeypatch.setattr(minispec.speculative, "warp_probs", lambda logits, params: warp_probs(logits, _untempered(params)))


# Where a model drafter's draft loop looks up its warp and draw: the host loop (base.py) and the
# loop laid out for the device (draft_loop_on_device.py, the step's default); a mutant plants in both.
DRAFT_LOOPS = (minispec.drafters.base, minispec.drafters.draft_loop_on_device)


def reports_another_q(*modules):
    """(d') a drafter in `modules` samples at the request's temperature but reports q at
    temperature 1 (HF #32867)."""
    def mutant(monkeypatch):
        tempered = {}

        def warp(logits, params):
            tempered["q"] = warp_probs(logits, params)
            return warp_probs(logits, _untempered(params))

        for module in modules:
            monkeypatch.setattr(module, "warp_probs", warp)
            monkeypatch.setattr(module, "sample", lambda probs, u: sample(tempered["q"], u))

    mutant.__name__ = "reports_another_q"
    return mutant


def eagle_ignores_d2t(monkeypatch):
    """(e) the reduced vocabulary's map ignored for the proposed token: draft id i is proposed as
    target id i while q is reported at i + d2t[i] (the reported EAGLE bug class)."""
    def sample_draft_id(probs, u):
        target_ids = sample(probs, u)
        return torch.searchsorted(EAGLE_VOCAB.to(target_ids.device), target_ids)

    for module in DRAFT_LOOPS:
        monkeypatch.setattr(module, "sample", sample_draft_id)


def stale_penalty_history(monkeypatch):
    """(g) the verifier penalises every row with the sequence's tokens only, leaving out the
    drafts before the row (the draft's own penalties are right)."""
    real = minispec.speculative.penalized_on_device

    def stale(target_logits, penalties, draft_tokens, drafted):
        return real(target_logits, penalties, draft_tokens, torch.zeros_like(drafted))

    monkeypatch.setattr(minispec.speculative, "penalized_on_device", stale)


def lookup_reports_no_q(monkeypatch):
    """(f) the hybrid drafter leaves q at 0 for its looked-up tokens (not one-hot): the verifier
    then accepts every one of them."""
    monkeypatch.setattr(minispec.drafters.lookup, "one_hot_q", lambda tokens, vocab_size, device: torch.zeros(len(tokens), vocab_size))


MUTANTS = [("near", no_residual), ("near", always_accept), ("near", bonus_off_by_one),
           ("near", target_ignores_temperature), ("near", reports_another_q(*DRAFT_LOOPS)),
           ("eagle", no_residual), ("eagle", reports_another_q(*DRAFT_LOOPS)), ("eagle", eagle_ignores_d2t),
           ("near+lookup", lookup_reports_no_q)]


@pytest.mark.parametrize("drafter,mutant", MUTANTS, ids=[f"{d}-{m.__name__}" for d, m in MUTANTS])
def test_statistic_rejects_planted_bugs(models, monkeypatch, drafter, mutant):
    """Power: each mutant's samples are REJECTED (p < ALPHA) by the statistic the real code passes."""
    assert (drafter, MUTANT_K, MUTANT_PARAMS, MUTANT_M[drafter]) in CASES  # ... in this very configuration
    mutant(monkeypatch)
    pval, _ = p_value(models, drafter, MUTANT_K, MUTANT_PARAMS, MUTANT_M[drafter])
    assert pval < ALPHA


def test_statistic_rejects_a_stale_penalty_history(models, monkeypatch):
    """Power for penalties: the verifier penalising position j without the j drafts before it
    (what a per-sequence, not per-position, penalty does) is REJECTED (p < ALPHA)."""
    assert ("near", 2, PENALISED, 3) in CASES  # the real code passes this very configuration
    stale_penalty_history(monkeypatch)
    pval, _ = p_value(models, "near", 2, PENALISED, 3)
    assert pval < ALPHA


def test_a_draft_that_ignores_temperature_consistently_is_still_exact(models, monkeypatch):
    """Control, not a bug: the draft samples and reports the same (untempered) q; exactness
    holds for any q, only the acceptance rate changes."""
    for module in DRAFT_LOOPS:
        monkeypatch.setattr(module, "warp_probs", lambda logits, params: warp_probs(logits, _untempered(params)))
    pval, _ = p_value(models, "near", MUTANT_K, MUTANT_PARAMS, MUTANT_M["near"])
    assert pval > ALPHA


def test_n_completions_of_one_request_follow_the_target_law(models):
    """SamplingParams(n=N, seed=0): N completions of ONE request, sampled independently (seeds 0..N-1),
    follow the target's law (p > ALPHA) and equal N requests seeded 0..N-1."""
    params = SP(temperature=0.8, n=N, seed=0, max_tokens=3, ignore_eos=True)
    llm = LLM(model=(models["target"], models["tok"]), draft_model=(models["near"], models["tok"]), num_speculative_tokens=2,
              max_num_seqs=N, max_num_batched_tokens=N * (len(PROMPT) + 5), kv_cache_gib=0.02, page_size=8)
    out = llm.generate([PROMPT], params)[0]
    assert len(out.outputs) == N and [c.index for c in out.outputs] == list(range(N))
    ids = torch.tensor([c.token_ids for c in out.outputs])  # [N, 3]
    counts = torch.bincount((ids * V ** torch.arange(2, -1, -1)).sum(-1), minlength=V**3)
    pval, _, _ = pooled_chi_square(counts, exact_distribution(models["target"], params, 3))
    assert pval > ALPHA
    single = [dataclasses.replace(params, n=1, seed=i) for i in range(50)]
    assert [o.token_ids for o in llm.generate([PROMPT] * 50, single)] == [c.token_ids for c in out.outputs[:50]]
