"""tools/gpu_check.sh and its random-init pair, checked on CPU (the GPU parts run only on a GPU).

Invariants: the script parses; `tools/random_pair.py --size tiny` writes a target / draft pair
with the shipped tokenizer that minispec loads and decodes speculatively, greedy output equal to
plain decoding (the same pair and sizes scale up to the 1B-like pair the GPU run builds).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from minispec import LLM, SamplingParams

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.usefixtures("one_thread")


def test_gpu_check_script_parses_and_refuses_bad_arguments():
    subprocess.run(["bash", "-n", str(ROOT / "tools" / "gpu_check.sh")], check=True)
    bad = subprocess.run(["bash", str(ROOT / "tools" / "gpu_check.sh"), "--bogus"], capture_output=True, text=True)
    assert bad.returncode == 2 and "usage" in bad.stderr


def test_random_pair_loads_and_decodes(tmp_path):
    subprocess.run([sys.executable, str(ROOT / "tools" / "random_pair.py"), str(tmp_path), "--size", "tiny",
                    "--device", "cpu"], check=True, capture_output=True)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    plain = LLM(model=str(tmp_path / "target"), kv_cache_gib=0.05)
    spec = LLM(model=str(tmp_path / "target"), draft_model=str(tmp_path / "draft"), num_speculative_tokens=3,
               kv_cache_gib=0.05)
    assert plain.engine.target.model.cfg.vocab_size == 49152
    prompts = ["Write a Python function that reverses a string."]
    assert spec.generate(prompts, params)[0].token_ids == plain.generate(prompts, params)[0].token_ids
    assert spec.last_metrics.num_drafted > 0
