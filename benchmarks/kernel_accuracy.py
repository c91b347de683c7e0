"""Errors of the Pallas kernels against the float64 reference, in JAX's interpret modes (CPU).

    python benchmarks/kernel_accuracy.py mosaic_gpu   # JAX >= 0.12 -> benchmarks/results/accuracy_mosaic_gpu.md
    python benchmarks/kernel_accuracy.py pallas_tpu   # -> benchmarks/results/accuracy_pallas_tpu.md

For each case (those of the kernels' tests: `tests/test_kernels_mosaic_gpu.py` with races
detected, `tests/test_kernels_tpu.py` with its small tiles) it lists the output, the final
state and every gradient: the kernels' max-relative error (max |x − ref| / max |ref|) and
norm-relative error (‖x − ref‖ / ‖ref‖), and beside them the same two errors of the float64
answer merely rounded to the dtype the kernels return it in (the input dtype for the output
and dq, dk, dv; float32 for states and gate gradients): the floor no kernel returning that
dtype can go under. A few minutes each on a 2-core CPU.
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

from _cases import DIFF_ARGS, Case, make_inputs, max_rel_error, run_vjp  # noqa: E402


def mosaic_gpu():
    """(errors, reference outputs, cases) of the Mosaic GPU kernels' tests."""
    import test_kernels_mosaic_gpu as tests

    bf16 = tests.BF16
    cases = {
        "no decay, T=100, grouped heads": Case(T=100, **bf16),
        "g + g_gamma, reverse": Case(T=128, gates=("g_head", "g_gamma"), reverse=True, **bf16),
        "g per head, packed": Case(**bf16, gates=("g_head",), cu_seqlens=(0, 50, 50, 150)),
        "gk, T=100": Case(T=100, gates=("gk",), **bf16),
        "g per channel, packed, reverse": Case(**bf16, gates=("g_channel",), cu_seqlens=(0, 50, 50, 150), reverse=True),
        "g + gk, K=128, packed, reverse": Case(**{**bf16, "K": 128}, gates=("g_head", "gk"),
                                               cu_seqlens=(0, 50, 50, 150), reverse=True),
        "gk, K=128, float16, T=130": Case(**{**bf16, "K": 128, "dtype": "float16"}, T=130, gates=("gk",)),
    }
    return tests.errors, lambda exact: run_vjp("reference", exact), cases


def pallas_tpu():
    """(errors, reference outputs, cases) of the TPU kernels' tests (their small tiles)."""
    import test_kernels_tpu as tests

    cases = {}
    for dtype in ("float32", "bfloat16"):
        small = {**tests.SMALL, "dtype": dtype}
        cases |= {
            f"{dtype}: no decay, T=20, grouped heads": Case(T=20, **small),
            f"{dtype}: g + g_gamma, reverse": Case(T=20, gates=("g_head", "g_gamma"), reverse=True, **small),
            f"{dtype}: g per channel, T=32": Case(T=32, gates=("g_channel",), **small),
            f"{dtype}: g + gk, packed": Case(**small, gates=("g_head", "gk"), cu_seqlens=(0, 3, 3, 4, 30), packed_3d=True),
        }
    return tests.errors, lambda exact: tests._outputs_and_grads("reference", exact), cases


KERNELS = {"mosaic_gpu": mosaic_gpu, "pallas_tpu": pallas_tpu}


def rounding_floor(reference: np.ndarray, dtype) -> tuple[float, float]:
    rounded = np.asarray(jnp.asarray(reference).astype(dtype), np.float64)
    return max_rel_error(rounded, reference), float(np.linalg.norm(rounded - reference) / np.linalg.norm(reference))


def case_rows(name: str, case: Case, errors_of, reference_of) -> list[str]:
    errors = errors_of(case)
    inputs = make_inputs(case, 0)
    exact = {k: (v.astype(jnp.float64) if k in DIFF_ARGS else v) for k, v in inputs.items()}
    output, state, grads = reference_of(exact)
    references = {"output": output, "final_state": state, **{"d" + k: v for k, v in grads.items()}}
    rows = []
    for quantity, (max_rel, norm_rel) in errors.items():
        if quantity not in references:
            continue
        returned_in = inputs["query"].dtype if quantity in ("output", "dquery", "dkey", "dvalue") else np.float32
        floor = rounding_floor(np.asarray(references[quantity], np.float64), returned_in)
        rows.append(f"| {name} | {quantity} | {max_rel:.1e} | {norm_rel:.1e} | {floor[0]:.1e} | {floor[1]:.1e} |")
    return rows


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0] not in KERNELS:
        print(__doc__)
        return 2
    errors_of, reference_of, cases = KERNELS[argv[0]]()
    out = REPO / "benchmarks" / "results" / f"accuracy_{argv[0]}.md"
    lines = [
        f"# `{argv[0]}` kernels vs the float64 reference (interpret mode, CPU)", "",
        f"`python benchmarks/kernel_accuracy.py {argv[0]}` — JAX {jax.__version__}.", "",
        "| case | quantity | kernel max-rel | kernel norm-rel | rounding floor max-rel | rounding floor norm-rel |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for name, case in cases.items():
        lines += case_rows(name, case, errors_of, reference_of)
        print(lines[-1], flush=True)
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
