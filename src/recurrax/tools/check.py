"""`recurrax check`: every implementation this machine runs, of `recurrent` and of `delta_rule`,
against the float64 reference."""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from recurrax import kernel_registry
from recurrax.delta import canonicalize_delta
from recurrax.delta import kernel_registry as delta_registry
from recurrax._core.registry import Backend, KernelRegistry, Request, current_backend

from .cases import (
    Case,
    DeltaCase,
    canonical,
    compare_results,
    default_tolerance,
    delta_oracle_results,
    delta_options,
    delta_vjp_step,
    make_delta_inputs,
    make_inputs,
    oracle_results,
    relative_errors,
    vjp_step,
)
from .options import positive_float

SHAPE = dict(B=2, T=48, H=4, Hkv=4, K=16, V=16)
CASES = {
    "no gate": Case(**SHAPE),
    "g per head": Case(**SHAPE, gates=("g_head",)),
    "g per channel": Case(**SHAPE, gates=("g_channel",)),
    "g_gamma": Case(**SHAPE, gates=("g_gamma",)),
    "gk + gv": Case(**SHAPE, gates=("gk", "gv")),
    "all gates, reverse": Case(**SHAPE, gates=("g_head", "g_gamma", "gk", "gv"), reverse=True),
    "GQA 4:1, K != V": Case(**{**SHAPE, "Hkv": 1, "V": 8}, gates=("g_channel",)),
    "shared q/k 1:4 (Mamba-2)": Case(**SHAPE, Hqk=1, gates=("g_head",), cu_seqlens=(0, 20, 48)),
    "strong decay (-20)": Case(**SHAPE, gates=("g_head", "gk"), gate_low=-20.0),
    "varlen": Case(**SHAPE, gates=("g_channel", "gv"), cu_seqlens=(0, 5, 5, 30, 31, 48), packed_3d=True),
    "varlen, reverse": Case(**SHAPE, gates=("g_head",), cu_seqlens=(0, 17, 40, 48), reverse=True),
    "g_gamma per row": Case(**SHAPE, gates=("g_gamma_rows", "gk")),
    "g_gamma per seq, varlen": Case(**SHAPE, gates=("g_gamma_rows",), cu_seqlens=(0, 9, 9, 48), packed_3d=True),
    "varlen, g per channel": Case(**SHAPE, gates=("g_channel",), cu_seqlens=(0, 5, 5, 30, 31, 48), packed_3d=True),
}
QUICK = ("all gates, reverse", "varlen, g per channel")
"""`--quick`: every decay form and reverse in one case, packed input in the other, which
every implementation on a CPU runs (`pallas_interpret` takes no `gv`): one compile per
implementation and case, and one of the float64 reference per case."""

DELTA_SHAPE = dict(B=2, T=48, Hqk=4, H=4, K=16, V=16)
DELTA_CASES = {
    "DeltaNet (no gate)": DeltaCase(**DELTA_SHAPE),
    "Gated DeltaNet, l2norm": DeltaCase(**DELTA_SHAPE, gates=("g",), qk_l2norm=True),
    "KDA (gk)": DeltaCase(**DELTA_SHAPE, gates=("gk",), qk_l2norm=True),
    "g + gk, beta to 2": DeltaCase(**DELTA_SHAPE, gates=("g", "gk"), beta_range=(0.0, 2.0)),
    "grouped q/k 1:4": DeltaCase(**{**DELTA_SHAPE, "Hqk": 1, "V": 8}, gates=("g",)),
    "strong decay (-20)": DeltaCase(**DELTA_SHAPE, gates=("g", "gk"), gate_range=(-20.0, 0.0)),
    "varlen, an empty one": DeltaCase(**DELTA_SHAPE, gates=("gk",), cu_seqlens=(0, 5, 5, 30, 31, 48)),
    "g + gk, l2norm, varlen": DeltaCase(**DELTA_SHAPE, gates=("g", "gk"), qk_l2norm=True,
                                        cu_seqlens=(0, 5, 5, 30, 31, 48)),
}
DELTA_QUICK = ("g + gk, l2norm, varlen",)
"""`--quick`: both gates, normalised q/k and packed input with an empty sequence in one case."""
CASE_WIDTH = max(len(name) for name in (*CASES, *DELTA_CASES))
NAME_WIDTH = 20
"""The implementation column: the longest registered name (`pallas_tpu_interpret`)."""


class Operation(NamedTuple):
    """What `check` needs of one operation: its registry, cases and how to run one."""

    name: str
    registry: KernelRegistry
    cases: Callable[[], dict[str, Any]]
    quick: Callable[[], tuple[str, ...]]
    measure: Callable[[str, Any, str], tuple[dict[str, float], float]]  # (implementation, case, dtype)
    refusal: Callable[[str, Any, str], str | None]


def _results_and_seconds(step, argument) -> tuple[Any, float]:
    """The jitted `step`'s results on `argument` (its one compile) and the steady-state time
    of a second call."""
    results = jax.block_until_ready(step(argument))
    start = time.perf_counter()
    jax.block_until_ready(step(argument))
    return results, time.perf_counter() - start


def _recurrent_measure(name: str, case: Case, dtype: str) -> tuple[dict[str, float], float]:
    """Errors against the float64 reference and the time of one forward + backward."""
    case = Case(**{**case.__dict__, "dtype": dtype})
    kwargs = make_inputs(case)
    results, seconds = _results_and_seconds(*vjp_step(name, kwargs))
    return compare_results(results, _recurrent_oracle(case), kwargs), seconds


@functools.lru_cache(maxsize=1)
def _recurrent_oracle(case: Case):
    """The reference in float64 on `case`'s inputs, once per case (every implementation's oracle)."""
    return oracle_results(make_inputs(case))


def _recurrent_refusal(name: str, case: Case, dtype: str) -> str | None:
    return _refusal(name, Case(**{**case.__dict__, "dtype": dtype}))


def _delta_arrays(case: DeltaCase, dtype: str) -> dict:
    return {n: jnp.asarray(x, dtype) for n, x in make_delta_inputs(case).items()}


def _delta_refusal(name: str, case: DeltaCase, dtype: str) -> str | None:
    arrays, options = _delta_arrays(case, dtype), delta_options(case)
    names = ("query", "key", "value", "beta", "g", "gk", "softmax_scale", "initial_state", "cu_seqlens", "qk_l2norm")
    problem, _, _ = canonicalize_delta(*({**arrays, **options}.get(n) for n in names))
    impl = next(impl for impl in delta_registry.implementations() if impl.name == name)
    return impl.refusal(Request.of(problem))


def _delta_measure(name: str, case: DeltaCase, dtype: str) -> tuple[dict[str, float], float]:
    """Errors against the delta rule's float64 reference and the time of one forward + backward."""
    results, seconds = _results_and_seconds(delta_vjp_step(name, delta_options(case)), _delta_arrays(case, dtype))
    return relative_errors(results, _delta_oracle(case)), seconds


@functools.lru_cache(maxsize=1)
def _delta_oracle(case: DeltaCase):
    return delta_oracle_results(case)


OPERATIONS = {
    "recurrent": Operation("recurrent", kernel_registry, lambda: CASES, lambda: QUICK,
                           _recurrent_measure, _recurrent_refusal),
    "delta_rule": Operation("delta_rule", delta_registry, lambda: DELTA_CASES, lambda: DELTA_QUICK,
                            _delta_measure, _delta_refusal),
}
"""The operations `check` covers (cases looked up at call time, so tests may replace them)."""


def _machine_implementations(registry: KernelRegistry = kernel_registry) -> list[str]:
    """The implementations of `registry` that run on this machine's backend."""
    backend = current_backend()
    return [
        impl.name
        for impl in registry.implementations()
        if impl.backend is Backend.ANY or impl.backend.value == backend
    ]


NAMED_ONLY = ("pallas_tpu_interpret", "mosaic_gpu_interpret")
"""Checked only when named: JAX's interpreters of the TPU and Mosaic GPU kernels take minutes
per case on a CPU (`--quick` went from 43 s to 811 s with them)."""


def chosen_implementations(requested: list[str] | None, registry: KernelRegistry = kernel_registry) -> list[str]:
    """The implementations to check, in registry order: `requested` (None: every one this
    machine runs but `NAMED_ONLY`) less those for another backend. `ValueError` for an
    unregistered name or an empty selection, naming `--implementations` and the valid names."""
    runnable = _machine_implementations(registry)
    if requested is None:
        return [name for name in runnable if name not in NAMED_ONLY]
    registered = registry.names()
    unknown = [name for name in requested if name not in registered]
    if unknown:
        raise ValueError(f"--implementations: {', '.join(unknown)} not registered; registered: "
                         f"{', '.join(registered)} (this machine runs {', '.join(runnable)})")
    chosen = [name for name in runnable if name in requested]
    if not requested:
        raise ValueError(f"--implementations needs at least one name; choose among {', '.join(runnable)}")
    if not chosen:
        raise ValueError(f"--implementations: {', '.join(requested)} do not run on this machine "
                         f"({current_backend()}); choose among {', '.join(runnable)}")
    return chosen


def _refusal(name: str, case: Case) -> str | None:
    """Why `name` declares it cannot run `case`, or None."""
    problem, _, _ = canonical(make_inputs(case))
    impl = next(impl for impl in kernel_registry.implementations() if impl.name == name)
    return impl.refusal(Request.of(problem))


def _row(name: str, case_name: str, error: float, worst: str, seconds: float, ok: bool) -> str:
    status = "ok" if ok else "MISMATCH"
    return f"{name:<{NAME_WIDTH}} {case_name:<{CASE_WIDTH}} {error:>11.2e} {worst:<16} {seconds * 1e3:>9.1f}  {status}"


def _eta(done: int, total: int, elapsed: float) -> str:
    """`[done/total, ETA m:ss]`: the remaining rows at the mean time per row so far."""
    left = elapsed / done * (total - done) if done else 0.0
    return f"[{done}/{total}, ETA {int(left // 60)}:{int(left % 60):02d}]"


def _check_operation(operation: Operation, names: list[str], args, tolerance: float) -> dict[str, int]:
    """Print one row per (implementation, case) of `operation`; the counts."""
    cases = {name: case for name, case in operation.cases().items() if not args.quick or name in operation.quick()}
    print(f"{operation.name}:")
    print(f"{'implementation':<{NAME_WIDTH}} {'case':<{CASE_WIDTH}} {'max rel err':>11} {'(worst of)':<16} {'fwd+bwd ms':>9}")
    counts = {"matched": 0, "mismatched": 0, "unsupported": 0}
    total, start = len(names) * len(cases), time.perf_counter()
    for case_name, case in cases.items():
        for name in names:
            refusal = operation.refusal(name, case, args.dtype)
            if refusal is None:
                errors, seconds = operation.measure(name, case, args.dtype)
                worst = max(errors, key=errors.get)
                ok = errors[worst] <= tolerance
                counts["matched" if ok else "mismatched"] += 1
                line = _row(name, case_name, errors[worst], worst, seconds, ok)
            else:
                counts["unsupported"] += 1
                line = f"{name:<{NAME_WIDTH}} {case_name:<{CASE_WIDTH}} {'-':>11} declared unsupported: {refusal}"
            done = sum(counts.values())
            print(f"{line}  {_eta(done, total, time.perf_counter() - start)}", flush=True)
    print(f"{operation.name}: {len(names)} implementations x {len(cases)} cases: {counts['matched']} matched, "
          f"{counts['mismatched']} mismatched, {counts['unsupported']} declared unsupported (not run)")
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="recurrax check", description=__doc__)
    parser.add_argument("--operation", choices=[*OPERATIONS, "all"], default="all",
                        help="which operation to check (default: all of them)")
    parser.add_argument("--implementations", nargs="*",
                        help="names to check (default: all this machine runs but the TPU and Mosaic GPU "
                             "interpreters, " + ", ".join(NAMED_ONLY) + ", which take minutes: name them)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16", "float64"])
    parser.add_argument("--tolerance", type=positive_float, help="max relative error, > 0 (default by dtype)")
    parser.add_argument("--quick", action="store_true",
                        help=f"only the cases {' and '.join(map(repr, QUICK))} of recurrent and "
                             f"{' and '.join(map(repr, DELTA_QUICK))} of delta_rule (under a minute on 2 cores "
                             "instead of several)")
    args = parser.parse_args(argv)
    operations = list(OPERATIONS.values()) if args.operation == "all" else [OPERATIONS[args.operation]]
    try:
        chosen = _selected(args.implementations, operations)
    except ValueError as error:
        parser.error(str(error))
    jax.config.update("jax_enable_x64", True)
    tolerance = default_tolerance(args.dtype) if args.tolerance is None else args.tolerance
    print(f"backend {jax.default_backend()}, inputs {args.dtype}, oracle: reference in float64, tolerance {tolerance:.0e}")
    mismatched = sum(_check_operation(op, names, args, tolerance)["mismatched"] for op, names in chosen)
    return 1 if mismatched else 0


def _selected(requested: list[str] | None, operations: list[Operation]) -> list[tuple[Operation, list[str]]]:
    """(operation, implementations to check) pairs. A name is looked up in every operation's
    registry: an operation registering none of the requested names is skipped; a name no
    operation registers is a `ValueError` (as is an empty or unrunnable selection)."""
    if requested is None or len(operations) == 1:
        return [(op, chosen_implementations(requested, op.registry)) for op in operations]
    known = {name for op in operations for name in op.registry.names()}
    unknown = [name for name in requested if name not in known]
    if unknown or not requested:
        chosen_implementations(requested, kernel_registry)  # raises, naming the problem
    return [(op, chosen_implementations([n for n in requested if n in op.registry.names()], op.registry))
            for op in operations if set(requested) & set(op.registry.names())]
