#!/usr/bin/env bash
# The prepared TPU run (a TPU VM, about 14 minutes): compile the TPU kernels for the chip first (`recurrax
# compile`, deviceless: Mosaic's passes, the VMEM check and XLA's memory analysis -> results/tpu_compile.md;
# COMPILE_TARGET=v5e or v6e, v5e by default), then check recurrax's TPU implementations
# (`pallas_tpu`, read from the registry) and XLA chunk against the float64 reference (run on the
# host CPU: TPUs have no float64), time bf16 forward and forward+backward of them at the GPU run's
# three shapes, and write benchmarks/results/tpu.md and tpu.png (also copied to $OUT with the JSON);
# then time the delta rule at Qwen3-Next's layer shape (`benchmarks/delta_rule_tpu.py`: recurrax's
# Pallas TPU kernels, XLA chunk and ejKernel's Pallas GDN if importable, forward and fwd+bwd, T = 4096
# and 16,384 -> results/delta_rule_tpu.md and .json).
#
#   bash benchmarks/tpu.sh                       # on the TPU VM, from the repo root
#   bash benchmarks/tpu.sh --smoke --out /tmp/t  # anywhere: tiny shapes; without a TPU the TPU
#                                                # kernels are skipped with the reason, XLA chunk runs
#
# Needs jax with its TPU plugin, jaxtyping and matplotlib on the VM's python3 (PYTHON=... to
# choose another); recurrax runs from src/. fla and jax-linear-attention are GPU libraries and
# are not timed here. Same script as the GPU run (benchmarks/gpu_bench.py), same guarantees:
# each step under `timeout` with a budget, the report rewritten after every step.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
SMOKE=()
out_dir=
budgets=(150 250)   # seconds: check, time-jax (timeouts add 60, 90)
compile_seconds=60  # the compile step's timeout; its table is written row by row
delta_seconds=300   # the delta-rule step's timeout; its report is rewritten after each length
while [ $# -gt 0 ]; do
    case "$1" in
        --smoke|smoke) SMOKE=(--smoke --oracle-on-host); budgets=(30 40); compile_seconds=40; delta_seconds=120 ;;
        --out) out_dir=$2; shift ;;
        *) echo "usage: bash benchmarks/tpu.sh [--smoke] [--out DIR]" >&2; exit 2 ;;
    esac
    shift
done
if [ -z "$out_dir" ]; then  # a smoke run never overwrites the committed results
    if [ ${#SMOKE[@]} -gt 0 ]; then out_dir=$(mktemp -d); else out_dir=benchmarks/results; fi
fi
mkdir -p "$out_dir"
start=$SECONDS
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

tmp=$(mktemp -d)
"$PY" -c "import jax; print(jax.devices())" 2>/dev/null || true
report() {
    "$PY" benchmarks/gpu_bench.py report --json "$tmp"/*.json --out "$out_dir/tpu.md" --title TPU "${SMOKE[@]}" \
        > /dev/null || echo "tpu.sh: report failed" >&2
    if [ -n "${OUT:-}" ]; then cp "$out_dir"/tpu.md "$out_dir"/tpu.png "$tmp"/*.json "$OUT"/ 2>/dev/null; fi
    echo "tpu.sh: $1 done at $((SECONDS - start)) s" >&2
}
step() {  # step NAME BUDGET MARGIN
    timeout $(($2 + $3)) "$PY" benchmarks/gpu_bench.py "$1" --json "$tmp/$1.json" --budget "$2" \
        --backend tpu --check-baseline --no-jla "${SMOKE[@]}"
    report "$1"
}
JAX_PLATFORMS=cpu timeout "$compile_seconds" "$PY" -m recurrax.tools.cli compile --target "${COMPILE_TARGET:-v5e}" \
    > "$out_dir/tpu_compile.md" 2> "$tmp/compile.err" || echo "tpu.sh: compile step stopped: $(tail -n 3 "$tmp/compile.err")" >&2
cat "$out_dir/tpu_compile.md"
if [ -n "${OUT:-}" ]; then cp "$out_dir/tpu_compile.md" "$OUT"/ 2>/dev/null; fi
echo "tpu.sh: compile done at $((SECONDS - start)) s" >&2
step check "${budgets[0]}" 60
step time-jax "${budgets[1]}" 90
timeout "$delta_seconds" "$PY" benchmarks/delta_rule_tpu.py --out "$out_dir" ${SMOKE[@]:+--smoke} \
    || echo "tpu.sh: delta-rule step stopped" >&2
if [ -n "${OUT:-}" ]; then cp "$out_dir"/delta_rule_tpu.md "$out_dir"/delta_rule_tpu.json "$OUT"/ 2>/dev/null; fi
echo "tpu.sh: delta rule done at $((SECONDS - start)) s" >&2
cat "$out_dir/tpu.md"
