"""`recurrax check`: every implementation this machine runs, against the float64 reference."""

from __future__ import annotations

import argparse
import time

import jax

from recurrax import kernel_registry
from recurrax.registry import Backend, Request, current_backend

from .cases import Case, canonical, compare, default_tolerance, make_inputs, run_vjp, split_args
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
}
QUICK = ("g per channel", "all gates, reverse", "varlen")
"""`--quick`: one case per decay form, reverse, and packed input (a few compiles per implementation)."""
CASE_WIDTH = max(len(name) for name in CASES)


def _machine_implementations() -> list[str]:
    """The registered implementations that run on this machine's backend."""
    backend = current_backend()
    return [
        impl.name
        for impl in kernel_registry.implementations()
        if impl.backend is Backend.ANY or impl.backend.value == backend
    ]


def chosen_implementations(requested: list[str] | None) -> list[str]:
    """The implementations to check, in registry order: `requested` (None: every one this
    machine runs) less those for another backend. `ValueError` for an unregistered name or an
    empty selection, naming `--implementations` and the valid names."""
    runnable = _machine_implementations()
    if requested is None:
        return runnable
    registered = kernel_registry.names()
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


def _fwd_bwd_seconds(name: str, case: Case) -> float:
    """Steady-state time of one jitted forward + backward (compile excluded)."""
    diff, rest = split_args(make_inputs(case))
    step = jax.jit(lambda diff: run_vjp(name, {**diff, **rest}))
    jax.block_until_ready(step(diff))
    start = time.perf_counter()
    jax.block_until_ready(step(diff))
    return time.perf_counter() - start


def _refusal(name: str, case: Case) -> str | None:
    """Why `name` declares it cannot run `case`, or None."""
    problem, _, _ = canonical(make_inputs(case))
    impl = next(impl for impl in kernel_registry.implementations() if impl.name == name)
    return impl.refusal(Request.of(problem))


def _row(name: str, case_name: str, error: float, worst: str, seconds: float, ok: bool) -> str:
    status = "ok" if ok else "MISMATCH"
    return f"{name:<18} {case_name:<{CASE_WIDTH}} {error:>11.2e} {worst:<16} {seconds * 1e3:>9.1f}  {status}"


def _eta(done: int, total: int, elapsed: float) -> str:
    """`[done/total, ETA m:ss]`: the remaining rows at the mean time per row so far."""
    left = elapsed / done * (total - done) if done else 0.0
    return f"[{done}/{total}, ETA {int(left // 60)}:{int(left % 60):02d}]"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="recurrax check", description=__doc__)
    parser.add_argument("--implementations", nargs="*", help="names to check (default: all this machine runs)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16", "float64"])
    parser.add_argument("--tolerance", type=positive_float, help="max relative error, > 0 (default by dtype)")
    parser.add_argument("--quick", action="store_true",
                        help=f"only the cases {', '.join(QUICK)} (about a minute instead of several)")
    args = parser.parse_args(argv)
    try:
        names = chosen_implementations(args.implementations)
    except ValueError as error:
        parser.error(str(error))
    jax.config.update("jax_enable_x64", True)
    tolerance = default_tolerance(args.dtype) if args.tolerance is None else args.tolerance
    print(f"backend {jax.default_backend()}, inputs {args.dtype}, oracle: reference in float64, tolerance {tolerance:.0e}")
    cases = {name: case for name, case in CASES.items() if not args.quick or name in QUICK}
    print(f"{'implementation':<18} {'case':<{CASE_WIDTH}} {'max rel err':>11} {'(worst of)':<16} {'fwd+bwd ms':>9}")
    counts = {"matched": 0, "mismatched": 0, "unsupported": 0}
    total, start = len(names) * len(cases), time.perf_counter()
    for name in names:
        for case_name, case in cases.items():
            case = Case(**{**case.__dict__, "dtype": args.dtype})
            refusal = _refusal(name, case)
            if refusal is None:
                errors = compare(name, case)
                worst = max(errors, key=errors.get)
                ok = errors[worst] <= tolerance
                counts["matched" if ok else "mismatched"] += 1
                line = _row(name, case_name, errors[worst], worst, _fwd_bwd_seconds(name, case), ok)
            else:
                counts["unsupported"] += 1
                line = f"{name:<18} {case_name:<{CASE_WIDTH}} {'-':>11} declared unsupported: {refusal}"
            done = sum(counts.values())
            print(f"{line}  {_eta(done, total, time.perf_counter() - start)}", flush=True)
    print(f"{len(names)} implementations x {len(cases)} cases: {counts['matched']} matched, "
          f"{counts['mismatched']} mismatched, {counts['unsupported']} declared unsupported (not run)")
    return 1 if counts["mismatched"] else 0
