"""Errors of the Mosaic GPU kernels against the float64 reference, in Mosaic GPU interpret mode.

    python benchmarks/mosaic_accuracy.py          # JAX >= 0.12; writes benchmarks/results/mosaic_accuracy.md

For each case (the cases of `tests/test_kernels_mosaic_gpu.py`, races detected) it lists the
output, the final state and every gradient: the kernels' max-relative error (max |x − ref| /
max |ref|) and norm-relative error (‖x − ref‖ / ‖ref‖), and beside them the same two errors
of the float64 answer merely rounded to the dtype the kernels return it in (the input dtype
for the output and dq, dk, dv; float32 for states and gate gradients): the floor no 16-bit
kernel can go under. A few minutes on a 2-core CPU.
"""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
jax.config.update("jax_enable_x64", True)

import test_kernels_mosaic_gpu as kernel_tests  # noqa: E402  (the interpret-mode harness)
from _cases import Case, make_inputs, max_rel_error, run_vjp  # noqa: E402

BF16 = kernel_tests.BF16
CASES = {
    "no decay, T=100, grouped heads": Case(T=100, **BF16),
    "g + g_gamma, reverse": Case(T=128, gates=("g_head", "g_gamma"), reverse=True, **BF16),
    "g per head, packed": Case(**BF16, gates=("g_head",), cu_seqlens=(0, 50, 50, 150)),
    "gk, T=100": Case(T=100, gates=("gk",), **BF16),
    "g per channel, packed, reverse": Case(**BF16, gates=("g_channel",), cu_seqlens=(0, 50, 50, 150), reverse=True),
    "g + gk, K=128, packed, reverse": Case(**{**BF16, "K": 128}, gates=("g_head", "gk"), cu_seqlens=(0, 50, 50, 150),
                                           reverse=True),
    "gk, K=128, float16, T=130": Case(**{**BF16, "K": 128, "dtype": "float16"}, T=130, gates=("gk",)),
}
RESULTS = REPO / "benchmarks" / "results" / "mosaic_accuracy.md"


def rounding_floor(reference: np.ndarray, dtype) -> tuple[float, float]:
    rounded = np.asarray(jnp.asarray(reference).astype(dtype), np.float64)
    return max_rel_error(rounded, reference), float(np.linalg.norm(rounded - reference) / np.linalg.norm(reference))


def case_rows(name: str, case: Case) -> list[str]:
    errors = kernel_tests.errors(case)
    inputs = make_inputs(case, 0)
    exact = {k: (v.astype(jnp.float64) if hasattr(v, "dtype") and v.dtype == inputs["query"].dtype else v)
             for k, v in inputs.items()}
    output, state, grads = run_vjp("reference", exact)
    references = {"output": output, "final_state": state, **{"d" + k: v for k, v in grads.items()}}
    rows = []
    for quantity, (max_rel, norm_rel) in errors.items():
        if quantity not in references:
            continue
        returned_in = inputs["query"].dtype if quantity in ("output", "dquery", "dkey", "dvalue") else np.float32
        floor = rounding_floor(np.asarray(references[quantity], np.float64), returned_in)
        rows.append(f"| {name} | {quantity} | {max_rel:.1e} | {norm_rel:.1e} | {floor[0]:.1e} | {floor[1]:.1e} |")
    return rows


def main() -> int:
    lines = [
        "# Mosaic GPU kernels vs the float64 reference (interpret mode, CPU)", "",
        f"`python benchmarks/mosaic_accuracy.py` — JAX {jax.__version__}; races detected (none reported).", "",
        "| case | quantity | kernel max-rel | kernel norm-rel | rounding floor max-rel | rounding floor norm-rel |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for name, case in CASES.items():
        lines += case_rows(name, case)
        print(lines[-1], flush=True)
    RESULTS.write_text("\n".join(lines) + "\n")
    print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
