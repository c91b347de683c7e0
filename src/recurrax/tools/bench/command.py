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
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from recurrax._extras import require
from recurrax.registry import kernel_registry

from ..cases import GATE_PRESETS
from .machine import machine_description, matmul_peak
from .measure import DEFAULT_IMPLS, Settings, Shape, add_utilisation, grid_size, run_grid
from .report import TABLE_HEADER, table_rows, write_outputs

GATE_KINDS = tuple(GATE_PRESETS)

FULL = {"seq_lens": "256,1024,4096,16384", "batch": 2, "heads": 8, "qk_dim": 64, "v_dim": 64,
        "repeats": 7, "max_seconds": 10.0, "matmul_size": 2048, "matmul_repeats": 10}

QUICK = {"seq_lens": "64,256", "batch": 1, "heads": 2, "qk_dim": 16, "v_dim": 16,
         "repeats": 3, "max_seconds": 5.0, "matmul_size": 512, "matmul_repeats": 5}

def parser(prog: str = "recurrax bench") -> argparse.ArgumentParser:
    """The options of `recurrax bench` (scripts in `benchmarks/` add their own)."""
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--quick", action="store_true", help="a tiny grid and target shapes: a smoke run of about two minutes on a 2-core CPU, mostly compiling")
    add("--impls", help="comma-separated implementations (default: those of reference,scan,chunk registered)")
    add("--gates", default=",".join(GATE_KINDS), help=f"comma-separated gate kinds among {','.join(GATE_KINDS)}")
    add("--seq-lens", help=f"comma-separated sequence lengths (default {FULL['seq_lens']}; quick {QUICK['seq_lens']})")
    add("--batch", type=int, help=f"batch size B (default {FULL['batch']})")
    add("--heads", type=int, help=f"heads H (default {FULL['heads']})")
    add("--qk-dim", type=int, help=f"query/key head dim K (default {FULL['qk_dim']})")
    add("--v-dim", type=int, help=f"value head dim V (default {FULL['v_dim']})")
    add("--repeats", type=int, help=f"timed runs per measurement (default {FULL['repeats']})")
    add("--max-seconds", type=float, help=f"time budget per measurement (default {FULL['max_seconds']:g})")
    add("--reference-max-len", type=int, default=1024, help="longest T the reference runs at (default 1024)")
    add("--matmul-size", type=int, help=f"side of the peak-measuring matmul (default {FULL['matmul_size']})")
    add("--matmul-repeats", type=int, help=f"timed runs of that matmul (default {FULL['matmul_repeats']})")
    add("--seed", type=int, default=0, help="seed of the random inputs")
    add("--out", type=Path, default=None,
        help="output directory (default: a new ./recurrax-bench-<date>-<time>; never the committed results)")
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

def run(args: argparse.Namespace, impls: list[str], kinds: list[str], argv: Sequence[str]) -> dict[str, Any]:
    """Measure the grid `args` asks for; the report that `write_outputs` writes (scripts may
    add their own `extra_records` and markdown `sections` to it before writing)."""
    from tqdm.auto import tqdm

    seq_lens = sorted({int(t) for t in str(args.seq_lens).split(",") if t.strip()})
    settings = Settings(args.repeats, args.max_seconds, args.reference_max_len, args.seed)
    shape = Shape(args.batch, seq_lens[0], args.heads, args.qk_dim, args.v_dim)

    machine = machine_description()
    peaks = [matmul_peak(args.matmul_size, args.matmul_repeats)]
    total = grid_size(impls, kinds, seq_lens, settings)
    with tqdm(total=total, desc="recurrax bench", unit="measurement", dynamic_ncols=True) as progress:
        records = run_grid(impls, kinds, shape, seq_lens, settings, progress)
    peaks.append(matmul_peak(args.matmul_size, args.matmul_repeats))
    machine["load_average_end"] = list(os.getloadavg())
    peak = max(p["flops_per_s"] for p in peaks)
    return {
        "argv": list(argv),
        "quick": args.quick,
        "machine": machine,
        "matmul_peaks": peaks,
        "peak_flops_per_s": peak,
        "settings": dataclasses.asdict(settings),
        "shape": dataclasses.asdict(shape),
        "impls": impls,
        "gate_kinds": kinds,
        "seq_lens": seq_lens,
        "records": [add_utilisation(r, peak) for r in records],
        "extra_records": [],
        "sections": [],
    }


def summary(report: dict[str, Any], paths: Sequence[Path]) -> str:
    """What to print at the end: the peak, the table and where the files went."""
    lines = [f"float32 matmul peak: {report['peak_flops_per_s'] / 1e9:.1f} GFLOP/s "
             f"(before {report['matmul_peaks'][0]['flops_per_s'] / 1e9:.1f}, "
             f"after {report['matmul_peaks'][1]['flops_per_s'] / 1e9:.1f})"]
    lines += [TABLE_HEADER, *table_rows(report["records"])]
    lines += [f"wrote {path}" for path in paths]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """`recurrax bench [options]`: 0 on success, 1 if a measurement failed, 2 on bad options."""
    argv = sys.argv[1:] if argv is None else list(argv)
    for module in ("tqdm", "matplotlib"):
        require(module, "bench", "recurrax bench")
    args = with_defaults(parser().parse_args(argv))
    try:
        impls, kinds = chosen_implementations(args.impls), chosen_gates(args.gates)
    except ValueError as error:
        print(f"recurrax bench: {error}", file=sys.stderr)
        return 2
    report = run(args, impls, kinds, argv)
    paths = write_outputs(report, args.out)
    print(summary(report, paths))
    failed = [r for r in report["records"] + report["extra_records"] if r["status"] == "error"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
