#!/usr/bin/env bash
# The prepared check of minispec on a borrowed GPU machine, writing its results under $OUT.
#
#   tools/gpu_check.sh [tests | bench | all]      # on the GPU machine (default: all)
#   tools/gpu_check.sh --dry-run [PART]           # on a CPU machine: the same steps at tiny sizes
#   tools/gpu_check.sh --plan                     # each part's step timeouts, summed
#
# What the GPU machine has, and what travels there (docs/kernels-and-gpu.md has the details): one
# GPU, its own torch + triton + transformers, no network and no `gguf` package; a command brings the
# working tree (tracked files and untracked ones git does not ignore; the shipped draft and EAGLE
# head are most of it) plus what it carries, 64 MiB in all. So this check carries nothing
# and installs nothing: the repository's packages run from the checkout (PYTHONPATH), and the target
# is a random-init model of SmolLM2-135M-Instruct's shape written on the GPU (tools/random_pair.py),
# for which the shipped draft and EAGLE head fit. Acceptance means nothing on random weights; step
# times, verification and drafting costs, and the kernels' behaviour are real.
#
# Time: 15 minutes of GPU time in all, start-up (1-2 minutes) included; 600 s at most a command.
# Two commands, each step under its own timeout (--plan prints the sums), most valuable first:
#   run(command="bash tools/gpu_check.sh tests", timeout_s=330)   # 1. kernels, CUDA graphs, device step
#   run(command="bash tools/gpu_check.sh bench", timeout_s=420)   # 2. measurement, then bench
# Worst case 2 + 5.5 + 7 = 14.5 minutes; a part that finishes early leaves time to rerun the other.
#
# Part "tests": the environment; tests/test_kernels.py (bf16 included), tests/test_graphs.py
# (CUDA-graph replay against eager), then the device step's tests on CUDA, where that step is the
# default: the tree step's device search and walk against the host step's, token for token
# (greedy, sampled, pathwise; the EAGLE head, a draft model, lookup in front; a mixed batch; an
# interrupt in the walk), penalties, min_tokens and logprobs on the one-upload step against the
# host path, pathwise noise from uploaded lanes, and one upload and one download a step (chains,
# trees, the options) counted on CUDA. Part "bench": tools/gpu_measure.py (step costs of
# minispec's own runner, KV cache and CUDA graphs at real shapes built on the GPU from seeds:
# SmolLM2-135M, a Qwen2.5-1.5B target with a 0.5B draft, an 8B target with an EAGLE-3-shaped head;
# decode and k+1 verification, drafted tokens, bandwidth against the measured copy ceiling,
# transformers' generate as the peer; each drafter's speedup predicted with the step model from
# the acceptance measured on CPU; a pair whose acceptance epsilon controls, predicted against
# measured); then bench.py on a random target of SmolLM2-135M-Instruct's shape with the shipped
# drafters (CUDA graphs on, bf16; plain vs the EAGLE head as a chain and as a tree of 32 nodes,
# depth 4, searched and walked on the device (no confidence stop, which searches on the host), the
# draft model and n-gram, greedy, batch 1 and 16, 32-token answers, 6 paired rounds, transformers as
# peer, greedy identity checked), which runs bench.py itself on CUDA end to end. The measurement
# replaced tools/roofline.py and `bench.py --kernels` here: it measures the copy ceiling and each
# decode step's share of it at four shapes, where the roofline did at one, and the attention
# kernels' timings alone matter less than whole steps (both tools still run by hand). Results: $OUT/gpu_check.log (every step's output),
# gpu_measure.md (the tables for docs/results.md and the README), gpu_measure.json, bench.json; the
# random target lives in a temporary folder, never under $OUT (what is there comes back). A failing
# step is reported and the others still run; the exit status is 1 if any failed, 2 if the machine
# cannot run the check at all.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$PWD

# Each step's timeout in seconds on the GPU (the dry run's are five times as long). A part's steps
# add up to at most its command's timeout_s above less 30 s for the checks between them
# (tests/test_gpu_check.py checks the sums against the two commands and the 15 minutes).
T_ENV=30 T_KERNEL_TESTS=125 T_GRAPH_TESTS=80 T_DEVICE_STEP_TESTS=65
T_MEASURE=210 T_TARGET=30 T_BENCH=120
TESTS_S=$((T_ENV + T_KERNEL_TESTS + T_GRAPH_TESTS + T_DEVICE_STEP_TESTS))
BENCH_S=$((T_ENV + T_MEASURE + T_TARGET + T_BENCH))

DRY=0
PART=all
for arg in "$@"; do
    case "$arg" in
        --dry-run) DRY=1 ;;
        --plan)
            echo "tests $TESTS_S: environment $T_ENV, kernel-tests $T_KERNEL_TESTS, graph-tests $T_GRAPH_TESTS," \
                 "device-step-tests $T_DEVICE_STEP_TESTS"
            echo "bench $BENCH_S: environment $T_ENV, measure $T_MEASURE, random-target $T_TARGET, bench $T_BENCH"
            exit 0 ;;
        tests|bench|all) PART=$arg ;;
        *) echo "usage: tools/gpu_check.sh [--dry-run] [tests | bench | all] | --plan" >&2; exit 2 ;;
    esac
done

# The dry run's steps are small, but they share CPUs that may be busy: they get five times as long.
SLACK=$([ "$DRY" = 1 ] && echo 5 || echo 1)
OUT=${OUT:-$ROOT/gpu-check-out}
mkdir -p "$OUT" || { echo "gpu_check: cannot create OUT=$OUT" >&2; exit 2; }
LOG=$OUT/gpu_check.log
FAILED=()
log() { echo "[gpu_check $(date +%T)] $*" | tee -a "$LOG"; }
step() {  # step NAME SECONDS COMMAND...: run under a timeout, append its output to the log, remember a failure
    local name=$1 secs=$(($2 * SLACK)) rc=0; shift 2
    log "$name (at most $secs s): $*"
    timeout --kill-after=10 "$secs" "$@" >> "$LOG" 2>&1 || rc=$?
    if [ "$rc" = 0 ]; then log "$name: ok"
    elif [ "$rc" = 124 ] || [ "$rc" = 137 ]; then log "$name: FAILED (timed out after $secs s)"; FAILED+=("$name")
    else log "$name: FAILED (exit status $rc)"; FAILED+=("$name"); fi
}
give_up() { log "$*"; exit 2; }

command -v timeout > /dev/null || give_up "no \`timeout\` command (coreutils) on this machine"
PY=${PYTHON:-$(command -v python3 || command -v python || true)}  # PYTHON: another interpreter
[ -n "$PY" ] || give_up "no python3 or python on PATH (or name one in PYTHON)"

# Scratch space outside the checkout and outside $OUT: the import shim and the random target.
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu-check.XXXXXX") || give_up "cannot create a temporary folder"
trap 'rm -rf "$WORK"' EXIT
# minispec_weights is weights/ (pyproject's package-dir); run from the checkout. (minispec.kernels is
# minispec/kernels/, found through the checkout itself.)
mkdir -p "$WORK/shim" && ln -s "$ROOT/weights" "$WORK/shim/minispec_weights" \
    || give_up "cannot link the checkout's weights/ into $WORK/shim"
export PYTHONPATH=$ROOT:$WORK/shim${PYTHONPATH:+:$PYTHONPATH}
export TRITON_DEFAULT_FP_FUSION=1

# The environment: torch first (without it nothing else can even say what is missing), then a GPU,
# then every package the steps import. Nothing can be installed there: a missing one stops the check.
torch=$("$PY" -c "import torch; print(int(torch.cuda.is_available()), torch.__version__)" 2>> "$LOG") \
    || give_up "torch is missing or broken ($PY -c 'import torch' failed; see the log); the check uses this machine's own torch"
if [ "$DRY" = 0 ] && [ "${torch%% *}" != 1 ]; then
    give_up "no CUDA device: torch ${torch#* } sees none; on a CPU machine run with --dry-run"
fi
missing=$("$PY" -c "
import importlib.util
needed = ('triton', 'transformers', 'tokenizers', 'safetensors', 'einops', 'jinja2', 'numpy', 'pytest', 'hypothesis', 'tqdm')
print(' '.join(m for m in needed if importlib.util.find_spec(m) is None))" 2>> "$LOG") \
    || give_up "could not ask $PY which packages it has (see the log)"
[ -z "$missing" ] || give_up "missing Python packages: $missing (nothing can be installed on the GPU machine)"
step environment "$T_ENV" "$PY" -c "
import importlib.util, platform, torch, triton, minispec
print('python', platform.python_version(), 'torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda)
print('minispec from', minispec.__file__)
print('device', torch.cuda.get_device_name() if torch.cuda.is_available() else 'none')
print('gguf', 'installed' if importlib.util.find_spec('gguf') else 'not installed (not needed: nothing here reads a GGUF)')"

if [ "$PART" != bench ]; then
    # 1. The kernels against their torch twins (bf16 included on a GPU; a few small cases interpreted on
    # CPU), CUDA-graph replay against eager steps (on CPU: the static layout run eagerly), then the
    # device step against the host step, its transfers counted, on CUDA (these files' fixtures put
    # their models there where there is one): the selection below, the most telling first (-v: a
    # timeout still shows which tests passed); on CPU one tree case of the same files.
    PYTEST=("$PY" -m pytest -q -p no:cacheprovider)
    DEVICE_STEP=(tests/test_speculative_tree_device.py tests/test_transfers_options.py tests/test_transfers_tree.py
                 tests/test_transfers.py tests/test_pathwise.py tests/test_adaptive_on_device.py)
    DEVICE_STEP_K="device_walk_decides or (host_steps_tokens and not -1]) or mixed_batch_and_a_penalised"
    DEVICE_STEP_K+=" or (interrupted and walk_on_device) or stops_where_the_host_loop_stops"
    DEVICE_STEP_K+=" or upload_and_one_download or rides_in_the_same_upload or counter_sees or options_act"
    DEVICE_STEP_K+=" or (laid_out_for_the_device and ([model] or [ngram] or [eagle+lookup]))"
    if [ "$DRY" = 1 ]; then
        TRITON_INTERPRET=1 step kernel-tests "$T_KERNEL_TESTS" "${PYTEST[@]}" -x tests/test_kernels.py -k "write_kv_scatters"
        step graph-tests "$T_GRAPH_TESTS" "${PYTEST[@]}" -x tests/test_graphs.py -k "prompts_take or padding"
        step device-step-tests "$T_DEVICE_STEP_TESTS" "${PYTEST[@]}" -x "${DEVICE_STEP[@]}" \
            -k "host_steps_tokens and eagle-tree-pathwise-3]"
    else
        step kernel-tests "$T_KERNEL_TESTS" "${PYTEST[@]}" tests/test_kernels.py -m "slow or not slow"
        step graph-tests "$T_GRAPH_TESTS" "${PYTEST[@]}" tests/test_graphs.py
        step device-step-tests "$T_DEVICE_STEP_TESTS" "$PY" -m pytest -v -p no:cacheprovider "${DEVICE_STEP[@]}" \
            -k "$DEVICE_STEP_K"
    fi
fi

if [ "$PART" != tests ]; then
    # 2. The measurement (most valuable first: it starts no section past its budget, a minute before
    # its timeout, and writes what it has after each); on CPU every section at tiny sizes.
    MEASURE=(--out "$OUT" --budget-s $((T_MEASURE * SLACK - 60)))
    [ "$DRY" = 1 ] && MEASURE+=(--tiny)
    step measure "$T_MEASURE" "$PY" tools/gpu_measure.py "${MEASURE[@]}"
    # 3. The bench on a target of SmolLM2-135M-Instruct's shape with random weights (the real one
    # cannot travel), with the shipped drafters; on CPU a tiny random pair.
    PAIR=$WORK/pair
    if [ "$DRY" = 1 ]; then
        step random-target "$T_TARGET" "$PY" tools/random_pair.py "$PAIR" --size tiny --device cpu
        DRAFTS=(--draft "$PAIR/draft")
        BENCH=(--quick --dtype float32 --row-invariant off --no-peers --drafters draft,ngram --rounds 6 --max-tokens 6)
    else
        step random-target "$T_TARGET" "$PY" tools/random_pair.py "$PAIR" --size smollm2 --device cuda
        DRAFTS=(--draft weights/draft-smollm2 --eagle weights/eagle-smollm2)
        BENCH=(--dtype bfloat16 --drafters eagle,eagle-tree,draft,ngram --ks 4 --eagle-ks 4 --tree-budgets 32
               --tree-confidence 0 --batch-sizes 1,16 --modes greedy --rounds 6 --max-tokens 32)
    fi
    if [ -f "$PAIR/target/config.json" ]; then
        step bench "$T_BENCH" "$PY" bench.py --target "$PAIR/target" "${DRAFTS[@]}" "${BENCH[@]}" \
            --no-plots --no-progress --json "$OUT/bench.json"
    else
        log "bench: not run (no target was written; see random-target above)"
        FAILED+=(bench)
    fi
fi

if [ ${#FAILED[@]} -gt 0 ]; then log "failed: ${FAILED[*]}"; exit 1; fi
log "all steps passed ($PART); results in $OUT"
