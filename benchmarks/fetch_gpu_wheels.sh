#!/usr/bin/env bash
# Download the Python packages the GPU run (benchmarks/gpu.sh) needs and the H200 image lacks, as
# wheels for its python3 (CPython 3.12, manylinux x86_64), into .whl/ at the repo root, which
# .git/info/exclude keeps out of git (never commit them). Run it here, where there is network;
# then pass carry=[".whl"] to the device call (64 MiB limit per call; these are about 2.4 MiB).
#
#   fla-core 0.6.0               flash-linear-attention's kernels (pure Python + Triton)
#   flash-linear-attention 0.6.0 the `fla` package's layers/models half (pulls fla-core)
#   jax-linear-attention 0.1.0   package `jla`; its Mosaic GPU kernels for Hopper (needs jax 0.11.2)
#
# Their other requirements are on the image already (KINDS.md's package list, 2026-11-17):
# einops, transformers (5.x), torch, triton (fla); jax 0.11.2, equinox, optax, numpy, safetensors
# (jla). The script prints each wheel's Requires-Dist so that a change shows up.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
mkdir -p .whl
"$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "fla-core==0.6.0" "flash-linear-attention==0.6.0" "jax-linear-attention==0.1.0"
for wheel in .whl/*.whl; do
    echo "== $wheel ($(du -k "$wheel" | cut -f1) KiB)"
    unzip -p "$wheel" '*.dist-info/METADATA' | grep '^Requires-Dist' | grep -v 'extra ==' || true
done
total=$(du -sk .whl | cut -f1)
echo "total: $total KiB"
if [ "$total" -gt 40960 ]; then echo "fetch_gpu_wheels.sh: .whl/ is over 40 MiB" >&2; exit 1; fi
