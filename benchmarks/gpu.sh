#!/usr/bin/env bash
# The prepared GPU run (one H200, at most about 9 minutes): compile the kernels dispatch picks for the chip
# (`recurrax compile`, deviceless: registers, spills, shared memory per kernel -> benchmarks/results/gpu_compile.md),
# then check recurrax's GPU implementations against
# the float64 reference, time bf16 forward and forward+backward of them and XLA chunk against
# flash-linear-attention (fla) and jax-linear-attention (jla), and write
# benchmarks/results/gpu.md and gpu.png (also copied to $OUT with the raw JSON).
#
# The GPU machine has no network. Its image has JAX 0.11.2 (CUDA 13), PyTorch 2.11, Triton 3.6,
# einops, transformers, equinox, optax, matplotlib; fla and jla travel as wheels:
#
#   bash benchmarks/fetch_gpu_wheels.sh     # here, with network: the wheels into .whl/ (git-ignored)
#   # then, with the device tool, from the repo root:
#   #   run(command="bash benchmarks/gpu.sh", carry=[".whl"], timeout_s=600)
#   # and commit benchmarks/results/gpu.md and gpu.png from the files that come back.
#
#   bash benchmarks/gpu.sh --smoke --out /tmp/gpu   # any machine, tiny shapes, about 2 minutes on a CPU
#   bash benchmarks/gpu.sh --steps time-jax,time-torch   # some steps only (a second call, say)
#   BUDGETS="70 175 70" bash benchmarks/gpu.sh      # per-step budgets in seconds (check, time-jax, time-torch)
#   COMPILE_TARGET=h100 bash benchmarks/gpu.sh     # the chip the compile step builds for (h100, h200, b200)
#
# Steps run in separate processes (x64 JAX for the oracle, plain JAX for timing, PyTorch for fla),
# each under `timeout` and with a budget after which it starts no new measurement; the report is
# rewritten after every step, so a run cut short still leaves a partial table.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
SMOKE=()
out_dir=
budgets=(70 175 70)   # seconds: check, time-jax, time-torch (each step's timeout adds 50, 70, 40)
steps=compile,check,time-jax,time-torch
compile_seconds=75    # the compile step's timeout; its table is written row by row
while [ $# -gt 0 ]; do
    case "$1" in
        --smoke|smoke) SMOKE=(--smoke); budgets=(40 60 20); compile_seconds=40 ;;
        --out) out_dir=$2; shift ;;
        --steps) steps=$2; shift ;;
        *) echo "usage: bash benchmarks/gpu.sh [--smoke] [--out DIR] [--steps compile,check,time-jax,time-torch]" >&2; exit 2 ;;
    esac
    shift
done
if [ -n "${BUDGETS:-}" ]; then read -r -a budgets <<< "$BUDGETS"; fi
if [ -z "$out_dir" ]; then  # a smoke run never overwrites the committed results
    if [ ${#SMOKE[@]} -gt 0 ]; then out_dir=$(mktemp -d); else out_dir=benchmarks/results; fi
fi
mkdir -p "$out_dir"
start=$SECONDS

if ls .whl/*.whl >/dev/null 2>&1; then
    site=$(mktemp -d)
    if "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl; then
        export PYTHONPATH=$site
    else
        echo "gpu.sh: the wheels in .whl/ did not install for $("$PY" -V): fla/jla columns will say so" >&2
    fi
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1

tmp=$(mktemp -d)
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv,noheader 2>/dev/null || true
report() {
    "$PY" benchmarks/gpu_bench.py report --json "$tmp"/*.json --out "$out_dir/gpu.md" "${SMOKE[@]}" > /dev/null \
        || echo "gpu.sh: report failed" >&2
    if [ -n "${OUT:-}" ]; then cp "$out_dir"/gpu.md "$out_dir"/gpu.png "$tmp"/*.json "$OUT"/ 2>/dev/null; fi
    echo "gpu.sh: $1 done at $((SECONDS - start)) s" >&2
}
step() {  # step NAME BUDGET MARGIN
    case ",$steps," in *",$1,"*) ;; *) return ;; esac
    timeout $(($2 + $3)) "$PY" benchmarks/gpu_bench.py "$1" --json "$tmp/$1.json" --budget "$2" "${SMOKE[@]}"
    report "$1"
}
compile_step() {  # the resource table first: a kernel that does not build or spills shows here
    case ",$steps," in *",compile,"*) ;; *) return ;; esac
    JAX_PLATFORMS=cpu timeout "$compile_seconds" "$PY" -m recurrax.tools.cli compile --target "${COMPILE_TARGET:-h200}" \
        --gates none channel > "$out_dir/gpu_compile.md" 2> "$tmp/compile.err" \
        || echo "gpu.sh: compile step stopped: $(tail -n 3 "$tmp/compile.err")" >&2
    cat "$out_dir/gpu_compile.md"
    if [ -n "${OUT:-}" ]; then cp "$out_dir/gpu_compile.md" "$OUT"/ 2>/dev/null; fi
    echo "gpu.sh: compile done at $((SECONDS - start)) s" >&2
}
compile_step
step check "${budgets[0]}" 50
step time-jax "${budgets[1]}" 70
step time-torch "${budgets[2]}" 40
cat "$out_dir/gpu.md"
