"""The XLA `chunk` algorithm's tiling swept on a TPU, for both operations (issue 45: "tune the
XLA chunk path for TPUs").

    source benchmarks/tpu_env.sh && python3 benchmarks/tpu_chunk_sweep.py --out DIR --budget 300   # a TPU VM
    python benchmarks/tpu_chunk_sweep.py --smoke --out /tmp/s                                     # anywhere, seconds

Rows, in priority order, all bfloat16 (the shapes of `benchmarks/results/tpu.md`):
- `recurrent` with a per-key-channel `gk` and with a per-head `g`, B = 4, T = 4096, H = 16,
  K = V = 64: `recurrax.chunk.chunk_recurrent` with `Tiling(C, c, P)` (chunk size, ladder leaf,
  chunks per scan step), written `CxcxP`;
- `delta_rule` Gated DeltaNet (per-head `g`) and KDA (per-key-channel `gk`), B = 1, T = 4096,
  32 value heads reading 16 query/key heads, K = V = 128: `recurrax.delta.chunk_delta` with
  chunk size C (and leaf c), written `Cxc`.

Each candidate is jitted and timed alone (one warm-up, `--repeats` calls; min and median) in
forward and forward+backward (`jax.value_and_grad` of <output, d_out> + <final, d_final> with
respect to every input). A candidate's forward output is compared with the first candidate's of
its row (max |x − y| / max |y|), so a tiling that is fast and wrong shows. `--budget` seconds:
no candidate starts after it. Writes `tpu_chunk_sweep.md` and `.json` to `--out` after every
candidate.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import timed  # noqa: E402
from delta_rule_tpu import relative_difference  # noqa: E402

from recurrax.chunk import Tiling, chunk_recurrent  # noqa: E402
from recurrax.delta import canonicalize_delta, chunk_delta  # noqa: E402
from recurrax.tools.cases import Case, call, make_cotangents, make_inputs, split_args  # noqa: E402

RECURRENT = dict(B=4, T=4096, H=16, K=64, V=64)
DELTA = dict(B=1, T=4096, H=32, Hqk=16, K=128, V=128)
ROWS = (
    ("recurrent gk", "32x1x4,32x1x16,64x1x8,64x1x16,64x8x8,64x16x16,128x16x8,128x32x8"),
    ("recurrent g", "64x1x8,64x1x32,128x1x8,128x1x32,256x1x4,256x1x16"),
    ("delta GDN", "64x1,32x1,128x1,256x1"),
    ("delta KDA", "64x1,32x1,128x1,128x16,256x16"),
)
SMOKE_RECURRENT = dict(B=1, T=64, H=2, K=8, V=8)
SMOKE_DELTA = dict(B=1, T=64, H=2, Hqk=1, K=8, V=8)
SMOKE_ROWS = (("recurrent gk", "16x1x2,16x4x1"), ("delta KDA", "32x1"))


def recurrent_programs(gate: str, tiling: str, shape: dict):
    """(forward, fwd+bwd) of `chunk_recurrent` with `tiling` on a bf16 case, and their argument."""
    case = Case.benchmark(**shape, gates=gate, dtype="bfloat16")
    diff, rest = split_args(make_inputs(case))
    d_output, d_state = make_cotangents(case)
    algorithm = functools.partial(chunk_recurrent, tiling=Tiling(*map(int, tiling.split("x"))))

    def run(diff):
        return call(algorithm, **diff, **rest)

    def loss(diff):
        output, final = run(diff)
        return jnp.sum(output.astype(jnp.float32) * d_output) + jnp.sum(final * d_state)

    return jax.jit(run), jax.jit(jax.value_and_grad(loss)), diff


def delta_programs(gate: str, tiling: str, shape: dict):
    """(forward, fwd+bwd) of `chunk_delta` with chunk size and leaf `tiling` (`Cxc`) on bf16
    inputs with `qk_l2norm`, and their argument."""
    B, T, H, Hqk, K, V = (shape[n] for n in ("B", "T", "H", "Hqk", "K", "V"))
    rng = np.random.default_rng(0)
    normal = lambda *s: rng.standard_normal(s, np.float32)  # noqa: E731
    log_sigmoid = lambda x: -np.logaddexp(0, -x)  # noqa: E731
    diff = {"query": normal(B, T, Hqk, K), "key": normal(B, T, Hqk, K), "value": normal(B, T, H, V),
            "beta": 1 / (1 + np.exp(-normal(B, T, H)))}
    diff["g" if gate == "GDN" else "gk"] = log_sigmoid(normal(B, T, H, *(() if gate == "GDN" else (K,)))) / 16
    diff = {n: jnp.asarray(x, jnp.bfloat16 if n in ("query", "key", "value") else jnp.float32) for n, x in diff.items()}
    d_output, d_final = jnp.asarray(normal(B, T, H, V)), jnp.asarray(normal(B, H, K, V))
    chunk_size, leaf = map(int, tiling.split("x"))

    def run(diff):
        problem, scale, layout = canonicalize_delta(
            diff["query"], diff["key"], diff["value"], diff["beta"], diff.get("g"), diff.get("gk"),
            None, None, None, True)
        output, final = chunk_delta(problem, scale=scale, chunk_size=chunk_size, leaf_size=leaf)
        return layout.restore(output), final

    def loss(diff):
        output, final = run(diff)
        return jnp.sum(output.astype(jnp.float32) * d_output) + jnp.sum(final * d_final)

    return jax.jit(run), jax.jit(jax.value_and_grad(loss)), diff


def report(rows: list[dict], shapes: dict, out: Path) -> None:
    lines = ["# The XLA chunk algorithm's tiling on this chip", "",
             f"Device: {jax.devices()[0].device_kind}, JAX {jax.__version__}; bfloat16; "
             f"`recurrent` at {shapes['recurrent']}, `delta_rule` at {shapes['delta']}. "
             "Times in ms (min / median); difference: the forward output's max |x − y| / max |y| "
             "against the row's first tiling (today's default).", "",
             "| row | tiling | forward ms | fwd+bwd ms | difference |", "|---|---|---|---|---|"]
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['row']} | {row['tiling']} | {row['error']} | | |")
            continue
        times = [f"{1e3 * min(row[m]):.2f} / {1e3 * float(np.median(row[m])):.2f}" for m in ("forward", "fwd+bwd")]
        lines.append(f"| {row['row']} | {row['tiling']} | {times[0]} | {times[1]} | {row['difference']:.1e} |")
    (out / "tpu_chunk_sweep.md").write_text("\n".join(lines) + "\n")
    (out / "tpu_chunk_sweep.json").write_text(json.dumps({"shapes": shapes, "rows": rows}, indent=1))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--budget", type=float, default=300.0, help="seconds after which no candidate starts")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, any machine")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    shapes = {"recurrent": SMOKE_RECURRENT if args.smoke else RECURRENT, "delta": SMOKE_DELTA if args.smoke else DELTA}
    start, rows = time.perf_counter(), []
    for name, tilings in SMOKE_ROWS if args.smoke else ROWS:
        kind, gate = name.split()
        first = None
        for tiling in tilings.split(","):
            if time.perf_counter() - start > args.budget:
                print(f"budget spent: {name} {tiling} not run", flush=True)
                continue
            row = {"row": name, "tiling": tiling}
            try:
                make = recurrent_programs if kind == "recurrent" else delta_programs
                forward, gradient, diff = make(gate, tiling, shapes[kind])
                output = jax.block_until_ready(forward(diff))[0]
                first = output if first is None else first
                row["difference"] = relative_difference(output, first)
                row["forward"] = timed(lambda: forward(diff), args.repeats)
                row["fwd+bwd"] = timed(lambda: gradient(diff), args.repeats)
            except Exception as error:  # noqa: BLE001  (a tiling that fails is a row saying why)
                row = {**row, "error": f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"}
            rows.append(row)
            print(f"{time.perf_counter() - start:6.0f} s  {name} {tiling}: "
                  + (row.get("error") or f"{1e3 * min(row['forward']):.2f} / {1e3 * min(row['fwd+bwd']):.2f} ms, "
                     f"difference {row['difference']:.1e}"), flush=True)
            report(rows, shapes, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
