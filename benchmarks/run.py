"""Run the full recurrax benchmark and write `benchmarks/results/` (see benchmarks/README.md).

    python benchmarks/run.py               # the full grid and the issue-3 targets
    python benchmarks/run.py --impls chunk # any `recurrax bench` option is passed through

This is `recurrax bench` with its full default grid and the output directory pinned next to
this file, so the committed results always come from the same command.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from recurrax._bench import main

RESULTS = Path(__file__).resolve().parent / "results"


def full_run_arguments(extra: list[str]) -> list[str]:
    """`recurrax bench` options of the committed run, followed by `extra`."""
    return ["--out", os.path.relpath(RESULTS), *extra]


if __name__ == "__main__":
    sys.exit(main(full_run_arguments(sys.argv[1:])))
