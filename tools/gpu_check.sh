#!/usr/bin/env bash
# The one command that checks minispec on a GPU machine with the real pair, writing every result
# under $OUT (at most 8 files: gpu_check.log with every step's output, bench.json, roofline.json).
#
#   python tools/carry_target.py split      # here, once: the default target's GGUF in two halves
#   # GPU command 1 carries .gpu-carry/target.gguf.1 (and runs nothing but a listing)
#   # GPU command 2 carries .gpu-carry/target.gguf.2 (+ .gpu-wheels if the GPU's Python needs them):
#   tools/gpu_check.sh                      # on the GPU machine (one GPU, its own torch + triton, no internet)
#   tools/gpu_check.sh --dry-run            # on a CPU machine: every step but the GPU ones, at tiny sizes
#   tools/gpu_check.sh --fetch-wheels       # here, with a package index: wheels for the GPU's Python
#
# Steps, most valuable first: the environment; the bf16 kernel tests against their torch twins;
# the real target reassembled from its halves (sha256 checked; else the random pair, said so);
# bench.py on the real pair (CUDA graphs on, bf16): plain vs the EAGLE head (+ prompt lookup, and a tree of 32 nodes), the
# distilled draft and n-gram, greedy and sampled, batch 1 and 16, 128-token answers, paired
# rounds, with transformers' generate and assisted generation as peers and greedy identity
# checked; the batch-1 TPOT against the speed of light and the launch-bound estimate, and what
# eager steps cost under continuous batching (tools/roofline.py); `bench.py --kernels`, each
# kernel's throughput as a share of the measured ceilings. A failing step is reported and the
# others still run; the exit status is non-zero if any failed. The repository's packages run from
# the checkout (PYTHONPATH), so nothing is built.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$PWD
OUT=${OUT:-$ROOT/gpu-check-out}
WHEELS=$ROOT/.gpu-wheels
CARRY=$ROOT/.gpu-carry
DRY=0
case "${1:-}" in
    --dry-run) DRY=1 ;;
    --fetch-wheels)
        # The pure-Python and manylinux wheels minispec and its tests need beyond torch / triton,
        # for the GPU machine's CPython (GPU_PYTHONS, default 3.12: the lent H200's), ~25 MB each.
        mkdir -p "$WHEELS"
        for py in ${GPU_PYTHONS:-3.12}; do
            pip download --quiet --only-binary=:all: --python-version "$py" --platform manylinux2014_x86_64 \
                --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 -d "$WHEELS" \
                einops safetensors tokenizers jinja2 gguf numpy pytest hypothesis tqdm || exit 1
        done
        du -sh "$WHEELS"; exit 0 ;;
    "") ;;
    *) echo "usage: tools/gpu_check.sh [--dry-run | --fetch-wheels]" >&2; exit 2 ;;
esac
mkdir -p "$OUT"
LOG=$OUT/gpu_check.log
FAILED=()
log() { echo "[gpu_check $(date +%T)] $*" | tee -a "$LOG"; }
step() {  # step NAME COMMAND...: run, append its output to the log, remember a failure
    local name=$1; shift
    log "$name: $*"
    if "$@" >> "$LOG" 2>&1; then log "$name: ok"; else log "$name: FAILED"; FAILED+=("$name"); fi
}

# minispec_kernels / minispec_weights are kernels/ and weights/ (pyproject's package-dir); run from the checkout.
SHIM=$(mktemp -d)
ln -s "$ROOT/kernels" "$SHIM/minispec_kernels"
ln -s "$ROOT/weights" "$SHIM/minispec_weights"
export PYTHONPATH=$ROOT:$SHIM${PYTHONPATH:+:$PYTHONPATH}
export TRITON_DEFAULT_FP_FUSION=1
export MINISPEC_CACHE=$CARRY/cache  # the converted target lives beside its halves, not in $HOME

step environment python -c "
import platform, torch, triton
print('python', platform.python_version(), 'torch', torch.__version__, 'triton', triton.__version__)
print('cuda', torch.cuda.is_available(), torch.version.cuda, torch.cuda.get_device_name() if torch.cuda.is_available() else '-')"
if [ "$DRY" = 0 ] && ! python -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
    log "no CUDA device: run with --dry-run on a CPU machine"; exit 2
fi

missing=$(python -c "
import importlib.util
print(' '.join(m for m in ('einops', 'safetensors', 'tokenizers', 'jinja2', 'gguf', 'numpy', 'pytest', 'hypothesis', 'tqdm')
               if importlib.util.find_spec(m) is None))")
if [ -n "$missing" ]; then
    step install pip install --no-index --find-links "$WHEELS" $missing
fi

# 1. The kernels against their twins (bf16 included on the GPU; a few small cases interpreted on CPU).
if [ "$DRY" = 1 ]; then
    export TRITON_INTERPRET=1
    step kernel-tests python -m pytest -q -x tests/test_kernels.py -k "write" -p no:cacheprovider
    unset TRITON_INTERPRET
else
    step kernel-tests python -m pytest -q tests/test_kernels.py -m "slow or not slow" -p no:cacheprovider
fi

# 2. The real target, whole again; else the random pair of realistic size (no acceptance to speak of).
if [ "$DRY" = 1 ] && [ ! -f "$CARRY/target.gguf.2" ]; then
    step split python tools/carry_target.py split
fi
if python tools/carry_target.py join "$CARRY/target.gguf" >> "$LOG" 2>&1; then
    log "target: the real SmolLM2-135M-Instruct (sha256 checked)"
    TARGET=$(python -c "
import sys; sys.path.insert(0, '$ROOT')
from pathlib import Path
from minispec.io.convert import convert_gguf
out = Path('$CARRY/cache/SmolLM2-135M-Instruct')
print(out if (out / 'config.json').exists() else convert_gguf('$CARRY/target.gguf', out))" 2>> "$LOG")
    PAIR=(--target "$TARGET" --draft weights/draft-smollm2 --eagle weights/eagle-smollm2)
    DRAFTERS=eagle,eagle+lookup,eagle-tree,draft,ngram
else
    log "target: the halves did not make the GGUF (see above); falling back to the random-init pair"
    step random-pair python tools/random_pair.py "$OUT/pair" --size "$([ "$DRY" = 1 ] && echo tiny || echo 1b)"
    TARGET=$OUT/pair/target
    PAIR=(--target "$TARGET" --draft "$OUT/pair/draft")
    DRAFTERS=draft,ngram
fi

# 3. The main job on the pair, then the roofline, then the kernels' shares of the ceilings.
if [ "$DRY" = 1 ]; then
    BENCH=(--quick --no-peers --drafters "${DRAFTERS/eagle+lookup,/}" --rounds 6 --max-tokens 6)
    ROOF=(--tokens 4 --requests 6)
else
    BENCH=(--drafters "$DRAFTERS" --ks 4 --eagle-ks 4 --tree-budgets 32 --tree-top-k 8 --batch-sizes 1,16 --modes greedy,sampled --rounds 8 --max-tokens 128)
    ROOF=(--tokens 128 --requests 32)
fi
step bench python bench.py "${PAIR[@]}" "${BENCH[@]}" --no-plots --no-progress --json "$OUT/bench.json"
step roofline python tools/roofline.py --target "$TARGET" --json "$OUT/roofline.json" "${ROOF[@]}"
step kernel-bench python bench.py --kernels

rm -rf "$SHIM" "$OUT/pair"
if [ ${#FAILED[@]} -gt 0 ]; then log "failed: ${FAILED[*]}"; exit 1; fi
log "all steps passed; results in $OUT"
