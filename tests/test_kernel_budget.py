"""The Mosaic GPU kernels' register budget on H100 (issue 18, item 5), read from ptxas's report.

Each kernel (forward, state recomputation, backward) is compiled on its own for H100 (sm_90a)
through `recurrax.targets.compile_for`, without a GPU (marker `compile`: CI's compile leg).
Where the CUDA toolchain is missing the tests skip, saying why, or fail under
`RECURRAX_REQUIRE_TOOLCHAIN=1` (`test_compile.need`).

The budget, in spilled bytes per thread (stores and loads each):

| K   | forward, states | backward: no decay | per head | per key channel |
|-----|-----------------|--------------------|----------|-----------------|
| 64  | 0               | 0                  | 0        | 0               |
| 128 | 0               | 170                | 300      | 1300            |

At K = 128 the backward may spill a quarter of what it did before this budget (commit a57aea4:
~680 B, ~1.2 KB and 4.7–5.4 KB; `benchmarks/results/kernel_resources.md` has both).
"""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from test_compile import need

from recurrax import targets

pytestmark = pytest.mark.compile

B, T, H = 2, 256, 2  # K = V: no grid axis of size 1, as in `recurrax.tools.compile.REPRESENTATIVE`
BACKWARD_BUDGET = {(128, "none"): 170, (128, "head"): 300, (128, "key"): 1300}
"""Spill bytes the backward may have; every other kernel: none."""


def resources(K: int, gate: str, kernel: str, packed: bool) -> targets.KernelResources:
    """ptxas's report of one Mosaic GPU kernel compiled for H100 (`kernel`: fwd, states or bwd),
    each in a process of its own: in one process that compiles several kernels of the same
    name, ptxas's text was seen to arrive after the compile it belongs to, and to be paired
    with the next one."""
    need("h100")
    here = Path(__file__).parent
    code = f"import sys; sys.path.insert(0, {str(here)!r}); import test_kernel_budget as t; t.child({K}, {gate!r}, " \
           f"{kernel!r}, {packed})"
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=dict(os.environ))
    assert child.returncode == 0, child.stderr[-3000:]
    return targets.KernelResources(**json.loads(child.stdout.strip().splitlines()[-1]))


def child(K: int, gate: str, kernel: str, packed: bool) -> None:
    """The child process of `resources`: compile, then print the report as one JSON line."""
    targets.prepare_environment()
    report = compile_one(K, gate, kernel, packed)
    print(json.dumps(dataclasses.asdict(report)), flush=True)


def compile_one(K: int, gate: str, kernel: str, packed: bool) -> targets.KernelResources:
    from recurrax.kernels import KernelConfig
    from recurrax.kernels.mosaic_gpu._recurrent_backward import chunk_backward
    from recurrax.kernels.mosaic_gpu._recurrent_forward import chunk_forward
    from recurrax.problem import Gate

    static = KernelConfig(K**-0.5, {"none": None, "head": Gate.HEAD, "key": Gate.KEY}[gate], False)
    V, rows = K, 1 if packed else B  # (packed sequences are one row)
    q, v = jax.ShapeDtypeStruct((rows, T, H, K), jnp.bfloat16), jax.ShapeDtypeStruct((rows, T, H, V), jnp.bfloat16)
    decay = {"none": None, "head": (rows, T, H), "key": (rows, T, H, K)}[gate]
    a = None if decay is None else jax.ShapeDtypeStruct(decay, jnp.float32)
    states = jax.ShapeDtypeStruct((3 if packed else B, H, K, V), jnp.float32)
    meta = jax.ShapeDtypeStruct((3, T // 64), jnp.int32) if packed else None
    if kernel == "bwd":
        chunks = jax.ShapeDtypeStruct((rows, H, T // 64, K, V), jnp.float32)

        def fn(q, k, v, a, do, chunks, h_T, dh_T, meta):
            return chunk_backward(q, k, v, a, do, chunks, h_T, dh_T, meta, static=static)

        args = (q, q, v, a, v, chunks, states, states, meta)
    else:

        def fn(q, k, v, a, h0, meta):
            return chunk_forward(q, k, v, a, h0, meta, static=static, emit_output=kernel == "fwd",
                                 emit_states=kernel == "states")

        args = (q, q, v, a, states, meta)
    compiled = targets.compile_for("h100", fn, *args)
    (report,) = compiled.kernels
    assert report.name == f"recurrax_mgpu_chunk_{kernel}" and report.arch == "sm_90a"
    return report


def check(K: int, gate: str, kernel: str, packed: bool) -> None:
    report = resources(K, gate, kernel, packed)
    budget = BACKWARD_BUDGET.get((K, gate), 0) if kernel == "bwd" else 0
    assert report.spill_stores <= budget and report.spill_loads <= budget, (
        f"{report.name} (K={K}, gate {gate}, {'packed' if packed else 'dense'}): {report.registers} registers, "
        f"{report.spill_stores} B spill stores / {report.spill_loads} B loads per thread; budget {budget} B")


CASES = [(K, gate, kernel) for K in (64, 128) for gate in ("none", "head", "key") for kernel in ("fwd", "states", "bwd")]


@pytest.mark.parametrize(("K", "gate", "kernel"), CASES)
def test_h100_register_budget(K, gate, kernel):
    check(K, gate, kernel, packed=False)


@pytest.mark.slow
@pytest.mark.parametrize(("K", "gate", "kernel"), CASES)
def test_h100_register_budget_packed(K, gate, kernel):
    check(K, gate, kernel, packed=True)
