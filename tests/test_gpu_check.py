"""tools/gpu_check.sh, checked on CPU (the GPU parts run only on a GPU).

The GPU machine has no network and no `gguf`, a command brings at most 64 MiB (the working tree
included), and there are 15 minutes of GPU time in all. Invariants: the script parses and refuses
bad arguments; what travels with its commands (the working tree, nothing carried) fits in 64 MiB
with room to spare; its two commands' step timeouts add up to less than their commands' limits,
which with start-up fit the 15 minutes; a machine without torch is told so (not "no CUDA device"),
and one without a GPU is told to use --dry-run; the dry run passes end to end (every step at tiny
sizes on CPU), leaves only its three result files in $OUT and no scratch folder behind; the random
target of SmolLM2-135M-Instruct's shape takes the shipped draft and EAGLE head, the GPU bench's
arguments parse into the rows the script's header names, and the GPU's device-step selection
collects the tests it names; bench.py with a
user's --target benches only the drafters made for it (never the shipped head of another model),
and refuses a head for another target in one line; tools/random_pair.py writes a pair minispec
decodes speculatively with greedy output equal to plain decoding.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from minispec import LLM, SamplingParams
from minispec.model.config import ModelConfig

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tools" / "gpu_check.sh"
sys.path.insert(0, str(ROOT))
import bench  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
MIB = 2**20
CARRY_LIMIT = 64 * MIB  # what one device command may bring: tracked + untracked non-ignored files + carried paths
MARGIN = 4 * MIB
GPU_SECONDS, START_UP_S, COMMAND_LIMIT_S, BETWEEN_STEPS_S = 15 * 60, 120, 600, 30


def load_tool(name: str):
    """A module of tools/ (which import each other by plain name, as when run as scripts)."""
    if str(ROOT / "tools") not in sys.path:
        sys.path.insert(0, str(ROOT / "tools"))
    return importlib.import_module(name)


def planned_commands() -> list[tuple[str, int, list[str]]]:
    """(part, timeout_s, carried paths) of each device command the script's header plans."""
    plan = re.findall(r'run\(command="bash tools/gpu_check\.sh (\w+)"(?:, carry=\[([^\]]*)\])?, timeout_s=(\d+)\)',
                      SCRIPT.read_text())
    return [(part, int(secs), re.findall(r'"([^"]+)"', carry)) for part, carry, secs in plan]


def git_files(*args: str) -> list[str]:
    out = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z", *args], capture_output=True, check=True).stdout
    return [name for name in out.decode().split("\0") if name]


def test_gpu_check_script_parses_and_refuses_bad_arguments():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    bad = subprocess.run(["bash", str(SCRIPT), "--bogus"], capture_output=True, text=True)
    assert bad.returncode == 2 and "usage" in bad.stderr


def test_what_travels_to_the_gpu_fits_in_64_mib():
    """Every file of the working tree git does not ignore travels with each command, with the
    paths it carries; the planned commands carry nothing, so the tree alone must leave room."""
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    commands = planned_commands()
    assert [part for part, _, _ in commands] == ["tests", "bench"]
    tree = {name: (ROOT / name).stat().st_size for name in git_files() + git_files("--others", "--exclude-standard")
            if (ROOT / name).is_file()}
    for part, _, carried in commands:
        sizes = dict(tree)
        for path in carried:
            sizes |= {str(f): f.stat().st_size for f in [ROOT / path, *(ROOT / path).rglob("*")] if f.is_file()}
        total = sum(sizes.values())
        largest = ", ".join(f"{n} {b / MIB:.1f} MiB" for n, b in sorted(sizes.items(), key=lambda x: -x[1])[:4])
        assert total < CARRY_LIMIT - MARGIN, f"command {part!r} would bring {total / MIB:.1f} MiB ({largest})"


def test_the_two_commands_fit_the_gpu_time():
    plan = subprocess.run(["bash", str(SCRIPT), "--plan"], capture_output=True, text=True, check=True).stdout
    step_sums = {m[0]: int(m[1]) for m in re.findall(r"^(\w+) (\d+):", plan, flags=re.M)}
    for line in plan.splitlines():  # each part's sum is the sum of its steps
        total, steps = line.split(":", 1)
        assert int(total.split()[1]) == sum(int(x) for x in re.findall(r" (\d+)", steps))
    commands = planned_commands()
    for part, timeout_s, _ in commands:
        assert step_sums[part] + BETWEEN_STEPS_S <= timeout_s <= COMMAND_LIMIT_S, (part, step_sums[part], timeout_s)
    assert START_UP_S + sum(t for _, t, _ in commands) <= GPU_SECONDS


def test_no_torch_is_said_so_and_no_gpu_asks_for_the_dry_run(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "python3"  # a Python whose every import of torch fails
    fake.write_text(f"#!/bin/sh\nexec {sys.executable} -c 'import sys; sys.modules[\"torch\"] = None; import torch' \"$@\"\n")
    fake.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "PYTHON"} | {"OUT": str(tmp_path / "a"),
                                                                    "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    proc = subprocess.run(["bash", str(SCRIPT), "tests"], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2 and "torch is missing" in proc.stdout and "CUDA" not in proc.stdout, proc.stdout
    if importlib.util.find_spec("torch") and not __import__("torch").cuda.is_available():
        proc = subprocess.run(["bash", str(SCRIPT), "tests"], capture_output=True, text=True, timeout=300,
                              env={**os.environ, "OUT": str(tmp_path / "b"), "PYTHON": sys.executable})
        assert proc.returncode == 2 and "no CUDA device" in proc.stdout and "--dry-run" in proc.stdout, proc.stdout


def test_the_dry_run_passes_end_to_end(tmp_path):
    """Every step at tiny sizes on CPU (about 45 CPU-seconds): the kernel, graph and device-step tests, the
    measurement (every section: forwards, engine runs with each kind of drafter, the transformers
    peer, predictions, the controlled pair), a random target written outside $OUT, and the bench
    with a draft model and n-gram."""
    out = tmp_path / "out"
    proc = subprocess.run(["bash", str(SCRIPT), "--dry-run"], capture_output=True, text=True,
                          env={**os.environ, "OUT": str(out)}, timeout=900)
    log = (out / "gpu_check.log").read_text()
    assert proc.returncode == 0, log[-4000:]
    assert "all steps passed (all)" in log and "FAILED" not in log
    assert sorted(p.name for p in out.iterdir()) == ["bench.json", "gpu_check.log", "gpu_measure.json", "gpu_measure.md"]
    scratch = Path(re.search(r"random_pair\.py (\S+)/pair", log)[1])
    assert not scratch.is_relative_to(out) and not scratch.exists()  # outside $OUT, and removed
    rows = json.loads((out / "bench.json").read_text())["rows"]
    assert {"none", "draft", "ngram"} <= {r["drafter"] for r in rows}
    measured = json.loads((out / "gpu_measure.json").read_text())
    check_measurement(measured)
    table = (out / "gpu_measure.md").read_text()
    assert "| shape | batch | decode ms |" in table and "| epsilon | acceptance |" in table


def check_measurement(m: dict) -> None:
    """What gpu_measure.json holds, whatever the device: every section run, every number there."""
    assert m["copy_bytes_per_s"] > 0 and not m["skipped"]
    buckets, q_lens = [str(b) for b in m["buckets"]], m["q_lens"]
    assert q_lens[0] == 1 and len(buckets) == 2
    shapes = {r["shape"]: r for r in m["shapes"]}
    assert {"qwen2.5-1.5b", "llama-3.1-8b"} <= set(shapes)
    for r in shapes.values():
        for b in buckets:
            assert all(r["forwards"]["seconds"][b][str(q)] > 0 for q in q_lens)
            assert r["bandwidth"][b]["share_of_copy"] > 0 and r["plain"][b]["tpot_s"] > 0
            assert r["transformers"][b]["tpot_s"] > 0
        for drafter in r["drafters"].values():
            assert all(drafter["engine"][b]["step_s"] > 0 for b in buckets)
    kinds = {(p["shape"], p["drafter"]) for r in shapes.values() for p in r["predictions"]}
    assert {("qwen2.5-1.5b", "draft"), ("qwen2.5-1.5b", "ngram"), ("llama-3.1-8b", "eagle")} <= kinds
    eagle_8b = [p for p in shapes["llama-3.1-8b"]["predictions"] if p["drafter"] == "eagle"]
    assert all(p["tokens_per_step"] == 3.1 and p["speedup"] > 0 and p["t_draft_s"] > 0 for p in eagle_8b)
    pair = m["pair"]
    assert [row["epsilon"] for row in pair["rows"]][0] == 0
    for row in pair["rows"]:
        assert row["predicted"] > 0 and row["measured"] > 0 and 1 <= row["tokens_per_step"] <= pair["k"] + 1
    assert pair["rows"][0]["acceptance"] > 0.99  # epsilon 0: the target computes the draft's logits


def test_the_random_smollm2_target_takes_the_shipped_draft_and_eagle_head():
    """The check's GPU target: the default target's shape, so the shipped drafters fit it as they are."""
    from minispec.io.paths import cache_dir

    random_pair = load_tool("random_pair")
    target_cfg = ModelConfig.from_hf(random_pair.model_config(random_pair.SIZES["smollm2"][0]))
    assert random_pair.SIZES["smollm2"][1] is None  # no random draft: the shipped ones
    bench.check_eagle_head(ROOT / "weights" / "eagle-smollm2", SimpleNamespace(cfg=target_cfg))  # SystemExit if not
    draft_cfg = ModelConfig.from_hf(json.loads((ROOT / "weights" / "draft-smollm2" / "config.json").read_text()))
    assert draft_cfg.vocab_size == target_cfg.vocab_size
    real = cache_dir() / "SmolLM2-135M-Instruct" / "config.json"  # converted from the GGUF, where it has been
    if real.is_file():
        assert ModelConfig.from_hf(json.loads(real.read_text())) == target_cfg


def test_the_gpu_bench_arguments_parse_and_plan_the_rows_the_header_names():
    """The GPU branch's bench arguments are parsed here (a typo there would cost a GPU session), and
    the drafters' weights they name travel with the tree."""
    import shlex

    text = SCRIPT.read_text()
    gpu_branch = text[text.index("--size smollm2"):]
    arrays = {name: shlex.split(body.replace("\\\n", " "))
              for name, body in re.findall(r"(DRAFTS|BENCH)=\(([^)]*)\)", gpu_branch)}
    args = bench.parse_args(["--target", "random-target"] + arrays["DRAFTS"] + arrays["BENCH"] + ["--no-plots"])
    plan = bench.plan(args, gpu=True)
    assert plan["drafters"] == ["eagle", "eagle-tree", "draft", "ngram"]
    assert plan["tree_budgets"] == [32] and args.tree_confidence == 0  # (one tree row: searched on the device)
    assert plan["groups"] == [("greedy", 1), ("greedy", 16)] and plan["rounds"] >= 6
    assert (ROOT / args.draft / "config.json").is_file() and (ROOT / args.eagle / "config.json").is_file()
    assert args.dtype == "bfloat16"


DEVICE_STEP_TESTS = {  # what the GPU's device-step-tests step must run, by file: the device step against the host's
    "test_speculative_tree_device.py": {"test_the_device_walk_decides_as_the_host_walk",
                                        "test_the_device_step_gives_the_host_steps_tokens",
                                        "test_a_mixed_batch_and_a_penalised_request",
                                        "test_an_interrupted_device_step_ends_every_request_and_leaves_the_llm_usable"},
    "test_transfers_options.py": {"test_a_step_with_the_options_makes_one_upload_and_one_download",
                                  "test_the_device_step_gives_the_host_steps_tokens_and_logprobs",
                                  "test_the_options_act_on_the_device_step"},
    "test_transfers_tree.py": {"test_a_tree_step_makes_one_upload_and_one_download",
                               "test_a_step_of_host_trees_makes_one_upload_and_one_download",
                               "test_past_a_host_search_a_tree_step_makes_one_upload_and_one_download"},
    "test_transfers.py": {"test_a_step_makes_one_upload_and_one_download",
                          "test_lookup_in_front_of_a_model_makes_one_upload_and_one_download",
                          "test_a_catch_up_after_looked_up_steps_rides_in_the_same_upload",
                          "test_the_counter_sees_a_transfer"},
    "test_pathwise.py": {"test_steps_laid_out_for_the_device_emit_the_host_paths_tokens"},
    "test_adaptive_on_device.py": {"test_the_device_stops_where_the_host_loop_stops",
                                   "test_a_step_stopping_on_the_device_makes_one_upload_and_one_download"},
}


def test_the_gpu_device_step_selection_collects_the_tests_it_names():
    """The GPU branch's device-step selection (files and -k, as the script builds them) collects
    exactly these tests: a test renamed or moved would otherwise drop out of the GPU run unseen."""
    text = SCRIPT.read_text()
    files = re.search(r"DEVICE_STEP=\(([^)]*)\)", text)[1].split()
    k = "".join(re.findall(r'DEVICE_STEP_K\+?="([^"]*)"', text))
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *files,
                           "-k", k], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    collected: dict[str, set[str]] = {}
    for node in re.findall(r"^tests/(\S+?)::(\w+)", proc.stdout, flags=re.M):
        collected.setdefault(node[0], set()).add(node[1])
    assert collected == DEVICE_STEP_TESTS
    assert "test_the_device_step_gives_the_host_steps_tokens[eagle-tree-greedy-3]" in proc.stdout
    assert "test_the_device_step_gives_the_host_steps_tokens[eagle-tree-greedy-1]" not in proc.stdout  # (batch 3 only)


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


def test_the_step_model_is_leviathans_closed_form_with_measured_costs():
    """E = (1 - a^(k+1)) / (1 - a) tokens a step (1 at a = 0, k + 1 at a = 1); acceptance_for inverts
    it; with t_verify = t_decode the speedup is bench.py's E / (k c + 1)."""
    step_model = load_tool("step_model")
    assert step_model.expected_tokens(0.0, 4) == 1 and step_model.expected_tokens(1.0, 4) == 5
    assert step_model.expected_tokens(0.5, 1) == pytest.approx(1.5)
    for a, k in ((0.3, 2), (0.76, 4), (0.9, 8)):
        assert step_model.acceptance_for(step_model.expected_tokens(a, k), k) == pytest.approx(a, abs=1e-9)
    a, k, c = 0.7, 4, 0.2
    ours = step_model.predicted_speedup(step_model.expected_tokens(a, k), k, t_decode=2.0, t_draft=2.0 * c, t_verify=2.0)
    assert ours == pytest.approx(bench.predicted_speedup(a, k, c))
    assert step_model.predicted_speedup(3.1, 4, 1.0, 0.0, 1.0) == pytest.approx(3.1)  # free drafts, flat verification
    with pytest.raises(ValueError, match="1..5"):
        step_model.acceptance_for(5.5, 4)
    with pytest.raises(ValueError, match="positive"):
        step_model.predicted_speedup(2.0, 4, 0.0, 0.1, 1.0)


def test_the_cpu_acceptance_table_names_a_real_source_for_every_figure():
    """Every figure is possible for its chain (1..k+1 tokens a step), names a shape the measurement
    builds, and quotes a section of docs/results.md that exists, with its machine (the 8B figure is
    the issue's target, said so)."""
    table, shapes = load_tool("cpu_acceptance").ACCEPTANCE, load_tool("random_models").SHAPES
    results = (ROOT / "docs" / "results.md").read_text()
    for entry in table:
        assert 1 <= entry.tokens_per_step <= entry.k + 1 and entry.target in shapes
        if entry.source.startswith("docs/results.md"):
            quoted = re.findall(r"'([^']+)'", entry.source)
            assert quoted and quoted[0] in results, entry.source
            assert "Zen" in entry.machine and "Dec 2026" in entry.machine
        else:
            assert "not measured" in entry.source
    assert any(e.target == "llama-3.1-8b" and e.drafter == "eagle" and e.tokens_per_step == 3.1 for e in table)


def test_the_real_shapes_are_the_models_they_name():
    """Parameter counts of the shapes the GPU builds (from their configs, nothing built): SmolLM2
    135M, Qwen2.5 1.5B and 0.5B, Llama-3.1 8B; and the GPU plan times k+1 = 2..9 at batch 1 and
    16, with every drafter's and the acceptance table's k among them."""
    random_models, measure = load_tool("random_models"), load_tool("gpu_measure")
    expected = {"smollm2-135m": 0.135e9, "qwen2.5-1.5b": 1.54e9, "qwen2.5-0.5b": 0.49e9, "llama-3.1-8b": 8.03e9}
    for name, params in expected.items():
        cfg = ModelConfig.from_hf(random_models.hf_config(random_models.SHAPES[name]))
        assert cfg.num_parameters == pytest.approx(params, rel=0.03), name
    gpu = measure.settings(False, __import__("torch").device("cpu"))
    assert gpu.buckets == (1, 16) and gpu.q_lens == tuple(range(1, 10)) and gpu.epsilons[0] == 0
    ks = {k for rows in measure.DRAFTERS.values() for *_, k in rows} | {e.k for e in load_tool("cpu_acceptance").ACCEPTANCE}
    assert all(k + 1 in gpu.q_lens for k in ks | {measure.PAIR_K})


def test_the_controlled_pairs_target_is_the_draft_at_epsilon_zero():
    """Target = the draft's layers + extra layers whose residual writes are scaled by epsilon: at
    epsilon 0 its logits are the draft's exactly (fp32), at epsilon 1 they are not, and epsilon
    changes the weights in place (their addresses, which CUDA graphs hold, stay)."""
    import torch

    from minispec.model.metadata import BatchMetadata

    random_models, controlled = load_tool("random_models"), load_tool("controlled_pair")
    pair = controlled.build_pair(random_models.tiny(random_models.SHAPES["qwen2.5-0.5b"]), 3, 0, torch.device("cpu"),
                                 torch.float32)
    ids = torch.tensor([5, 17, 300, 42, 9])  # [T]
    meta = BatchMetadata.for_prompts([len(ids)])
    addresses = [w.data_ptr() for w, _ in pair.scaled]
    pair.set_epsilon(0.0)
    assert torch.equal(pair.target(ids, meta), pair.draft(ids, meta))
    pair.set_epsilon(1.0)
    assert not torch.allclose(pair.target(ids, meta), pair.draft(ids, meta))
    assert [w.data_ptr() for w, _ in pair.scaled] == addresses and len(pair.scaled) == 2 * 3
    with pytest.raises(ValueError, match="epsilon"):
        pair.set_epsilon(-1.0)


def test_the_cuda_peak_memory_column_is_each_rows_own(monkeypatch):
    """On CUDA an arm's peak is reset before each of its runs and read after it: a row that ran
    after a hungrier one reports its own peak, not the process's so far."""
    import torch

    allocated = {"peak": 0}

    def run_using(mib):
        def run(prompts):
            allocated["peak"] = max(allocated["peak"], mib * 2**20)
            return bench.Run(1, 1.0, [[1]])
        return run

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a: allocated.update(peak=0))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: allocated["peak"])
    hungry, lean = bench.Arm("hungry", "draft", 4, run_using(900)), bench.Arm("lean", "none", 0, run_using(100))
    for _ in range(2):
        hungry.timed([[1]])
        lean.timed([[1]])
    assert hungry.cuda_peak_mib == 900 and lean.cuda_peak_mib == 100
