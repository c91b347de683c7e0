"""`recurrax bench`: time, model-FLOP utilisation and memory of every implementation.

See `measure.py` for what is measured and how; outputs in `--out`: `results.md`,
`results.json` (raw records) and `results.png` (time vs T, log-log).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from recurrax._extras import require
from recurrax._core.registry import kernel_registry

from ..cases import DELTA_PRESETS, GATE_PRESETS
from ..options import non_negative_int, positive_float, positive_int, positive_int_list
from .machine import machine_description, matmul_peak
from .measure import DEFAULT_IMPLS, Settings, Shape, add_utilisation, grid_size, run_grid
from .report import TABLE_HEADER, table_rows, write_outputs

GATE_KINDS = (*GATE_PRESETS, *DELTA_PRESETS)
DTYPES = ("float32", "bfloat16")
RESULT_FILES = ("results.md", "results.json", "results.png")

FULL = {"seq_lens": [256, 1024, 4096, 16384], "batch": 2, "heads": 8, "qk_dim": 64, "v_dim": 64,
        "repeats": 7, "max_seconds": 10.0, "matmul_size": 2048, "matmul_repeats": 10}

QUICK = {"seq_lens": [256, 1024], "batch": 1, "heads": 4, "qk_dim": 64, "v_dim": 64,
         "repeats": 3, "max_seconds": 5.0, "matmul_size": 512, "matmul_repeats": 5}
"""Small enough for a smoke run, large enough (K = V = 64, T up to 1024) that `chunk` beats
`scan` forward and backward, as in the full grid (forward alone is close at B·H = 4)."""

FULL_GRID_DURATION = "about 8 minutes on a quiet 2-core CPU"
QUICK_GRID_DURATION = "about 2 minutes on a quiet 2-core CPU"
"""Estimates, not guarantees: the committed full run (benchmarks/results, `--repeats 5`) spent
1.5 minutes compiling and 2.1 timing for the five `recurrent` kinds (the three delta-rule
kinds add about as much again per kind); a quick run took 1 minute of CPU time (3.3 minutes
of wall time on a 2-core CPU with load average 10). A busy machine takes longer."""


def _sizes(preset: dict[str, Any], name: str) -> str:
    value = preset[name]
    return ",".join(map(str, value)) if isinstance(value, list) else f"{value:g}"


def parser(prog: str = "recurrax bench") -> argparse.ArgumentParser:
    """The options of `recurrax bench` (scripts in `benchmarks/` add their own)."""
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0],
                                     epilog=f"Duration (estimates): the full grid {FULL_GRID_DURATION}; "
                                     f"--quick {QUICK_GRID_DURATION}, mostly compiling.")
    add = parser.add_argument
    default = lambda name: f"(default {_sizes(FULL, name)}; quick {_sizes(QUICK, name)})"  # noqa: E731
    add("--quick", action="store_true", help=f"a smaller grid and target shapes: a smoke run of {QUICK_GRID_DURATION}, "
        "mostly compiling")
    add("--impls", help="comma-separated implementations (default: those of reference,scan,chunk registered)")
    add("--gates", default=",".join(GATE_KINDS), help=f"comma-separated gate kinds among {','.join(GATE_KINDS)} (the delta* kinds measure "
        "delta_rule: DeltaNet, Gated DeltaNet, KDA)")
    add("--dtype", default="float32", choices=DTYPES, help="dtype of the measured inputs (default float32; MFU "
        "is always against the float32 matmul peak)")
    add("--seq-lens", type=positive_int_list, help=f"comma-separated sequence lengths {default('seq_lens')}")
    add("--batch", type=positive_int, help=f"batch size B {default('batch')}")
    add("--heads", type=positive_int, help=f"heads H {default('heads')}")
    add("--qk-dim", type=positive_int, help=f"query/key head dim K {default('qk_dim')}")
    add("--v-dim", type=positive_int, help=f"value head dim V {default('v_dim')}")
    add("--repeats", type=positive_int, help=f"timed runs per measurement, after one warm-up run {default('repeats')}")
    add("--max-seconds", type=positive_float, help=f"time budget per measurement {default('max_seconds')}")
    add("--reference-max-len", type=non_negative_int, default=1024,
        help="longest T the reference runs at, 0 for never (default 1024)")
    add("--matmul-size", type=positive_int, help=f"side of the peak-measuring matmul {default('matmul_size')}")
    add("--matmul-repeats", type=positive_int, help=f"timed runs of that matmul {default('matmul_repeats')}")
    add("--seed", type=non_negative_int, default=0, help="seed of the random inputs")
    add("--out", type=Path, default=None,
        help="output directory, written as measurements finish (default: a new ./recurrax-bench-<date>-<time>; "
        "never the committed results)")
    add("--overwrite", action="store_true", help="replace results already in --out (refused otherwise)")
    return parser


def fresh_directory(now: datetime.datetime | None = None) -> Path:
    """A new output directory in the current one, named after the time."""
    stamp = (now or datetime.datetime.now()).strftime("%Y%m%d-%H%M%S")
    path, n = Path(f"recurrax-bench-{stamp}"), 1
    while path.exists():
        path, n = Path(f"recurrax-bench-{stamp}-{n}"), n + 1
    return path


def with_defaults(args: argparse.Namespace) -> argparse.Namespace:
    """Unset sizes from the full or the `--quick` grid; a fresh output directory."""
    if args.out is None:
        args.out = fresh_directory()
    for name, value in (QUICK if args.quick else FULL).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def check_output(out: Path, overwrite: bool) -> None:
    """Make `out` ready before anything is measured: a writable directory holding no results
    (unless `overwrite`); `ValueError` naming `--out` otherwise."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file, not a directory")
    held = [name for name in RESULT_FILES if (out / name).exists()]
    if held and not overwrite:
        raise ValueError(f"--out {out} already holds {', '.join(held)}; pass --overwrite to replace them, "
                         "or choose another directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=out).close()
    except OSError as error:
        raise ValueError(f"--out {out} cannot be written: {error.strerror or error}") from None


def chosen_implementations(requested: str | None) -> list[str]:
    """The implementations to measure; an unregistered name raises `ValueError`."""
    registered = kernel_registry.names()
    if requested is None:
        return [name for name in DEFAULT_IMPLS if name in registered]
    names = [name.strip() for name in requested.split(",") if name.strip()]
    unknown = [name for name in names if name not in registered]
    if unknown:
        raise ValueError(f"--impls: {unknown} not registered; registered: {registered}")
    return names


def chosen_gates(requested: str) -> list[str]:
    """The gate kinds to measure; an unknown kind raises `ValueError`."""
    kinds = [kind.strip() for kind in requested.split(",") if kind.strip()]
    unknown = [kind for kind in kinds if kind not in GATE_KINDS]
    if unknown:
        raise ValueError(f"--gates: {unknown} unknown; choose among {list(GATE_KINDS)}")
    return kinds


def new_report(args: argparse.Namespace, impls: list[str], kinds: list[str], argv: Sequence[str]) -> dict[str, Any]:
    """The report of the run `args` asks for, before anything is measured."""
    seq_lens = sorted(set(args.seq_lens))
    settings = Settings(args.repeats, args.max_seconds, args.reference_max_len, args.seed, args.dtype)
    shape = Shape(args.batch, seq_lens[0], args.heads, args.qk_dim, args.v_dim)
    return {
        "argv": list(argv),
        "quick": args.quick,
        "status": "running",
        "measurements": grid_size(impls, kinds, seq_lens, settings),
        "machine": machine_description(),
        "matmul_peaks": [],
        "peak_flops_per_s": None,
        "settings": dataclasses.asdict(settings),
        "shape": dataclasses.asdict(shape),
        "impls": impls,
        "gate_kinds": kinds,
        "seq_lens": seq_lens,
        "records": [],
        "extra_records": [],
        "sections": [],
    }


def run(args: argparse.Namespace, impls: list[str], kinds: list[str], argv: Sequence[str],
        out: Path | None = None) -> dict[str, Any]:
    """Measure the grid `args` asks for; the report that `write_outputs` writes (scripts may
    add their own `extra_records` and markdown `sections` to it before writing).

    With `out`, results.md and results.json are rewritten there after every measurement.
    Ctrl-C ends the run early: the report's `status` is then "interrupted" and it holds every
    measurement finished before."""
    from tqdm.auto import tqdm

    report = new_report(args, impls, kinds, argv)
    shape, settings = Shape(**report["shape"]), Settings(**report["settings"])
    where = f", written to {out} as they finish" if out is not None else ""
    print(f"recurrax bench: {report['measurements']} measurements{where} (estimates: the full grid takes "
          f"{FULL_GRID_DURATION}, --quick {QUICK_GRID_DURATION})", flush=True)

    def keep(record: dict[str, Any]) -> None:
        report["records"].append(add_utilisation(record, report["peak_flops_per_s"]))
        if out is not None:
            write_outputs(report, out, plot=False)

    try:
        add_peak(report, matmul_peak(args.matmul_size, args.matmul_repeats))
        with tqdm(total=report["measurements"], desc="recurrax bench", unit="measurement", dynamic_ncols=True) as bar:
            run_grid(impls, kinds, shape, report["seq_lens"], settings, bar, keep)
        add_peak(report, matmul_peak(args.matmul_size, args.matmul_repeats))
        report["status"] = "complete"
    except KeyboardInterrupt:
        report["status"] = "interrupted"
    report["machine"]["load_average_end"] = list(os.getloadavg())
    return report


def add_peak(report: dict[str, Any], peak: dict[str, float]) -> None:
    """Record a matmul peak measurement; MFU of every record against the best so far."""
    report["matmul_peaks"].append(peak)
    report["peak_flops_per_s"] = max(p["flops_per_s"] for p in report["matmul_peaks"])
    report["records"] = [add_utilisation(r, report["peak_flops_per_s"]) for r in report["records"]]


def summary(report: dict[str, Any], paths: Sequence[Path]) -> str:
    """What to print at the end: the peak, the table and where the files went."""
    peaks = [f"{when} {p['flops_per_s'] / 1e9:.1f}" for when, p in zip(("before", "after"), report["matmul_peaks"])]
    lines = []
    if report["peak_flops_per_s"] is not None:
        lines.append(f"float32 matmul peak: {report['peak_flops_per_s'] / 1e9:.1f} GFLOP/s ({', '.join(peaks)})")
    lines += [TABLE_HEADER, *table_rows(report["records"])]
    lines += [f"wrote {path}" for path in paths]
    return "\n".join(lines)


def finish(report: dict[str, Any], out: Path) -> int:
    """Write the outputs and print the summary; the exit status: 130 when interrupted (after
    a line saying what was saved), 1 if a measurement failed, else 0."""
    paths = write_outputs(report, out)
    print(summary(report, paths))
    if report["status"] == "interrupted":
        print(f"interrupted: {len(report['records'])} of {report['measurements']} measurements saved in "
              f"{', '.join(str(path) for path in paths)}", file=sys.stderr)
        return 130
    failed = [r for r in report["records"] + report["extra_records"] if r["status"] == "error"]
    return 1 if failed else 0


def main(argv: Sequence[str] | None = None) -> int:
    """`recurrax bench [options]`: 0 on success, 1 if a measurement failed, 2 on bad options,
    130 when interrupted (the finished measurements are saved)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    for module in ("tqdm", "matplotlib"):
        require(module, "bench", "recurrax bench")
    args = with_defaults(parser().parse_args(argv))
    try:
        impls, kinds = chosen_implementations(args.impls), chosen_gates(args.gates)
        check_output(args.out, args.overwrite)
    except ValueError as error:
        print(f"recurrax bench: {error}", file=sys.stderr)
        return 2
    return finish(run(args, impls, kinds, argv, args.out), args.out)


if __name__ == "__main__":
    sys.exit(main())
