#!/usr/bin/env bash
# The prepared GPU run of issue 6: check the Pallas kernels (and XLA chunk) against the
# float64 reference on the GPU, time forward and forward+backward in bf16 against
# flash-linear-attention, and write benchmarks/results/gpu.md (also copied to $OUT).
#
# The GPU machine has no network. Its image has JAX (CUDA), PyTorch and Triton, not
# flash-linear-attention, so bring fla-core (pure Python) as a wheel:
#
#   bash benchmarks/gpu.sh fetch        # here, with network: fla-core wheel into .whl/
#   # then, with the device tool, from the repo root (about 9 minutes):
#   #   run(command="bash benchmarks/gpu.sh", carry=[".whl"], timeout_s=600)
#   # and commit benchmarks/results/gpu.md from the files that come back.
#
# On any machine with a GPU and network, `bash benchmarks/gpu.sh` alone works (it falls
# back to `pip install fla-core`). `bash benchmarks/gpu.sh smoke` tries the whole script
# on a CPU with tiny shapes in interpret mode (no fla, no GPU figures).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
FLA_VERSION=${FLA_VERSION:-0.6.0}

if [ "${1:-}" = fetch ]; then
    grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
    exec "$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        -d .whl "fla-core==$FLA_VERSION"
fi

SMOKE=()
budgets=(100 190 80)
if [ "${1:-}" = smoke ]; then
    SMOKE=(--smoke)
    budgets=(60 60 10)
fi

if ls .whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site
elif [ ${#SMOKE[@]} -eq 0 ] && ! "$PY" -c "import fla" 2>/dev/null; then
    "$PY" -m pip install -q "fla-core==$FLA_VERSION" || echo "fla-core not installed: fla columns will say so" >&2
fi
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}"
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1

tmp=$(mktemp -d)
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || true
# Each step is its own process: x64 JAX for the float64 oracle, plain JAX for timing, PyTorch for fla.
timeout $((budgets[0] + 45)) "$PY" benchmarks/gpu_bench.py check --json "$tmp/check.json" --budget "${budgets[0]}" "${SMOKE[@]}"
timeout $((budgets[1] + 60)) "$PY" benchmarks/gpu_bench.py time-jax --json "$tmp/jax.json" --budget "${budgets[1]}" "${SMOKE[@]}"
if [ ${#SMOKE[@]} -eq 0 ]; then
    timeout $((budgets[2] + 30)) "$PY" benchmarks/gpu_bench.py time-fla --json "$tmp/fla.json" --budget "${budgets[2]}"
fi
out=benchmarks/results/gpu.md
[ ${#SMOKE[@]} -eq 0 ] || out="$tmp/gpu-smoke.md"
"$PY" benchmarks/gpu_bench.py report --json "$tmp"/*.json --out "$out" "${SMOKE[@]}"
if [ -n "${OUT:-}" ]; then cp "$out" "$tmp"/*.json "$OUT"/; fi
