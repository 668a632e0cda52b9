"""tools/gpu_check.sh, checked on CPU (the GPU parts run only on a GPU).

The GPU machine has no network and no `gguf`, a command brings at most 64 MiB (the working tree
included), and there are 15 minutes of GPU time in all. Invariants: the script parses and refuses
bad arguments; what travels with its commands (the working tree, nothing carried) fits in 64 MiB
with room to spare; its two commands' step timeouts add up to less than their commands' limits,
which with start-up fit the 15 minutes; a machine without torch is told so (not "no CUDA device"),
and one without a GPU is told to use --dry-run; the dry run passes end to end (every step at tiny
sizes on CPU), leaves only its three result files in $OUT and no scratch folder behind; the random
target of SmolLM2-135M-Instruct's shape takes the shipped draft and EAGLE head, and the GPU bench's
arguments parse into the rows the script's header names; bench.py with a
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
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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
    """Every step at tiny sizes on CPU (about 40 CPU-seconds): the kernel and graph tests, a random
    target written outside $OUT, the bench with a draft model and n-gram, the roofline tool and the
    kernel bench's no-GPU path."""
    out = tmp_path / "out"
    proc = subprocess.run(["bash", str(SCRIPT), "--dry-run"], capture_output=True, text=True,
                          env={**os.environ, "OUT": str(out)}, timeout=900)
    log = (out / "gpu_check.log").read_text()
    assert proc.returncode == 0, log[-4000:]
    assert "all steps passed (all)" in log and "FAILED" not in log
    assert sorted(p.name for p in out.iterdir()) == ["bench.json", "gpu_check.log", "roofline.json"]
    scratch = Path(re.search(r"random_pair\.py (\S+)/pair", log)[1])
    assert not scratch.is_relative_to(out) and not scratch.exists()  # outside $OUT, and removed
    rows = json.loads((out / "bench.json").read_text())["rows"]
    assert {"none", "draft", "ngram"} <= {r["drafter"] for r in rows}
    roof = json.loads((out / "roofline.json").read_text())
    assert roof["weight_bytes"] > MIB and sum(roof["continuous_batching"]["forwards"].values()) > 0


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
              for name, body in re.findall(r"(DRAFTS|BENCH|ROOF)=\(([^)]*)\)", gpu_branch)}
    args = bench.parse_args(["--target", "random-target"] + arrays["DRAFTS"] + arrays["BENCH"] + ["--no-plots"])
    plan = bench.plan(args, gpu=True)
    assert plan["drafters"] == ["eagle", "eagle-tree", "draft", "ngram"] and plan["tree_budgets"] == [32]
    assert plan["groups"] == [("greedy", 1), ("greedy", 16)] and plan["rounds"] >= 6
    assert (ROOT / args.draft / "config.json").is_file() and (ROOT / args.eagle / "config.json").is_file()
    assert args.dtype == "bfloat16" and "--tokens" in arrays["ROOF"]


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
