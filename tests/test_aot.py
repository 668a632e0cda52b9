"""The Triton kernels compiled for real GPUs that are not here (sm_80: A100, sm_90: H100/H200).

The interpreter the other kernel tests use accepts code the GPU compiler may reject or compile
badly. Here every launch the engine makes for the supported models (tools/aot.py:
`default_configs`, in bf16 (what bench and the GPU check launch; `TRITON_INTERPRET=0 python
tools/aot.py` compiles fp16 too, as this suite did until 7 Dec: also spill-free): head dims 64 and 128, 1 to 7 query heads per kv head, decode, a
k = 4 verification and tree verifications of 9, 17 and 33 rows, unsplit and split up to the 16 splits
a batch-1 step gets on a large GPU, prefill, KV writes, and the fused layer kernels (RMSNorm + add
at hidden sizes 576, 1536, 4096; RoPE + K/V write; silu * up at 1536, 8960, 14336)) is compiled ahead of time in a separate
process with TRITON_INTERPRET=0, with the launchers' own tiles and num_warps, and its cubin's
resource usage read with the cuobjdump Triton bundles.

Invariants: every launch compiles for sm_80 and sm_90; none spills registers (STACK 0, LOCAL 0);
shared memory fits the architecture. The check itself is shown to see a spill (power). Results are
cached per kernel source hash (~/.cache/minispec/aot.json), so only changed kernels recompile
(cold: about 80 s on 2 cores; both dtypes 2.5 minutes).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import triton

BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
TOOLS = Path(__file__).resolve().parents[1] / "tools"  # the AOT check is a tool, not part of the package
sys.path.insert(0, str(TOOLS))
pytestmark = pytest.mark.skipif(not (BIN / "ptxas").exists() or not (BIN / "cuobjdump").exists(),
                                reason="this Triton build bundles no ptxas / cuobjdump")
ENV = {**os.environ, "TRITON_INTERPRET": "0", "OMP_NUM_THREADS": "1", "TRITON_DEFAULT_FP_FUSION": "1"}


def run_compiler(script: str) -> list:
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=ENV, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.splitlines()[-1])


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_compiler(
        "import dataclasses, json\n"
        "import sys; sys.path.insert(0, %r)\n" % str(TOOLS)
        + "from aot import check_all, default_configs\n"
        "rs = check_all(default_configs(dtypes=('bfloat16',)), (80, 90), jobs=2)\n"
        "print(json.dumps([dict(dataclasses.asdict(r), spills=r.spills) for r in rs]))\n")


def test_every_default_launch_compiles_for_sm80_and_sm90(results):
    os.environ.setdefault("TRITON_INTERPRET", "1")
    from aot import default_configs

    expected = {(c.label(), arch) for c in default_configs(dtypes=("bfloat16",)) for arch in (80, 90)}
    assert {(r["config"], r["arch"]) for r in results} == expected
    assert {r["kernel"] for r in results} == {"_paged_attention_kernel", "_combine_splits_kernel",
                                              "_flash_prefill_kernel", "_write_kv_kernel", "_add_rmsnorm_kernel",
                                              "_rope_write_kernel", "_silu_mul_kernel"}
    configs = {r["config"] for r in results}
    for launch in ("splits 16", "q_len 9 splits 1 tree", "q_len 33 splits 16 tree", "H=4096", "I=14336"):
        assert any(launch in c for c in configs), f"no default launch with {launch}"
    assert all(r["registers"] > 0 for r in results)


def test_no_default_launch_spills_registers(results):
    spills = [f"{r['config']} sm_{r['arch']} ({r['kernel']}, {r['num_warps']} warps, {r['constexprs']}): "
              f"{r['registers']} registers, {r['stack']} bytes of stack" for r in results if r["spills"]]
    assert not spills, "register spills:\n" + "\n".join(spills)


def test_shared_memory_fits_each_architecture(results):
    too_big = [f"{r['config']} sm_{r['arch']}: {r['shared']} bytes" for r in results if not r["shared_ok"]]
    assert not too_big, too_big
    assert max(r["shared"] for r in results) > 0  # the attention kernels do use shared memory


def test_the_check_sees_a_spill():
    """Power: the paged-attention tile used before this check existed for a k = 4 verification at
    D = 128 with 4 query heads per kv head (64 keys) spills on sm_80."""
    [stack] = run_compiler(
        "import json\n"
        "import sys; sys.path.insert(0, %r)\n" % str(TOOLS)
        + "from aot import Config, compile_launch, launches\n"
        "config = Config('paged_attention', 'bfloat16', 128, 4, 5, 1)\n"
        "fn, kwargs = launches(config)[0]\n"
        "r = compile_launch(fn, dict(kwargs, BLOCK_N=64), 80, config)\n"
        "print(json.dumps([r.stack]))\n")
    assert stack > 0
