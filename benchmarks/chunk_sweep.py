"""Sweep of the chunk algorithm's tiling on this machine.

A tiling is `CxcxP`: chunk_size C (the state is materialised every C tokens) × block_size c
(exact element-wise leaf of the per-channel ladder) × chunks_per_step P (chunks batched in
one step of the state scan). For each gate kind and tiling this times the forward and the
forward+backward of the chunk algorithm (jitted; compilation excluded), round-robin with a
float32 matmul peak measurement (a jitted 2048×2048 `jnp.dot`) so that noise from a shared
machine hits everything alike, and reports median and best times, model-FLOP utilisation
(4·B·T·H·K·V forward, 12·B·T·H·K·V forward+backward) against the best matmul peak of the same
run, and the time ratio to the `scan` implementation (`--scan`).

    python benchmarks/chunk_sweep.py                                  # the default grid
    python benchmarks/chunk_sweep.py --gates g,gk --tilings 64x1x8,32x1x4 --rounds 9 --scan
    python benchmarks/chunk_sweep.py --out benchmarks/results/chunk_sweep.md   # append markdown
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

import recurrax
from recurrax._inputs import canonicalize
from recurrax.chunk import chunk

GATES = {
    "none": {},
    "g": {"g": "BTH"},
    "g_gamma": {"g_gamma": "H"},
    "gk": {"gk": "BTHK"},
    "gk+gv": {"gk": "BTHK", "gv": "BTHV"},
}


def make_inputs(B, T, H, K, V, gate, seed=0):
    """Normal q, k, v and log decays log(U(0.9, 1)) for the gate kind, float32."""
    rng = np.random.default_rng(seed)
    sizes = dict(B=B, T=T, H=H, K=K, V=V)
    kwargs = {
        "query": rng.standard_normal((B, T, H, K)),
        "key": rng.standard_normal((B, T, H, K)),
        "value": rng.standard_normal((B, T, H, V)),
    }
    for name, dims in GATES[gate].items():
        kwargs[name] = np.log(rng.uniform(0.9, 1.0, [sizes[d] for d in dims]))
    return {k: jnp.asarray(v, jnp.float32) for k, v in kwargs.items()}


def programs(fn, kwargs):
    """(forward, forward+backward) jitted programs of an algorithm `fn(problem, scale=, reverse=)`;
    the backward differentiates every input (random cotangents for both outputs)."""

    def run(diff):
        problem, config, _ = canonicalize(
            diff["query"], diff["key"], diff["value"], diff.get("g"), diff.get("g_gamma"),
            diff.get("gk"), diff.get("gv"), None, None, False, None,
        )
        return fn(problem, scale=config.scale, reverse=False)

    rng = np.random.default_rng(1)
    o, s = jax.eval_shape(run, kwargs)
    do = jnp.asarray(rng.standard_normal(o.shape), jnp.float32)
    ds = jnp.asarray(rng.standard_normal(s.shape), jnp.float32)

    def loss(diff):
        o, s = run(diff)
        return jnp.sum(o * do) + jnp.sum(s * ds)

    return jax.jit(run), jax.jit(jax.value_and_grad(loss))


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


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="2,2048,8,64,64", help="B,T,H,K,V")
    parser.add_argument("--gates", default="g,gk", help=f"comma-separated, of {list(GATES)}")
    parser.add_argument("--tilings", default="32x1x1,32x1x4,64x1x1,64x1x8,32x2x4", help="CxcxP, comma-separated")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--modes", default="fwd,fwd+bwd")
    parser.add_argument("--scan", action="store_true", help="also time the scan implementation")
    parser.add_argument("--out", help="append the markdown tables to this file")
    args = parser.parse_args(argv)
    lines = []

    def emit(line=""):
        print(line, flush=True)
        lines.append(line)

    B, T, H, K, V = map(int, args.shape.split(","))
    size = 2048
    x = jnp.asarray(np.random.default_rng(0).standard_normal((size, size)), jnp.float32)
    peak_fn = jax.jit(jnp.dot)
    tilings = [tuple(map(int, t.split("x"))) for t in args.tilings.split(",")]
    modes = args.modes.split(",")
    emit(f"### B={B} T={T} H={H} K={K} V={V}, float32, {args.rounds} interleaved rounds, "
         f"load average {os.getloadavg()[0]:.1f} at the start")
    for gate in args.gates.split(","):
        kwargs = make_inputs(B, T, H, K, V, gate)
        candidates = {"peak": (peak_fn, (x, x))}
        fns = {
            f"chunk {C}x{c}x{P}": functools.partial(chunk, chunk_size=C, block_size=c, chunks_per_step=P)
            for C, c, P in tilings
        }
        if args.scan:
            fns["scan"] = recurrax.kernel_registry._implementations["scan"].fn
        for name, fn in fns.items():
            fwd, fwdbwd = programs(fn, kwargs)
            if "fwd" in modes:
                candidates[(name, "fwd")] = (fwd, (kwargs,))
            if "fwd+bwd" in modes:
                candidates[(name, "fwd+bwd")] = (fwdbwd, (kwargs,))
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
