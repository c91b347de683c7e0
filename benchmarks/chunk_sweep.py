"""Sweep of the chunk algorithm's tiling on this machine.

A tiling is `CxcxP`: chunk_size C (the state is materialised every C tokens) × leaf_size c
(exact element-wise leaf of the per-channel ladder) × chunks_per_step P (chunks batched in
one step of the state scan), i.e. `recurrax.chunk.Tiling(C, c, P)`. For each gate kind and
tiling this times the forward and the forward+backward of `recurrax.chunk.chunk_recurrent`
(jitted; compilation excluded), round-robin with a float32 matmul peak measurement (a
jitted N×N `jnp.dot`, N = 2048) so that noise from a shared machine hits everything alike,
and reports median and best times, model-FLOP utilisation (4·B·T·H·K·V forward,
12·B·T·H·K·V forward+backward) against the best matmul peak of the same run, and the time
ratio to the `scan` implementation (`--scan`). Inputs come from `recurrax.tools.cases`
(`Case.benchmark`: float32, gates `log_sigmoid(normal) / 16`, no initial state).

    python benchmarks/chunk_sweep.py                                  # the default grid
    python benchmarks/chunk_sweep.py --gates g,gk --tilings 64x1x8,32x1x4 --rounds 9 --scan
    python benchmarks/chunk_sweep.py --out benchmarks/results/chunk_sweep.md   # append markdown
    python benchmarks/chunk_sweep.py --quick --scan --out /tmp/sweep.md       # seconds: a smoke run
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from recurrax.chunk import Tiling, chunk_recurrent
from recurrax.tools.cases import GATE_PRESETS, Case, call, make_cotangents, make_inputs, split_args


def programs(fn, case: Case):
    """(forward, forward+backward, differentiable inputs) of `fn` on `case`'s inputs: `fn` is a
    registered name or an algorithm `fn(problem, *, scale, reverse)`. Both programs are jitted
    and take the differentiable inputs; the backward differentiates all of them (the loss is
    `<output, d_output> + <final_state, d_state>` for random cotangents)."""
    diff, rest = split_args(make_inputs(case))
    d_output, d_state = make_cotangents(case)

    def run(diff):
        return call(fn, **diff, **rest)

    def loss(diff):
        output, final_state = run(diff)
        return jnp.sum(output * d_output) + jnp.sum(final_state * d_state)

    return jax.jit(run), jax.jit(jax.value_and_grad(loss)), diff


def interleaved(candidates: dict, rounds: int) -> dict:
    """Median and best seconds of each candidate `(fn, args)`, timed round-robin."""
    for fn, args in candidates.values():
        jax.block_until_ready(fn(*args))
        jax.block_until_ready(fn(*args))
    times = {name: [] for name in candidates}
    for _ in range(rounds):
        for name, (fn, args) in candidates.items():
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times[name].append(time.perf_counter() - start)
    return {name: (statistics.median(t), min(t)) for name, t in times.items()}


QUICK = dict(shape="1,64,2,16,16", gates="g,gk", tilings="16x1x1,16x4x2", rounds=1, peak_size=128)
"""`--quick`: tiny sizes, one round — a smoke run of seconds (the figures mean nothing)."""


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="2,2048,8,64,64", help="B,T,H,K,V")
    parser.add_argument("--gates", default="g,gk", help=f"comma-separated, of {list(GATE_PRESETS)}")
    parser.add_argument("--tilings", default="32x1x1,32x1x4,64x1x1,64x1x8,32x2x4", help="CxcxP, comma-separated")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--dtype", default="float32", help="the inputs' dtype (float32 or bfloat16)")
    parser.add_argument("--peak-size", type=int, default=2048, help="N of the N×N float32 matmul peak")
    parser.add_argument("--modes", default="fwd,fwd+bwd")
    parser.add_argument("--scan", action="store_true", help="also time the scan implementation")
    parser.add_argument("--quick", action="store_true", help="tiny shape and tilings, one round (smoke run)")
    parser.add_argument("--out", help="append the markdown tables to this file")
    args = parser.parse_args(argv)
    if args.quick:
        parser.set_defaults(**QUICK)
        args = parser.parse_args(argv)
    lines = []

    def emit(line=""):
        print(line, flush=True)
        lines.append(line)

    B, T, H, K, V = map(int, args.shape.split(","))
    size = args.peak_size
    x = jnp.asarray(np.random.default_rng(0).standard_normal((size, size)), jnp.float32)
    peak_fn = jax.jit(jnp.dot)
    tilings = [Tiling(*map(int, t.split("x"))) for t in args.tilings.split(",")]
    modes = args.modes.split(",")
    emit(f"### B={B} T={T} H={H} K={K} V={V}, {args.dtype}, {args.rounds} interleaved rounds, "
         f"load average {os.getloadavg()[0]:.1f} at the start")
    for gate in args.gates.split(","):
        case = Case.benchmark(B, T, H, K, V, gates=gate, dtype=args.dtype)
        candidates = {"peak": (peak_fn, (x, x))}
        fns = {
            f"chunk {t.chunk_size}x{t.leaf_size}x{t.chunks_per_step}": functools.partial(chunk_recurrent, tiling=t)
            for t in tilings
        }
        if args.scan:
            fns["scan"] = "scan"
        for name, fn in fns.items():
            fwd, fwdbwd, diff = programs(fn, case)
            if "fwd" in modes:
                candidates[(name, "fwd")] = (fwd, (diff,))
            if "fwd+bwd" in modes:
                candidates[(name, "fwd+bwd")] = (fwdbwd, (diff,))
        result = interleaved(candidates, args.rounds)
        peak = 2 * size**3 / result.pop("peak")[1]
        emit(f"\n#### gate {gate}: matmul peak {peak / 1e9:.0f} GFLOP/s (best of the run)\n")
        emit("| tiling | mode | median ms | best ms | MFU (median) | MFU (best) | scan / chunk (median) |")
        emit("|---|---|---:|---:|---:|---:|---:|")
        elements = B * T * H * K * V
        for (name, mode), (med, best) in result.items():
            flops = (4 if mode == "fwd" else 12) * elements
            ratio = ""
            if ("scan", mode) in result and name != "scan":
                ratio = f"{result[('scan', mode)][0] / med:.1f}×"
            emit(f"| {name} | {mode} | {med * 1e3:.1f} | {best * 1e3:.1f} | {flops / med / peak:.1%} | "
                 f"{flops / best / peak:.1%} | {ratio} |")
    if args.out:
        with open(args.out, "a") as f:
            f.write("\n".join(lines) + "\n\n")


if __name__ == "__main__":
    main()
