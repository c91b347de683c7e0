"""The Pallas TPU kernels over a grid of tiles (heads per grid step, chunk) against XLA `chunk`.

    source benchmarks/tpu_env.sh && python3 benchmarks/tpu_kernel_sweep.py --out DIR --budget 280   # a TPU VM
    python benchmarks/tpu_kernel_sweep.py --smoke --out /tmp/sweep                                  # anywhere

On a v5e the run takes at most `--budget` seconds plus one configuration's compile and timing
(under 5 minutes at `--budget 280`); `--smoke` runs in Pallas's TPU interpret mode at tiny shapes
in under a minute on a CPU.

Rows: the issue's shapes (issue 45, bf16): `recurrent` per-head `g` and per-key-channel `gk` at
B4 T4096 H16 K=V=64, the delta rule's GDN (`g`) and KDA (`gk`) at B1 T4096, 32 value heads and
16 query/key heads, K=V=128. For each row this times, forward and forward+backward (as
`tpu_paths.py`: `jax.value_and_grad` of ⟨output, d_output⟩ + ⟨final_state, d_final⟩; one call's
share of calls dispatched back to back, `_timing.back_to_back`), the XLA
`chunk` path and then the kernel at each tile of `--heads` × `--chunks` (`TpuTiles(chunk=C,
heads=Hb)`; the sub-block stays 16 and the value block 128; `recurrent` `gk` also at each
`--groups`, the rows of the diagonal sub-block's groups; both operations' rows only at the heads
whose lane-dense blocks are legal, Hb · K a multiple of 128 or all heads), in the order of
`TILE_ORDER`, so the most telling tiles come first. Each tile's output and final state are compared once with the
`chunk` path's (max |x − y| / max |y|, printed and recorded). Each row's roofline is
`tpu_paths.floors` (HBM and MXU floors); `% roof` is the larger floor over the time.

**Budget.** A row is not started once the budget is spent; within a row a tile is not started
when, with 1.5 times the last tile's time, the row would run past its share (what is left over
the rows left). A tile that fails to compile or run is a line saying why.
`tpu_kernel_sweep.md` and `.json` in `--out` are rewritten after every tile.

`--projected` holds the token arrays as a model's projections give them, [B, T, heads · D],
reshaped inside the program (`tpu_paths.projected`), for both paths.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import back_to_back  # noqa: E402
from tpu_paths import call_of, floors, label, make_arrays, programs, projected  # noqa: E402

from recurrax.delta import canonicalize_delta  # noqa: E402
from recurrax.kernels.tpu import TpuTiles, tpu_delta, tpu_delta_interpret, tpu_interpret, tpu_recurrent  # noqa: E402
from recurrax.tools.cases import call  # noqa: E402

TILE_ORDER = ((1, 128), (8, 128), (16, 128), (4, 128), (8, 256), (2, 128), (16, 256), (4, 256), (2, 256), (1, 256))
"""(heads, chunk) in the order they are tried: today's tile first, then many heads at C = 128."""


def rows(smoke: bool) -> list[dict]:
    """The issue's four rows (bf16), or tiny ones for `--smoke`."""
    if smoke:
        return [dict(op="recurrent", gate="g", B=1, T=20, H=4, Hqk=4, K=16, V=16, dtype="float32"),
                dict(op="delta_rule", gate="g", B=1, T=20, H=4, Hqk=2, K=16, V=16, dtype="float32")]
    recurrent = dict(op="recurrent", B=4, T=4096, H=16, Hqk=16, K=64, V=64, dtype="bfloat16")
    delta = dict(op="delta_rule", B=1, T=4096, H=32, Hqk=16, K=128, V=128, dtype="bfloat16")
    return [{**recurrent, "gate": "g"}, {**recurrent, "gate": "gk"}, {**delta, "gate": "g"}, {**delta, "gate": "gk"}]


def tiles_of(row: dict, heads: list[int], chunks: list[int], smoke: bool, groups: tuple[int, ...] = (4,)) -> list[TpuTiles]:
    """The row's tiles in `TILE_ORDER` (those whose heads divide H), then any others asked for;
    `recurrent` `gk` rows at each diagonal `group` (`TpuTiles.group`), the others at 4; rows
    of both operations only where their lane-dense blocks are legal (Hb · K a multiple of 128
    or all H heads; any in interpret mode)."""
    asked = [(h, c) for h in heads for c in chunks if row["H"] % h == 0]
    ordered = [t for t in TILE_ORDER if t in asked] + [t for t in asked if t not in TILE_ORDER]
    sub = 8 if smoke else 16
    groups = groups if (row["op"], row["gate"]) == ("recurrent", "gk") else (4,)
    legal = lambda h: smoke or (h * row["K"]) % 128 == 0 or h == row["H"]  # noqa: E731
    return [TpuTiles(chunk=c, sub=sub, block_v=128, heads=h, group=g) for h, c in ordered for g in groups if legal(h)]


def kernel_call(row: dict, tiles: TpuTiles, interpret: bool):
    """`inputs -> (output, final_state)` through the row's TPU kernel at `tiles`."""
    if row["op"] == "recurrent":
        kernel = tpu_interpret if interpret else tpu_recurrent
        return lambda kw: call(functools.partial(kernel, tiles=tiles), **kw)
    kernel = tpu_delta_interpret if interpret else tpu_delta

    def run(kw):
        problem, scale, layout = canonicalize_delta(kw["query"], kw["key"], kw["value"], kw["beta"], kw.get("g"),
                                                    kw.get("gk"), None, None, None, True, False)
        output, final = kernel(problem, scale=scale, tiles=tiles)
        return layout.restore(output), final

    return run


def relative_error(x, y) -> float:
    """max |x − y| / max |y| in float64."""
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    return float(np.max(np.abs(x - y)) / max(np.max(np.abs(y)), 1e-30))


def time_path(call_fn, inputs: dict, cotangents: dict, repeats: int) -> dict:
    forward, gradient = programs(call_fn)
    output = forward(inputs)
    return {"forward": back_to_back(lambda: forward(inputs), calls=4 * repeats),
            "fwd+bwd": back_to_back(lambda: gradient(inputs, cotangents), calls=2 * repeats),
            "_output": output}


def roof_fraction(result: dict, timing: dict) -> tuple[float, float]:
    f = result["floors"]
    return (max(f["hbm forward"], f["mxu forward"]) / timing["forward"],
            max(f["hbm fwd+bwd"], f["mxu fwd+bwd"]) / timing["fwd+bwd"])


def sweep_row(result: dict, tiles: list[TpuTiles], args, chip: dict, deadline: float, save) -> None:
    """Fill `result` (a row's): time `chunk`, then the kernel at each tile while the row's share
    of the budget lasts; `save()` after each."""
    start = time.perf_counter()
    row = result["row"]
    inputs, cotangents = make_arrays(row)
    result["floors"] = floors(row, inputs, chip)
    wrap = lambda call: call  # noqa: E731
    if args.projected:
        inputs, cotangents, wrap = projected(inputs, cotangents)
    chunk = time_path(wrap(call_of(row, "chunk")), inputs, cotangents, args.repeats)
    want = chunk.pop("_output")
    result["chunk"] = chunk
    save()
    print(f"tpu_kernel_sweep: {result['label']}: chunk {1e3 * chunk['forward']:.2f} / "
          f"{1e3 * chunk['fwd+bwd']:.2f} ms", file=sys.stderr, flush=True)
    last = time.perf_counter() - start
    for tile in tiles:
        now = time.perf_counter()
        if now + 1.5 * last > deadline:  # a tile may compile slower than the last (more heads)
            result["tiles"].append({"heads": tile.heads, "chunk": tile.chunk, "group": tile.group,
                                    "skipped": "budget"})
            continue
        entry = {"heads": tile.heads, "chunk": tile.chunk, "group": tile.group}
        try:
            timing = time_path(wrap(kernel_call(row, tile, args.interpret)), inputs, cotangents, args.repeats)
            got = timing.pop("_output")
            entry.update(timing)
            entry["error vs chunk"] = max(relative_error(x, y) for x, y in zip(got, want))
        except Exception as error:  # noqa: BLE001  (a tile that fails is a line saying why)
            entry["failed"] = f"{type(error).__name__}: {str(error).strip().splitlines()[0][:200]}"
        last = time.perf_counter() - now
        entry["seconds"] = last
        result["tiles"].append(entry)
        save()
        print(f"tpu_kernel_sweep: {result['label']}: {describe(entry)} ({last:.0f} s)", file=sys.stderr, flush=True)


def describe(entry: dict) -> str:
    tile = f"heads {entry['heads']}, chunk {entry['chunk']}, group {entry['group']}"
    if "forward" in entry:
        return (f"{tile}: {1e3 * entry['forward']:.2f} / {1e3 * entry['fwd+bwd']:.2f} ms, "
                f"error vs chunk {entry['error vs chunk']:.2e}")
    return f"{tile}: {entry.get('failed') or 'skipped (' + entry['skipped'] + ')'}"


def report(results: list[dict], chip: dict, budget: float) -> str:
    lines = [f"# The TPU kernels' tiles on {jax.devices()[0].device_kind}", "",
             f"JAX {jax.__version__}; roofline {chip['peak_tflops']:g} TFLOP/s, {chip['hbm_gbs']:g} GB/s; budget "
             f"{budget:g} s. Written by `benchmarks/tpu_kernel_sweep.py` (its docstring defines every column). Times "
             "in ms, one call of calls run back to back; `× chunk` is the `chunk` path's time over the tile's (above 1: the kernel is faster); "
             "`error` is max |kernel − chunk| / max |chunk| over the output and the final state.", "",
             "| row | path | heads | chunk | group | forward ms | fwd+bwd ms | × chunk fwd / fwd+bwd "
             "| % roof fwd / fwd+bwd | error |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for result in results:
        chunk = result["chunk"]
        if chunk is None:
            continue
        roof = roof_fraction(result, chunk)
        lines.append(f"| {result['label']} | `chunk` | | | | {1e3 * chunk['forward']:.2f} | {1e3 * chunk['fwd+bwd']:.2f} "
                     f"| 1 / 1 | {100 * roof[0]:.1f}% / {100 * roof[1]:.1f}% | |")
        for entry in result["tiles"]:
            path = "`pallas_tpu`"
            head = f"| {result['label']} | {path} | {entry['heads']} | {entry['chunk']} | {entry['group']} |"
            if "forward" not in entry:
                lines.append(f"{head} {entry.get('failed') or 'skipped: ' + entry['skipped']} | | | | |")
                continue
            roof = roof_fraction(result, entry)
            lines.append(f"{head} {1e3 * entry['forward']:.2f} | {1e3 * entry['fwd+bwd']:.2f} "
                         f"| {chunk['forward'] / entry['forward']:.2f} / {chunk['fwd+bwd'] / entry['fwd+bwd']:.2f} "
                         f"| {100 * roof[0]:.1f}% / {100 * roof[1]:.1f}% | {entry['error vs chunk']:.1e} |")
    lines += ["", "Fastest tile per row, forward+backward:", ""]
    for result in results:
        timed_tiles = [e for e in result["tiles"] if "fwd+bwd" in e]
        if timed_tiles:
            best = min(timed_tiles, key=lambda e: e["fwd+bwd"])
            lines.append(f"- {result['label']}: heads {best['heads']}, chunk {best['chunk']}, group {best['group']}: "
                         f"{1e3 * best['forward']:.2f} / {1e3 * best['fwd+bwd']:.2f} ms "
                         f"(`chunk` {1e3 * result['chunk']['forward']:.2f} / {1e3 * result['chunk']['fwd+bwd']:.2f})")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder for tpu_kernel_sweep.md and .json")
    parser.add_argument("--budget", type=float, default=280, help="seconds; no row or tile is started after it")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--heads", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--chunks", type=int, nargs="+", default=[128, 256])
    parser.add_argument("--groups", type=int, nargs="+", default=[4],
                        help="diagonal groups of the recurrent gk kernels (TpuTiles.group)")
    parser.add_argument("--rows", type=int, nargs="+", help="indices of the rows to run (default: all)")
    parser.add_argument("--peak-tflops", type=float, default=197.0)
    parser.add_argument("--hbm-gbs", type=float, default=819.0)
    parser.add_argument("--projected", action="store_true", help="token arrays held [B, T, heads·D], as a model's "
                        "projections give them (tpu_paths.projected)")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, interpret mode off a TPU (any machine)")
    args = parser.parse_args(argv)
    args.interpret = jax.default_backend() != "tpu"
    if args.smoke:  # one tile of 4 heads a step; interpret mode takes any chunk, Mosaic a multiple of 128
        args.heads, args.chunks = [4], [16 if args.interpret else 128]
    chip = {"peak_tflops": args.peak_tflops, "hbm_gbs": args.hbm_gbs}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start, results = time.perf_counter(), []
    chosen = rows(args.smoke)
    chosen = [chosen[i] for i in args.rows] if args.rows else chosen

    def save():
        (out / "tpu_kernel_sweep.json").write_text(json.dumps(results, indent=1))
        (out / "tpu_kernel_sweep.md").write_text(report(results, chip, args.budget))

    for index, row in enumerate(chosen):
        elapsed = time.perf_counter() - start
        if elapsed > args.budget:
            print(f"tpu_kernel_sweep: budget spent, skipping {label(row)}", file=sys.stderr)
            continue
        share = (args.budget - elapsed) / (len(chosen) - index)
        named = label(row) + (", as projected" if args.projected else "")
        results.append({"row": row, "label": named, "floors": None, "chunk": None, "tiles": []})
        tiles = tiles_of(row, args.heads, args.chunks, args.smoke, tuple(args.groups))
        sweep_row(results[-1], tiles, args, chip, time.perf_counter() + share, save)
    print(report(results, chip, args.budget))
    print(f"tpu_kernel_sweep: done in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
