"""Where one path's call spends the chip's time: `recurrent` or `delta_rule` through a named
implementation, forward and forward+backward, timed back to back and traced once (issue 45).

    source benchmarks/tpu_env.sh && python3 benchmarks/tpu_path_profile.py --out DIR \
        --rows 0 2 --paths pallas_tpu chunk          # a TPU VM: about 20 s a (row, path)
    python benchmarks/tpu_path_profile.py --smoke --out /tmp/p   # anywhere (no device trace off a TPU)

Rows are `tpu_kernel_sweep.rows` (the issue's four: `recurrent` `g` and `gk` at B4 T4096 H16
K=V=64; GDN and KDA at B1 T4096 Hv32 Hqk16 K=V=128; bf16). For each row and path: the time of one
call of calls dispatched back to back (`_timing.back_to_back`), then one call under
`jax.profiler.trace` read back by `_trace.traced_ops`: the device's self time per kind of op (a
Pallas kernel by its name, XLA fusions by kind, copies, transposes) and the longest ops, as shares
of the back-to-back time. What is not in a kernel is what the layout and the wrappers cost.
`--projected` holds the token arrays as a model's projections give them, [B, T, heads · D]
(`tpu_paths.projected`): a [B, T, H, 64] array is tiled over (H, D) on a TPU, and a path reading
[B, T, H · D] pays a relayout copy of it that a model does not.

Writes `tpu_path_profile.md` and `.json` to `--out`, after every (row, path).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import back_to_back  # noqa: E402
from _trace import traced_ops  # noqa: E402
from tpu_kernel_sweep import rows  # noqa: E402
from tpu_paths import call_of, label, make_arrays, programs, projected  # noqa: E402


def profile(row: dict, path: str, as_projected: bool) -> dict:
    """Back-to-back seconds and the traced shares of the forward and forward+backward programs;
    with `as_projected`, the token arrays held as a model holds them (`tpu_paths.projected`)."""
    inputs, cotangents = make_arrays(row)
    call = call_of(row, path)
    if as_projected:
        inputs, cotangents, wrap = projected(inputs, cotangents)
        call = wrap(call)
    forward, gradient = programs(call)
    result = {}
    for name, run in (("forward", lambda: forward(inputs)), ("fwd+bwd", lambda: gradient(inputs, cotangents))):
        seconds = back_to_back(run)
        result[name] = {"ms": seconds * 1e3, **traced_ops(run, seconds, most=8)}
    return result


def report(results: list[dict]) -> str:
    lines = [f"# Where the time goes on {jax.devices()[0].device_kind}", "",
             f"JAX {jax.__version__}. Written by `benchmarks/tpu_path_profile.py` (its docstring says how). "
             "Shares are of the call's time, calls back to back; `device` is the traced device time.", ""]
    for r in results:
        for program in ("forward", "fwd+bwd"):
            p = r[program]
            lines += [f"## {r['label']}: `{r['path']}` {program}, {p['ms']:.3f} ms (device {p['device_s'] * 1e3:.3f} ms)",
                      "", "| kind of op | share |", "|---|---:|"]
            lines += [f"| {kind} | {share:.1%} |" for kind, share in p["kind_share"].items()]
            lines += ["", "| op | share |", "|---|---:|"]
            lines += [f"| {op} | {share:.1%} |" for op, share in p["op_share"].items()] + [""]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--rows", type=int, nargs="+", default=[0, 2], help="indices into tpu_kernel_sweep.rows")
    parser.add_argument("--paths", nargs="+", default=["pallas_tpu", "chunk"])
    parser.add_argument("--projected", action="store_true", help="token arrays held [B, T, heads·D], as a model's "
                        "projections give them (tpu_paths.projected)")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (any machine)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    table = rows(args.smoke)
    results = []
    for index in args.rows if not args.smoke else range(len(table)):
        row = table[index]
        for path in args.paths if not args.smoke else ["chunk"]:
            try:
                results.append({"label": label(row) + (", as projected" if args.projected else ""), "path": path,
                                **profile(row, path, args.projected)})
            except Exception as error:  # noqa: BLE001  (a refused call or a failed compile: say so, go on)
                print(f"tpu_path_profile: {label(row)} {path}: {type(error).__name__}: {error}"[:400], file=sys.stderr)
                continue
            (out / "tpu_path_profile.md").write_text(report(results))
            (out / "tpu_path_profile.json").write_text(json.dumps(results, indent=1))
            print(f"tpu_path_profile: {label(row)} {path}: " + ", ".join(
                f"{k} {results[-1][k]['ms']:.3f} ms" for k in ("forward", "fwd+bwd")), file=sys.stderr, flush=True)
    print(report(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
