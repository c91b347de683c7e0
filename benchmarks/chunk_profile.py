"""Where the chunk algorithm's time goes on this CPU, and the floor of its XLA formulation.

Issue 3 asks, for targets out of reach, for profiles and for what would reach them. This
script measures four things, each side by side in one run:

1. **Matmul rates.** The float32 peak (a jitted 2048² `jnp.dot`) against the batched small
   matmuls one chunk step issues ([B·H·P] × C×64 @ 64×64 and the C×C score products), each
   as one jitted op, with both cores available and in a child process pinned to one core.
2. **Cores kept busy.** Process CPU time over wall time of the 2048² dot and of the chunk
   forward and forward+backward: how many of the cores each keeps working on average.
3. **The matmul-only floor.** A `lax.scan` over steps of P chunks that issues exactly the
   chunk forward's four batched matmuls per step (state update, inter-chunk output, scores,
   scores @ v) on pre-laid-out inputs, and nothing else: no decay, no loads, no stores.
   Its model-FLOP utilisation bounds what any XLA formulation with these products reaches.
4. **Op-time breakdown** of the chunk forward+backward from XLA CPU's own per-operation
   trace (`--xla_cpu_enable_xprof_traceme`): matmuls (dot and YNNPACK fusions), data
   movement (copies, concatenations, dynamic slices and updates), zero fills, element-wise.

    python benchmarks/chunk_profile.py                         # print the markdown
    python benchmarks/chunk_profile.py --out benchmarks/results/chunk_profile.md
    python benchmarks/chunk_profile.py --quick --out /tmp/profile.md   # seconds: a smoke run
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_cpu_enable_xprof_traceme=true"
).strip()

import argparse
import collections
import functools
import glob
import gzip
import json
import statistics
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
from jax import lax

from recurrax.chunk import chunk_recurrent, default_tiling
from recurrax.tools.bench.machine import machine_description
from recurrax.tools.cases import Case

sys.path.insert(0, os.path.dirname(__file__))
from chunk_sweep import interleaved, programs

B, T, H, K, V = 2, 2048, 8, 64, 64
PEAK_SIZE = 2048
MODEL_FWD, MODEL_FWD_BWD = 4 * B * T * H * K * V, 12 * B * T * H * K * V
QUICK = False


def configure(quick: bool) -> None:
    """`--quick`: tiny sizes (one step of the 64×8 skeleton) and a small peak matmul, for a
    smoke run of seconds whose figures mean nothing."""
    global B, T, H, K, V, PEAK_SIZE, MODEL_FWD, MODEL_FWD_BWD, QUICK
    if quick:
        B, T, H, K, V, PEAK_SIZE, QUICK = 1, 512, 2, 16, 16, 256, True
        MODEL_FWD, MODEL_FWD_BWD = 4 * B * T * H * K * V, 12 * B * T * H * K * V


def case(gate: str) -> Case:
    return Case.benchmark(B, T, H, K, V, gates=gate)


def best_of(fn, args, rounds: int) -> tuple[float, float]:
    """(median, best) seconds of a jitted call: `chunk_sweep.interleaved` with one candidate."""
    return interleaved({"call": (fn, args)}, rounds)["call"]


def peak(rounds: int) -> float:
    x = jnp.ones((PEAK_SIZE, PEAK_SIZE), jnp.float32)
    return 2 * PEAK_SIZE**3 / best_of(jax.jit(jnp.dot), (x, x), rounds)[1]


def matmul_shapes(C: int, P: int) -> dict[str, tuple[int, int, int, int]]:
    """(batch, M, contraction, N) of the chunk step's products at chunk size C."""
    n = B * H * P
    return {
        f"q @ S, U = kᵀv   [{n}] {C}×{K} @ {K}×{V}": (n, C, K, V),
        f"scores = q kᵀ    [{n}] {C}×{K} @ {K}×{C}": (n, C, K, C),
        f"scores @ v       [{n}] {C}×{C} @ {C}×{V}": (n, C, C, V),
    }


def busy_cores(fn, args, rounds: int) -> tuple[float, float]:
    """(median wall seconds, process CPU seconds / wall seconds) over `rounds` calls: how
    many cores the call keeps busy on average (idle pool threads sleep and count nothing)."""
    for _ in range(2):
        jax.block_until_ready(fn(*args))
    walls, cpu, wall = [], 0.0, 0.0
    for _ in range(rounds):
        start, start_cpu = time.perf_counter(), time.process_time()
        jax.block_until_ready(fn(*args))
        walls.append(time.perf_counter() - start)
        cpu, wall = cpu + time.process_time() - start_cpu, wall + walls[-1]
    return statistics.median(walls), cpu / wall


def matmul_rates(rounds: int) -> dict[str, float]:
    """GFLOP/s of the peak and of each small batched product (best of `rounds`), run in
    this process (both cores available)."""
    rates = {f"peak {PEAK_SIZE}² dot": peak(rounds) / 1e9}
    for C, P in ((64, 8), (32, 4)):
        for name, (n, m, k, o) in matmul_shapes(C, P).items():
            a, b = jnp.ones((n, m, k), jnp.float32), jnp.ones((n, k, o), jnp.float32)
            seconds = best_of(
                jax.jit(lambda a, b: jnp.einsum("bmk,bko->bmo", a, b)), (a, b), rounds
            )[1]
            rates[name] = 2 * n * m * k * o / seconds / 1e9
    return rates


def in_child(cores: set[int], rounds: int) -> dict[str, float]:
    """`matmul_rates` in a child process restricted to `cores`."""
    code = (
        f"import os, json, sys; os.sched_setaffinity(0, {cores!r});"
        f"sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r});"
        f"import chunk_profile as p; p.configure({QUICK}); print(json.dumps(p.matmul_rates({rounds})))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def skeleton(C: int, P: int, backward: bool):
    """The chunk pass's batched matmuls alone in a `lax.scan`; returns (fn, args, FLOPs)."""
    steps = T // (C * P)
    x = jnp.full((steps, B, H, P, C, K), 0.01, jnp.float32)
    mm = functools.partial(jnp.einsum, preferred_element_type=jnp.float32)

    def body(state, xs):
        q, k, v = xs
        updates = mm("bhpck,bhpcv->bhpkv", k, v)
        starts = []
        for p in range(P):  # the state recurrence, element-wise
            starts.append(state)
            state = 0.9 * state + updates[:, :, p]
        starts = jnp.stack(starts, axis=2)
        scores = mm("bhpck,bhpsk->bhpcs", q, k)
        out = mm("bhpck,bhpkv->bhpcv", q, starts) + mm("bhpcs,bhpsv->bhpcv", scores, v)
        if not backward:
            return state, out
        d_scores = mm("bhpcv,bhpsv->bhpcs", out, v)  # do vᵀ
        dq = mm("bhpcs,bhpsk->bhpck", d_scores, k) + mm(
            "bhpcv,bhpkv->bhpck", out, starts
        )
        dk = mm("bhpcs,bhpck->bhpsk", d_scores, q) + mm("bhpcv,bhpkv->bhpck", v, starts)
        dv = mm("bhpcs,bhpcv->bhpsv", scores, out) + mm("bhpck,bhpkv->bhpcv", k, starts)
        reads = mm("bhpck,bhpcv->bhpkv", q, out)
        return state + reads[:, :, 0], dq + dk + dv

    fn = jax.jit(
        lambda q, k, v: lax.scan(body, jnp.zeros((B, H, K, V), jnp.float32), (q, k, v))
    )
    per_token = 4 * K * V + 2 * C * (K + V)
    if backward:
        per_token += 8 * K * V + 2 * C * (3 * K + 2 * V)
    return fn, (x, x, x), per_token * B * T * H


def categorise(name: str) -> str | None:
    if name.startswith(
        (
            "$",
            "ThunkExecutor",
            "while",
            "end:",
            "Pjit",
            "Common",
            "Slinky",
            "Threadpool",
        )
    ):
        return None
    if "ynn" in name or "dot" in name or "xnn" in name:
        return "matmul"
    if name.startswith("wrapped_broadcast"):
        return "zero fill"
    if any(
        word in name
        for word in ("copy", "concatenate", "dynamic", "slice", "pad", "transpose")
    ):
        return "data movement"
    return "element-wise"


def breakdown(gate: str, runs: int = 5) -> dict[str, float]:
    """Milliseconds per run of each op category in the chunk forward+backward (XLA's trace)."""
    _, fwd_bwd, diff = programs(chunk_recurrent, case(gate))
    best_of(fwd_bwd, (diff,), 2)
    with tempfile.TemporaryDirectory() as directory:
        start = time.perf_counter()
        with jax.profiler.trace(directory, create_perfetto_trace=True):
            for _ in range(runs):
                jax.block_until_ready(fwd_bwd(diff))
        wall = (time.perf_counter() - start) / runs
        (path,) = glob.glob(f"{directory}/**/perfetto_trace.json.gz", recursive=True)
        with gzip.open(path) as handle:
            events = json.load(handle)["traceEvents"]
    totals = collections.Counter()
    for event in events:
        category = event.get("ph") == "X" and categorise(event["name"])
        if category:
            totals[category] += event["dur"] / 1e3 / runs
    return {**dict(totals), "wall (traced)": wall * 1e3}


def report(rounds: int) -> list[str]:
    machine = machine_description()
    lines = [
        "# Chunk algorithm: profile on this CPU",
        "",
        (
            f"Machine: {machine.get('cpu')}, {machine.get('logical_cpus')} logical CPUs; jax {jax.__version__}; "
            f"commit {machine.get('commit')}; load average {os.getloadavg()[0]:.1f} at the start. "
            f"Shape B={B} T={T} H={H} K={K} V={V}, float32. Made by "
            "`python benchmarks/chunk_profile.py --out benchmarks/results/chunk_profile.md`."
        ),
        "",
        *(["**Quick run (`--quick`): tiny sizes, one round — the figures mean nothing.**", ""] if QUICK else []),
        "## 1. Matmul rates (GFLOP/s, best of the run)",
        "",
        "| product | both cores | pinned to one core |",
        "|---|---:|---:|",
    ]
    both, one = matmul_rates(rounds), in_child({0}, rounds)
    lines += [f"| {name} | {both[name]:.0f} | {one[name]:.0f} |" for name in both]

    lines += [
        "",
        "## 2. Cores kept busy (process CPU time / wall time, median wall ms)",
        "",
        "| program | median ms | busy cores |",
        "|---|---:|---:|",
    ]
    x = jnp.ones((PEAK_SIZE, PEAK_SIZE), jnp.float32)
    programs_ = {f"{PEAK_SIZE}² dot": (jax.jit(jnp.dot), (x, x))}
    for gate in ("g", "gk"):
        fwd, fwd_bwd, diff = programs(chunk_recurrent, case(gate))
        programs_[f"chunk fwd, {gate}"] = (fwd, (diff,))
        programs_[f"chunk fwd+bwd, {gate}"] = (fwd_bwd, (diff,))
    for name, (fn, args) in programs_.items():
        median, busy = busy_cores(fn, args, rounds)
        lines.append(f"| {name} | {1e3 * median:.1f} | {busy:.2f} |")

    top = peak(rounds)
    lines += [
        "",
        f"## 3. The matmul-only floor (peak {top / 1e9:.0f} GFLOP/s in this section)",
        "",
        "| C×P | pass | median ms | best ms | matmul GFLOP/s (best) | model-FLOP utilisation (best) |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for C, P in ((64, 8), (32, 4)):
        for backward in (False, True):
            fn, args, flops = skeleton(C, P, backward)
            median, best = best_of(fn, args, rounds)
            model = MODEL_FWD_BWD if backward else MODEL_FWD
            lines.append(
                f"| {C}×{P} | {'fwd+bwd' if backward else 'fwd'} | {1e3 * median:.1f} | {1e3 * best:.1f} "
                f"| {flops / best / 1e9:.0f} | {100 * model / best / top:.1f}% |"
            )

    lines += [
        "",
        "## 4. Op-time breakdown of the chunk forward+backward (ms per run and share, XLA trace)",
        "",
        "Summed durations of the operations XLA's trace records; tracing itself slows the run",
        "(the traced wall time is the last row), so read the shares rather than the milliseconds.",
        "",
        "| category | g (" + _tiling("g") + ") | gk (" + _tiling("gk") + ") |",
        "|---|---:|---:|",
    ]
    parts = {gate: breakdown(gate) for gate in ("g", "gk")}
    categories = ("matmul", "data movement", "element-wise", "zero fill")
    totals = {
        gate: sum(part.get(c, 0) for c in categories) for gate, part in parts.items()
    }

    def cell(gate: str, category: str) -> str:
        ms = parts[gate].get(category, 0)
        return f"{ms:.1f} ({100 * ms / totals[gate]:.0f}%)"

    lines += [f"| {c} | {cell('g', c)} | {cell('gk', c)} |" for c in categories]
    lines.append(
        f"| wall (traced) | {parts['g']['wall (traced)']:.1f} | {parts['gk']['wall (traced)']:.1f} |"
    )
    return lines


def _tiling(gate: str) -> str:
    t = default_tiling(gate == "gk")
    return f"{t.chunk_size}x{t.leaf_size}x{t.chunks_per_step}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--out", help="write the markdown here")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one round: a smoke run of seconds")
    args = parser.parse_args(argv)
    configure(args.quick)
    if args.quick:
        args.rounds = 1
    text = "\n".join(report(args.rounds)) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as handle:
            handle.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
