#!/usr/bin/env bash
# The TPU run, one command on a fresh TPU VM without network (under 9 minutes on one v5e):
#   1. set-up: benchmarks/tpu_env.sh (what recurrax, its report and ejKernel need, from the machine's
#      own package index and .whl-tpu/);
#   2. the chip's own tests: `pytest -m tpu` (tests/test_tpu.py: every path of both operations
#      against the float64 reference on the host, float32 and bfloat16);
#   3. both operations timed on every path that can run each call, with each row's fraction of the
#      HBM and MXU roofline (benchmarks/tpu_paths.py -> results/tpu.md, tpu.json, tpu.png);
#   4. the delta rule at Qwen3-Next's layer shape beside ejKernel's Pallas GDN
#      (benchmarks/delta_rule_tpu.py -> results/delta_rule_tpu.md and .json).
# Each step runs under `timeout` and its results are written as it goes; with $OUT set (the device
# tool) they are copied there too.
#
#   bash benchmarks/tpu.sh                       # on the TPU VM, from the repo root
#   bash benchmarks/tpu.sh --smoke --out /tmp/t  # anywhere: tiny shapes, no set-up; the tests skip off a TPU
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
smoke=()
out_dir=
seconds=(210 230 100)   # tests, paths, delta rule
while [ $# -gt 0 ]; do
    case "$1" in
        --smoke|smoke) smoke=(--smoke); seconds=(120 120 120) ;;
        --out) out_dir=$2; shift ;;
        *) echo "usage: bash benchmarks/tpu.sh [--smoke] [--out DIR]" >&2; exit 2 ;;
    esac
    shift
done
if [ -z "$out_dir" ]; then  # a smoke run never overwrites the committed results
    if [ ${#smoke[@]} -gt 0 ]; then out_dir=$(mktemp -d); else out_dir=benchmarks/results; fi
fi
mkdir -p "$out_dir"
start=$SECONDS
export PYTHONUNBUFFERED=1
say() { echo "tpu.sh: $1 at $((SECONDS - start)) s" >&2; }
copy_out() { if [ -n "${OUT:-}" ]; then cp "$@" "$OUT"/ 2>/dev/null; fi; }

if [ ${#smoke[@]} -eq 0 ]; then
    source benchmarks/tpu_env.sh
else
    export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
fi
say "set-up done"

timeout "${seconds[0]}" "$PY" -m pytest -q -o addopts="" -p no:cacheprovider -m tpu tests/test_tpu.py -ra \
    2>&1 | tee "$out_dir/tpu_tests.txt"
copy_out "$out_dir/tpu_tests.txt"
say "tests done"

timeout "${seconds[1]}" "$PY" benchmarks/tpu_paths.py --out "$out_dir" --budget $((seconds[1] - 60)) "${smoke[@]}" \
    || echo "tpu.sh: the paths step stopped" >&2
copy_out "$out_dir/tpu.md" "$out_dir/tpu.json" "$out_dir/tpu.png"
say "paths done"

timeout "${seconds[2]}" "$PY" benchmarks/delta_rule_tpu.py --out "$out_dir" --repeats 3 "${smoke[@]}" \
    || echo "tpu.sh: the delta-rule step stopped" >&2
copy_out "$out_dir/delta_rule_tpu.md" "$out_dir/delta_rule_tpu.json"
say "delta rule done"
