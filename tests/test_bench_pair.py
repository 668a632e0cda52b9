"""tools/bench_pair.py's plan of rows, on CPU and on a GPU (no GPU needed: the plan is a function).

Invariants: on CPU the plan is the one the pair bench has run (an int4 chain draft with bf16 rows
beside it, adaptive, a draft tree, prompt lookup, n-gram, the reduced-vocabulary draft with --full,
and the row-invariant target plain then with the int4 draft, last); on a GPU no row needs a CPU-only
path (no int4 draft, no reduced vocabulary, no row invariance) and the draft runs in bf16 wherever
the CPU plan ran it in int4.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tools")]
from bench_pair import FR_VOCAB, ArmSpec, plan_arms  # noqa: E402

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
KNOBS = dict(adaptive_k=8, tree_depth=4, ngram_k=4)


def rows(specs: list[ArmSpec]) -> list[tuple]:
    return [(s.draft, s.drafter, s.k, s.budget, s.invariant) for s in specs]


def test_the_cpu_plan_is_the_pair_benchs():
    greedy = plan_arms("greedy", CPU, full=False, reduced=False, **KNOBS)
    assert rows(greedy) == [("int4", "draft", 4, None, False), ("int4", "draft", 6, None, False),
                            ("dense", "draft", 4, None, False), ("int4", "adaptive", 8, None, False),
                            ("int4", "draft-tree", 4, 8, False), ("int4", "draft+lookup", 4, None, False),
                            (None, "ngram", 4, None, False), (None, "none", 0, None, True),
                            ("int4", "draft", 4, None, True)]
    assert [s.label for s in greedy][-2:] == ["row-invariant", "row-invariant int4"]
    assert rows(plan_arms("sampled", CPU, full=False, reduced=False, **KNOBS)) == [("int4", "draft", 4, None, False)]
    full = plan_arms("greedy", CPU, full=True, reduced=True, **KNOBS)
    assert ("dense", "draft", 6, None, False) in rows(full)
    reduced = ArmSpec("int4 reduced", "draft", 4, f"int4 vocab {FR_VOCAB}")
    assert [s for s in full if s.draft == "int4 reduced"] == [reduced]
    assert len(plan_arms("sampled", CPU, full=True, reduced=True, **KNOBS)) == 2


@pytest.mark.parametrize("full", [False, True])
@pytest.mark.parametrize("mode", ["greedy", "sampled"])
def test_on_a_gpu_every_row_runs_there_with_a_bf16_draft(mode, full):
    cuda = plan_arms(mode, CUDA, full=full, reduced=True, **KNOBS)
    assert cuda and not any(s.invariant for s in cuda)
    assert {s.draft for s in cuda} <= {"dense", None} and all("int4" not in s.label for s in cuda)
    cpu = plan_arms(mode, CPU, full=full, reduced=True, **KNOBS)
    cpu_rows = {(s.drafter, s.k, s.budget) for s in cpu if not s.invariant}
    assert {(s.drafter, s.k, s.budget) for s in cuda} == cpu_rows  # the same drafters and ks, in bf16
    assert len(set(cuda)) == len(cuda)  # no row twice (the CPU plan's int4 and bf16 rows become one)



def test_on_a_gpu_the_pair_runs_in_bf16_with_no_cpu_peer():
    """The pair's dtype on CUDA is bf16 whatever the CPU is (auto), and the plan names no arm the
    CUDA run cannot build: no int4 draft (its kernel is a CPU kernel), no row invariance."""
    from bench_pair import pair_dtype

    assert pair_dtype("auto", CUDA) == torch.bfloat16
    assert pair_dtype("float32", CUDA) == torch.float32
    for mode in ("greedy", "sampled"):
        for spec in plan_arms(mode, CUDA, full=True, reduced=True, **KNOBS):
            assert spec.draft in ("dense", None) and not spec.invariant and spec.label in ("bfloat16", "")
