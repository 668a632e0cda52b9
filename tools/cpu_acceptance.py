"""Tokens per step the real drafters reached on CPU with the real weights: what tools/gpu_measure.py
multiplies the GPU's measured step costs by (random weights on the GPU accept nothing meaningful).

Each entry names the random shape it stands for (tools/random_models.py), the drafter, its k, the
greedy tokens per target step (bonus included) and where the figure comes from: a table of
docs/results.md (with its machine and date) or, for the 8B shape, the figure the project aims at.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Acceptance:
    target: str  # a shape of tools/random_models.py
    drafter: str  # "draft" (a draft model), "eagle" (an EAGLE-3 head's chain), "ngram"
    k: int
    tokens_per_step: float
    source: str
    machine: str


ACCEPTANCE = [
    Acceptance("qwen2.5-1.5b", "draft", 4, 3.80,
               "docs/results.md, 'The real pair with a reduced draft vocabulary in the same rounds', row 'bf16 draft "
               "k=4' (Qwen2.5-Coder-1.5B-Instruct with its 0.5B sibling as draft, coding prompts, greedy)",
               "2-core AMD EPYC, Zen 4 (AVX512-BF16), bf16, 7 Dec 2026"),
    Acceptance("qwen2.5-1.5b", "ngram", 4, 1.13,
               "docs/results.md, the same table, row 'n-gram k=4'",
               "2-core AMD EPYC, Zen 4 (AVX512-BF16), bf16, 7 Dec 2026"),
    Acceptance("smollm2-135m", "eagle", 4, 1.62,
               "docs/results.md, 'The default bench with pathwise rows', row 'eagle k=4', greedy (the shipped head)",
               "2-core AMD EPYC, Zen 3 (AVX2), fp32, row-invariant, 7 Dec 2026"),
    Acceptance("smollm2-135m", "draft", 2, 1.38,
               "docs/results.md, 'Zen 3, fp32, 3 Dec 2026: the distilled draft model' (the shipped draft model, k=2)",
               "2-core AMD EPYC, Zen 3 (AVX2), fp32, 3 Dec 2026"),
    Acceptance("llama-3.1-8b", "eagle", 4, 3.1,
               "issue #59's target: EAGLE-3's chain figure on Llama-3.1-8B (Li et al. 2025); not measured by minispec",
               "-"),
]


def lookup(target: str, drafter: str) -> Acceptance | None:
    return next((a for a in ACCEPTANCE if a.target == target and a.drafter == drafter), None)
