#!/usr/bin/env bash
# The one command that checks minispec on a GPU machine, writing every result under $OUT.
#
#   tools/gpu_check.sh             # on the GPU machine (one GPU, its own torch + triton, no internet)
#   tools/gpu_check.sh --dry-run   # on a CPU machine: every step but the GPU ones, on tiny sizes
#
# Steps: record the environment; install what is missing from wheels carried in .gpu-wheels/
# (made beforehand, with internet, by `tools/gpu_check.sh --fetch-wheels`; never from an index);
# the kernel tests on the GPU against their torch references (bf16 included); `bench.py --kernels`;
# the engine's tests (CUDA graphs vs eager included); then bench.py on a random-init pair of realistic size built on the
# spot (the real target does not fit the carry limit: acceptance comes from the CPU runs, step
# times and verification cost from here). Each step's output goes to $OUT/<step>.log; a failing
# step is reported and the others still run; the exit status is non-zero if any failed.
# The repository's own packages run from the checkout (PYTHONPATH), so nothing is built.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$PWD
OUT=${OUT:-$ROOT/gpu-check-out}
WHEELS=$ROOT/.gpu-wheels
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
                einops safetensors tokenizers jinja2 gguf numpy pytest hypothesis || exit 1
        done
        du -sh "$WHEELS"; exit 0 ;;
    "") ;;
    *) echo "usage: tools/gpu_check.sh [--dry-run | --fetch-wheels]" >&2; exit 2 ;;
esac
mkdir -p "$OUT"
FAILED=()
log() { echo "[gpu_check $(date +%T)] $*" | tee -a "$OUT/gpu_check.log"; }
step() {  # step NAME COMMAND...: run, log to $OUT/NAME.log, remember a failure
    local name=$1; shift
    log "$name: $*"
    if "$@" > "$OUT/$name.log" 2>&1; then log "$name: ok"; else log "$name: FAILED (see $OUT/$name.log)"; FAILED+=("$name"); fi
}

# minispec_kernels is the kernels/ folder (pyproject's package-dir); run both from the checkout.
SHIM=$(mktemp -d)
ln -s "$ROOT/kernels" "$SHIM/minispec_kernels"
export PYTHONPATH=$ROOT:$SHIM${PYTHONPATH:+:$PYTHONPATH}
export TRITON_DEFAULT_FP_FUSION=1

step environment python -c "
import platform, torch, triton
print('python', platform.python_version(), 'torch', torch.__version__, 'triton', triton.__version__)
print('cuda', torch.cuda.is_available(), torch.version.cuda, torch.cuda.get_device_name() if torch.cuda.is_available() else '-')"
cat "$OUT/environment.log"
if [ "$DRY" = 0 ] && ! python -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
    log "no CUDA device: run with --dry-run on a CPU machine"; exit 2
fi

missing=$(python -c "
import importlib.util
print(' '.join(m for m in ('einops', 'safetensors', 'tokenizers', 'jinja2', 'gguf', 'numpy', 'pytest', 'hypothesis')
               if importlib.util.find_spec(m) is None))")
if [ -n "$missing" ]; then
    step install pip install --no-index --find-links "$WHEELS" $missing
fi

if [ "$DRY" = 1 ]; then
    # CPU: the kernels under the interpreter (a few small cases) and the tiny random pair.
    export TRITON_INTERPRET=1
    step kernel-tests python -m pytest -q -x tests/test_kernels.py -k "paged or prefill or write" -p no:cacheprovider
    step engine-tests python -m pytest -q -x tests/test_speculative_greedy.py tests/test_graphs.py -p no:cacheprovider
    SIZE=tiny; BENCH=(--quick --no-peers --no-plots)
else
    step kernel-tests python -m pytest -q tests/test_kernels.py -m "slow or not slow" -p no:cacheprovider
    step kernel-bench python bench.py --kernels
    step engine-tests python -m pytest -q tests/test_speculative_greedy.py tests/test_engine.py tests/test_api.py \
        tests/test_reliability.py tests/test_graphs.py -p no:cacheprovider
    SIZE=1b; BENCH=(--batch-sizes 1,16 --ks 2,4 --drafters draft,ngram --rounds 6 --max-tokens 128 --no-peers)
fi
step random-pair python tools/random_pair.py "$OUT/pair" --size "$SIZE"
step bench python bench.py --target "$OUT/pair/target" --draft "$OUT/pair/draft" "${BENCH[@]}" \
    --json "$OUT/bench.json" --out "$OUT/plots"

rm -rf "$SHIM" "$OUT/pair"
if [ ${#FAILED[@]} -gt 0 ]; then log "failed: ${FAILED[*]}"; exit 1; fi
log "all steps passed; results in $OUT"
