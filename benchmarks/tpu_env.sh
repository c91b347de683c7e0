# Set-up for a run on a fresh TPU VM without network, sourced by the TPU benchmarks:
#   source benchmarks/tpu_env.sh            # from the repo root, then run python3 benchmarks/...
# Installs what recurrax, its reports and ejKernel need (jaxtyping, matplotlib, absl-py, toolz,
# einops; flax and optax for recurrax.nn and tpu_train.py; the server's packages for serve.py) from the machine's own package index
# (PIP_INDEX, default file:///opt/pypi/simple) into a temporary folder on PYTHONPATH, the machine's own JAX kept first; ejKernel from wheels in
# .whl-tpu/ when that folder is there (`pip download` them where pip reaches PyPI:
# benchmarks/README.md says which); puts this checkout's src/ first on PYTHONPATH.
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
if ! "$PY" -c 'import jaxtyping, matplotlib' 2>/dev/null; then
    _site=$(mktemp -d)
    PIP_CONFIG_FILE=/dev/null "$PY" -m pip install -q --isolated --only-binary=:all: \
        --index-url "${PIP_INDEX:-file:///opt/pypi/simple}" --target "$_site" jaxtyping matplotlib absl-py toolz einops \
        || echo "tpu_env.sh: set-up from the package index failed" >&2
    rm -rf "$_site"/jax "$_site"/jaxlib "$_site"/jax-* "$_site"/jaxlib-* "$_site"/numpy "$_site"/numpy-*  # the machine's own stay
    export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$_site"
fi
if ! "$PY" -c 'import flax, optax' 2>/dev/null; then  # recurrax.nn and the training benchmarks (tpu_train.py)
    _nn=$(mktemp -d)
    _nn_install() { PIP_CONFIG_FILE=/dev/null "$PY" -m pip install -q --isolated --only-binary=:all: \
        --index-url "${PIP_INDEX:-file:///opt/pypi/simple}" --target "$_nn" "$@"; }
    # the versions the project tests against JAX 0.10, else the index's own
    _nn_install "flax==0.12.8" "optax==0.2.8" || _nn_install "flax>=0.12" "optax>=0.2" \
        || echo "tpu_env.sh: flax/optax from the package index failed" >&2
    rm -rf "$_nn"/jax "$_nn"/jaxlib "$_nn"/jax-* "$_nn"/jaxlib-* "$_nn"/numpy "$_nn"/numpy-*  # the machine's own stay
    export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$_nn"
fi
if ! "$PY" -c 'import safetensors, tokenizers, jinja2, starlette, uvicorn, httpx' 2>/dev/null; then  # serve.py
    _serve=$(mktemp -d)
    PIP_CONFIG_FILE=/dev/null "$PY" -m pip install -q --isolated --only-binary=:all: \
        --index-url "${PIP_INDEX:-file:///opt/pypi/simple}" --target "$_serve" safetensors tokenizers jinja2 starlette \
        uvicorn httpx || echo "tpu_env.sh: the server's packages from the package index failed" >&2
    rm -rf "$_serve"/jax "$_serve"/jaxlib "$_serve"/jax-* "$_serve"/jaxlib-* "$_serve"/numpy "$_serve"/numpy-*
    export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$_serve"
fi
if [ -d .whl-tpu ] && ! "$PY" -c 'import ejkernel' 2>/dev/null; then
    _wheels=$(mktemp -d)
    PIP_CONFIG_FILE=/dev/null "$PY" -m pip install -q --isolated --no-index --no-deps --no-compile --target "$_wheels" \
        .whl-tpu/*.whl || echo "tpu_env.sh: ejKernel's wheels did not install" >&2
    export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$_wheels"
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c "import jax; print(jax.__version__, jax.devices())" || true
