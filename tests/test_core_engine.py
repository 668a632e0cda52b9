"""The core (minispec/core/) is a complete engine by itself, small enough to read end to end, and
the full engine is built on it.

What is checked here:
  * the learner's path: the core is at most 1,500 lines in at most 12 files (kernels not
    counted), imports only torch, numpy, the standard library and the kernels, has no import
    cycle, and names no production feature (the words below, in code and docstrings alike);
  * exactness of the bare core: greedy speculative decoding (a draft model, n-gram) emits plain
    decoding's tokens, and the full engine emits the same tokens on the same weights; sampled
    speculative decoding follows the target's law (the chi-square harness of
    test_speculative_statistical.py, ALPHA = 1e-3, fixed seeds), and the same statistic rejects
    planted bugs in the core's rule (power); a seeded request samples the same tokens alone and
    in a batch.
The rule itself (accept_probability, residual_distribution, rejection_sample, greedy_verify) is
the core's, and the full engine calls it: test_speculative_exact.py enumerates it, and the
planted bugs of test_speculative_statistical.py patch it in minispec.core.speculative, so both
engines are tested through it.
"""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import pytest
import torch

import minispec.core.speculative
from minispec import LLM
from minispec.core.drafters import DraftModelDrafter, NgramDrafter
from minispec.core.engine import Engine
from minispec.core.kv_cache import KVCache
from minispec.core.model import AttentionBackend, Transformer
from minispec.core.runner import ModelRunner
from minispec.core.sampling import SamplingParams
from minispec.core.sampling import warp_probs as core_warp
from test_speculative_statistical import ALPHA, CFG, PROMPT, V, exact_distribution, pooled_chi_square

CORE = Path(minispec.core.speculative.__file__).parent
CORE_FILES = sorted(CORE.glob("*.py"))
FEATURE_WORDS = ["prefix", "chunk", "by load", "by_load", "tree", "eagle", "lookup", "reduced", "vocab_ids",
                 "int4", "int8", "quantiz", "invariant", "static", "graph", "metric", "penalt", "min_tokens",
                 "stop_str", "stop string", "logprob", "detokeniz", "tokenizer", "pathwise", "gumbel", "server",
                 "scratch", "hidden_layers", "feature", "calloc"]
STDLIB = {"__future__", "collections", "dataclasses", "enum", "itertools", "math", "os", "typing"}
N = 2000  # requests per chi-square configuration, as in test_speculative_statistical.py

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: a 2nd OpenMP thread only contends


def test_the_core_fits_a_readers_afternoon():
    """At most 1,500 lines of Python (blank lines not counted) in at most 12 files: the size of
    nano-vllm's engine with its model. Printed: the lines per file, with and without blanks."""
    lines = {f.name: f.read_text().splitlines() for f in CORE_FILES}
    written = {name: sum(1 for line in text if line.strip()) for name, text in lines.items()}
    print({name: (written[name], len(text)) for name, text in lines.items()})
    print(f"{sum(written.values())} lines, {sum(len(t) for t in lines.values())} with blank lines")
    assert len(lines) <= 12
    assert sum(written.values()) <= 1500


def core_imports(path: Path) -> list[tuple[str, int]]:
    """(module, level) of every import in a file, functions' bodies included."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(a.name, 0) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            found.append((node.module or "", node.level))
    return found


def test_the_core_imports_only_torch_numpy_the_kernels_and_itself():
    for f in CORE_FILES:
        for module, level in core_imports(f):
            top = module.split(".")[0]
            ours = module.startswith(("minispec.core", "minispec.kernels"))
            allowed = level == 1 or ours or top in {"torch", "numpy"}
            assert allowed or top in STDLIB, f"{f.name} imports {'.' * level}{module}"


def test_the_core_has_no_import_cycle():
    graph = {f.stem: {m.split(".")[0] for m, level in core_imports(f) if level == 1 and m} for f in CORE_FILES}
    done, visiting = set(), []

    def visit(name):
        assert name not in visiting, f"import cycle: {' -> '.join(visiting + [name])}"
        if name in done:
            return
        visiting.append(name)
        for dep in graph.get(name, ()):
            visit(dep)
        visiting.pop()
        done.add(name)

    for name in graph:
        visit(name)


def test_the_core_names_no_production_feature():
    """Features plug in from outside; the core never names one (code, comments, docstrings)."""
    for f in CORE_FILES:
        text = f.read_text().lower()
        for word in FEATURE_WORDS:
            hits = [i + 1 for i, line in enumerate(text.splitlines()) if re.search(r"\b" + re.escape(word), line)]
            assert not hits, f"{f.name} names {word!r} on lines {hits}"


def test_the_feature_words_are_found_where_they_are():
    """Power of the grep: the production files that hold each feature do name it."""
    root = CORE.parent
    for word, where in [("prefix", "runtime/prefix_cache.py"), ("tree", "speculative_tree.py"),
                        ("pathwise", "pathwise.py"), ("penalt", "penalties.py"), ("eagle", "drafters/eagle.py")]:
        assert word in (root / where).read_text().lower()


# --- exactness of the bare core -----------------------------------------------------------------


def core_model(seed: int, sigma: float = 0.0) -> Transformer:
    """test_speculative_statistical's random target (seed 0), or a copy perturbed by sigma x each
    weight's std: the same weights in the core's own Transformer on the torch twins."""
    from test_speculative_statistical import perturbed, random_target

    source = random_target(seed) if not sigma else perturbed(random_target(0), sigma, seed)
    model = Transformer(CFG, backend=AttentionBackend("torch")).eval()
    model.load_state_dict(source.state_dict())
    return model


def core_engine(drafter: str, k: int, num_seqs: int, draft_sigma: float = 0.3) -> Engine:
    def runner(model):
        pages = num_seqs * (-(-(CFG.max_position_embeddings + k) // 8))
        return ModelRunner(model, KVCache(CFG, pages, 8, torch.float32, torch.device("cpu")))

    target = runner(core_model(0))
    if drafter == "draft":
        draft = runner(core_model(1, draft_sigma))
        return Engine(target, DraftModelDrafter(draft), draft, k, max_num_seqs=num_seqs,
                      max_num_batched_tokens=num_seqs * 16)
    if drafter == "ngram":
        return Engine(target, NgramDrafter(V, max_n=2), None, k, max_num_seqs=num_seqs,
                      max_num_batched_tokens=num_seqs * 16)
    return Engine(target, max_num_seqs=num_seqs, max_num_batched_tokens=num_seqs * 16)


PROMPTS = [PROMPT, [4, 0, 5], [2, 2, 2, 3, 1, 0, 4], [5]]


@pytest.mark.parametrize("drafter,k", [("draft", 1), ("draft", 3), ("ngram", 2), ("ngram", 4)])
def test_greedy_speculation_emits_plain_decodings_tokens(drafter, k):
    greedy = SamplingParams(temperature=0, max_tokens=12)
    plain = core_engine("none", 0, 4).generate(PROMPTS, greedy)
    engine = core_engine(drafter, k, 4)
    assert engine.generate(PROMPTS, greedy) == plain
    assert engine.drafter.__class__.__name__ in ("DraftModelDrafter", "NgramDrafter")


def test_the_full_engine_emits_the_bare_cores_greedy_tokens():
    """The same weights in the full engine (minispec.LLM, its own runner, step and kernels)."""
    from minispec.sampling import SamplingParams as FullParams
    from test_speculative_statistical import perturbed, random_target, word_tokenizer

    target, tok = random_target(0), word_tokenizer()
    llm = LLM(model=(target, tok), draft_model=(perturbed(target, 0.3, 1), tok), num_speculative_tokens=3,
              kv_cache_gib=0.02, page_size=8)
    full = [o.token_ids for o in llm.generate(PROMPTS, FullParams(temperature=0, max_tokens=12, ignore_eos=True))]
    assert core_engine("draft", 3, 4).generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12)) == full


def core_counts(drafter: str, k: int, params: SamplingParams, m: int) -> torch.Tensor:
    """N requests of m tokens (seeds 0..N-1) in one batch of the bare core; counts [V^m]."""
    engine = core_engine(drafter, k, N)
    seqs = engine.add_requests([(PROMPT, dataclasses.replace(params, max_tokens=m, seed=i)) for i in range(N)])
    while engine.has_unfinished():
        engine.step()
    ids = torch.tensor([s.output_ids for s in seqs])  # [N, m]
    return torch.bincount((ids * V ** torch.arange(m - 1, -1, -1)).sum(-1), minlength=V**m)


CORE_CASES = [("none", 1, SamplingParams(temperature=1.0), 3),
              ("draft", 2, SamplingParams(temperature=0.6), 3),  # the mutants below run here
              ("draft", 3, SamplingParams(temperature=1.0, top_k=4, top_p=0.9), 4),
              ("ngram", 2, SamplingParams(temperature=1.0, top_k=5, top_p=0.95), 3)]


def core_p_value(drafter: str, k: int, params: SamplingParams, m: int) -> float:
    counts = core_counts(drafter, k, params, m)
    pval, stat, df = pooled_chi_square(counts, exact_distribution(*law_of(params), m))
    print(f"\ncore {drafter} k={k} m={m} {params}: chi2={stat:.1f} df={df} p={pval:.3g}")
    return pval


def law_of(params: SamplingParams):
    """The full engine's target and SamplingParams for the exact law (the same weights)."""
    from minispec.sampling import SamplingParams as FullParams
    from test_speculative_statistical import random_target

    return random_target(0), FullParams(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p)


@pytest.mark.parametrize("drafter,k,params,m", CORE_CASES, ids=[f"{d}-k{k}-m{m}" for d, k, _, m in CORE_CASES])
def test_the_bare_core_samples_the_targets_law(drafter, k, params, m):
    assert core_p_value(drafter, k, params, m) > ALPHA


def no_residual(monkeypatch):
    monkeypatch.setattr(minispec.core.speculative, "residual_distribution", lambda target_probs, draft_probs: target_probs)


def always_accept(monkeypatch):
    monkeypatch.setattr(minispec.core.speculative, "accept_probability", lambda t, d: torch.ones_like(t))


def target_ignores_temperature(monkeypatch):
    def untempered(logits, params):
        return core_warp(logits, [dataclasses.replace(p, temperature=1.0) for p in params])

    monkeypatch.setattr(minispec.core.speculative, "warp_probs", untempered)


@pytest.mark.parametrize("mutant", [no_residual, always_accept, target_ignores_temperature],
                         ids=lambda m: m.__name__)
def test_the_statistic_rejects_bugs_planted_in_the_cores_rule(monkeypatch, mutant):
    """Power: the configuration the real core passes above, with one bug planted, is REJECTED."""
    mutant(monkeypatch)
    assert core_p_value("draft", 2, SamplingParams(temperature=0.6), 3) < ALPHA


def test_a_seeded_request_samples_the_same_tokens_alone_and_in_a_batch():
    params = SamplingParams(temperature=1.0, max_tokens=10, seed=7)
    alone = core_engine("draft", 3, 4).generate([PROMPTS[2]], params)[0]
    others = [dataclasses.replace(params, seed=s) for s in (1, 2, 3)]
    engine = core_engine("draft", 3, 4)
    seqs = engine.add_requests([(PROMPTS[0], others[0]), (PROMPTS[2], params), (PROMPTS[1], others[1]),
                                (PROMPTS[3], others[2])])
    while engine.has_unfinished():
        engine.step()
    assert seqs[1].output_ids == alone
    assert len({tuple(s.output_ids) for s in seqs}) > 1  # (the batch's other requests did sample)


def test_the_readmes_core_example_runs(capsys, monkeypatch):
    """The README's "The core, by itself" example, as written (from the repository root): the
    core alone, on the default target with the distilled draft, prints a greedy answer."""
    readme = (CORE.parents[1] / "README.md").read_text()
    section = readme[readme.index("## The core, by itself"):]
    code = section[section.index("```python\n") + len("```python\n"):section.index("```\n", section.index("```python"))]
    monkeypatch.chdir(CORE.parents[1])
    namespace: dict = {}
    exec(compile(code, "README.md", "exec"), namespace)
    engine = namespace["engine"]
    assert isinstance(engine, Engine) and isinstance(engine.drafter, DraftModelDrafter)
    assert len(namespace["tokens"]) == 32 and capsys.readouterr().out.strip()
