"""Run the full recurrax benchmark with the chunk work item's targets and write `benchmarks/results/`.

    python benchmarks/run.py               # the full grid and the issue-3 targets
    python benchmarks/run.py --impls chunk # any `recurrax bench` option is passed through
    python benchmarks/run.py --no-targets  # the grid alone

This is `recurrax bench` with its full default grid, the targets of `targets.py` (judged for
`--target-impl`, default chunk) and the output directory pinned next to this file, so the
committed results always come from the same command. They are under git, so they are replaced
without `--overwrite`; any other `--out` is checked as `recurrax bench` checks it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path

from targets import add_targets, target_impl

from recurrax.tools.bench import command

RESULTS = Path(__file__).resolve().parent / "results"


def main(argv: Sequence[str]) -> int:
    parser = command.parser("python benchmarks/run.py")
    parser.set_defaults(out=Path(os.path.relpath(RESULTS)))
    parser.add_argument("--target-impl", help="implementation judged against the targets (default chunk)")
    parser.add_argument("--no-targets", action="store_true", help="skip the targets section")
    args = command.with_defaults(parser.parse_args(list(argv)))
    try:
        impls, kinds = command.chosen_implementations(args.impls), command.chosen_gates(args.gates)
        judged = None if args.no_targets else command.chosen_implementations(target_impl(args.target_impl))[0]
        command.check_output(args.out, args.overwrite or args.out.resolve() == RESULTS)
    except ValueError as error:
        print(f"benchmarks/run.py: {error}", file=sys.stderr)
        return 2
    report = command.run(args, impls, kinds, argv, args.out)
    if judged is not None and report["status"] == "complete":
        try:
            add_targets(report, judged, args.quick)
        except KeyboardInterrupt:
            report["status"] = "interrupted"
    code = command.finish(report, args.out)
    print("\n".join(report["sections"]))
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
