"""One mixture-of-experts layer on this CPU: the routed experts against every expert on every token.

    python benchmarks/moe.py                      # the issue's shapes; tens of minutes on 2 loaded cores
    python benchmarks/moe.py --quick --out /tmp/moe   # small shapes: a smoke run

Writes `moe.md` and `moe.png` into `--out` (default `benchmarks/results/`).

One layer of `recurrax.nn.MixtureOfExperts` (float32): `tokens` tokens of width `d_model`, SwiGLU experts
of width `width`, softmax router with renormalised top-k. Three parts, in one run:

1. the grouped matmul on its own (one projection `d_model → width` of the routed rows, 64
   experts): the CPU's block-padded batched matmul at several block sizes, `jax.lax.ragged_dot`,
   every expert on every token, and equal per-expert blocks (a capacity-style layout that
   holds only for perfectly balanced routing: the speed bound, not a dropless method);
2. the layer, routed vs all-experts, forward and forward+backward (gradients of the input,
   the router and the expert weights), 64 experts top-8 and 512 experts top-10;
3. XLA's temporary bytes of the compiled routed forward at 64 and 512 experts (fixed top-k).

Timings alternate between the compared functions round by round (a shared machine's load
moves all of them alike), each pass (forward, forward+backward) in its own rounds; each figure
is the median of the rounds, the load average is recorded before and after.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from recurrax.nn import (  # noqa: E402
    ExpertWeights,
    all_experts,
    default_block_size,
    dispatch,
    grouped_matmul,
    padded_rows,
    route,
    routed_experts,
)

RESULTS = Path(__file__).resolve().parent / "results"


def layer_inputs(tokens: int, d_model: int, width: int, experts: int, seed: int = 0):
    """Inputs `x [n, D]`, router `[D, E]` and expert weights (scaled so activations stay O(1))."""
    keys = jax.random.split(jax.random.PRNGKey(seed), 5)
    x = jax.random.normal(keys[0], (tokens, d_model), jnp.float32)
    router = jax.random.normal(keys[1], (d_model, experts), jnp.float32) * d_model ** -0.5
    scale = d_model ** -0.5
    weights = ExpertWeights(jax.random.normal(keys[2], (experts, d_model, width)) * scale,
                            jax.random.normal(keys[3], (experts, width, d_model)) * width ** -0.5,
                            jax.random.normal(keys[4], (experts, d_model, width)) * scale)
    return x, router, weights


def layer(method: str, top_k: int):
    """`(x, router, weights) → y` through the routed path (`"routed"`) or every expert (`"all"`)."""
    def forward(x, router, weights):
        routing = route(x @ router, top_k, renormalize=True)
        if method == "routed":
            return routed_experts(x, routing, weights, method="blocks")
        return all_experts(x, routing, weights)
    return forward


def forward_backward(forward, cotangent):
    """Gradients of `⟨forward(x, router, weights), cotangent⟩` in all three arguments."""
    return jax.grad(lambda *args: jnp.vdot(forward(*args), cotangent), argnums=(0, 1, 2))


def alternate(functions: dict, rounds: int) -> dict:
    """Median seconds of each function (warmed up once), timed round by round in turn."""
    for fn in functions.values():
        jax.block_until_ready(fn())
    samples = {name: [] for name in functions}
    for _ in range(rounds):
        for name, fn in functions.items():
            start = time.perf_counter()
            jax.block_until_ready(fn())
            samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(times) for name, times in samples.items()}


def grouped_matmul_choices(tokens, d_model, width, experts, top_k, rounds, ragged_rows):
    """Part 1: seconds of one routed projection per method."""
    x, router, weights = layer_inputs(tokens, d_model, width, experts)
    routing = jax.jit(lambda x: route(x @ router, top_k))(x)
    pairs = tokens * top_k
    rows = jax.random.normal(jax.random.PRNGKey(1), (pairs, d_model))
    functions, flops = {}, 2 * pairs * d_model * width
    for block in (32, 64, 128):
        routed = dispatch(routing.experts, experts, block)
        padded = jnp.zeros((padded_rows(pairs, experts, block), d_model)).at[:pairs].set(rows)
        run = jax.jit(lambda r, w, d: grouped_matmul(r, w, d, method="blocks"))
        functions[f"blocks, B = {block}"] = lambda run=run, p=padded, d=routed: run(p, weights.up, d)
    every = jax.jit(lambda x, w: jnp.einsum("nd,edf->enf", x, w))
    functions["every expert on every token"] = lambda: every(x, weights.up)
    equal = jax.jit(lambda r, w: jnp.einsum("ecd,edf->ecf", r.reshape(experts, -1, d_model), w))
    functions["equal per-expert blocks (not dropless)"] = lambda: equal(rows, weights.up)
    seconds = alternate(functions, rounds)
    # ragged_dot on a slice of the rows (it is slow on XLA's CPU backend), scaled to all rows.
    routed = dispatch(routing.experts[: ragged_rows // top_k], experts, 1)
    part = rows[: routed.rows.shape[0]]
    ragged = jax.jit(lambda r, w, d: grouped_matmul(r, w, d, method="ragged"))
    ragged_seconds = alternate({"r": lambda: ragged(part, weights.up, routed)}, 1)["r"]
    seconds[f"`ragged_dot` ({routed.rows.shape[0]} rows, scaled ×{pairs / routed.rows.shape[0]:g})"] = (
        ragged_seconds * pairs / routed.rows.shape[0])
    every_flops = 2 * tokens * experts * d_model * width
    return {name: (s, (every_flops if name.startswith("every") else flops) / s / 1e9) for name, s in seconds.items()}


def layer_times(tokens, d_model, width, experts, top_k, rounds, with_all: bool):
    """Part 2: median seconds of the routed (and all-experts) layer, forward and fwd+bwd."""
    x, router, weights = layer_inputs(tokens, d_model, width, experts)
    cotangent = jax.random.normal(jax.random.PRNGKey(2), x.shape)
    seconds = {}
    for kind, make in (("forward", layer), ("fwd+bwd", lambda m, k: forward_backward(layer(m, k), cotangent))):
        # each pass's pair in its own rounds: a function is never timed right after another pass's
        # multi-GB call (whose freed pages the next call faults back in)
        functions = {f"{method} {kind}": partial(jax.jit(make(method, top_k)), x, router, weights)
                     for method in (("routed", "all") if with_all else ("routed",))}
        seconds |= alternate(functions, rounds)
    return seconds


def temp_bytes(tokens, d_model, width, experts, top_k, method):
    """Part 3: XLA's temporary bytes of the compiled forward (abstract inputs: nothing allocated)."""
    spec = jax.ShapeDtypeStruct
    args = (spec((tokens, d_model), jnp.float32), spec((d_model, experts), jnp.float32),
            ExpertWeights(spec((experts, d_model, width), jnp.float32), spec((experts, width, d_model), jnp.float32),
                          spec((experts, d_model, width), jnp.float32)))
    compiled = jax.jit(layer(method, top_k)).lower(*args).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small shapes, one round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--all-512", action="store_true",
                        help="also time the all-experts path at 512 experts (~50× the routed work; skipped by default)")
    args = parser.parse_args(argv)
    if args.quick:
        tokens, d_model, width, rounds, ragged_rows = 256, 64, 32, 1, 256
    else:
        tokens, d_model, width, rounds, ragged_rows = 8 * 512, 1024, 512, args.rounds, 4096
    args.out.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    started = time.perf_counter()
    print("grouped matmul choices …", flush=True)
    choices = grouped_matmul_choices(tokens, d_model, width, 64, 8, rounds, ragged_rows)
    print(choices, "\nlayer, 64 experts top-8 …", flush=True)
    small = layer_times(tokens, d_model, width, 64, 8, rounds, with_all=True)
    print(small, "\nlayer, 512 experts top-10 …", flush=True)
    large = layer_times(tokens, d_model, width, 512, 10, rounds, with_all=args.all_512)
    print(large, "\ntemp bytes …", flush=True)
    memory = {(E, k, method): temp_bytes(tokens, d_model, width, E, k, method)
              for E, k in ((64, 8), (512, 8), (64, 10), (512, 10)) for method in ("routed", "all")}
    load_after = os.getloadavg()
    elapsed = time.perf_counter() - started
    write_markdown(args.out, locals())
    plot(args.out / "moe.png", small, large, memory)
    print(f"done in {elapsed:.0f} s; wrote {args.out}/moe.md and moe.png")
    return 0


def write_markdown(out: Path, run: dict) -> None:
    tokens, d_model, width = run["tokens"], run["d_model"], run["width"]
    small, large, memory = run["small"], run["large"], run["memory"]
    lines = [
        "# Mixture of experts: routed experts vs every expert (benchmarks/moe.py)", "",
        f"One layer, {tokens} tokens, d_model {d_model}, SwiGLU experts of width {width}, float32, "
        f"JAX {jax.__version__}, {platform.processor() or platform.machine()}, {os.cpu_count()} cores. "
        f"Median of {run['rounds']} alternating rounds. Run time {run['elapsed']:.0f} s.", "",
        f"**Loaded machine:** load average {run['load_before'][0]:.1f} before, {run['load_after'][0]:.1f} after "
        f"(shared with other jobs): absolute times are several times a quiet machine's; the ratios, timed "
        "round by round in turn, are the figures to read.", "",
        "## Grouped matmul on this CPU (one projection of the routed rows, 64 experts, top-8)", "",
        "| method | seconds | GFLOP/s (useful) |", "|---|---:|---:|",
    ]
    lines += [f"| {name} | {s:.3f} | {rate:.1f} |" for name, (s, rate) in run["choices"].items()]
    lines += ["", "The routed layer (`method=\"blocks\"`) runs the sorted rows in a loop over the experts "
              "that have rows and, inside it, over each one's blocks, each block through the expert's whole FFN, "
              "with a hand-written VJP (block size "
              f"{default_block_size('blocks', tokens * 8, 64)} at 64 experts top-8, "
              f"{default_block_size('blocks', tokens * 10, 512)} at 512 top-10 by `default_block_size`).", "",
              "## One layer", "", "| experts, top-k | pass | routed (s) | all experts (s) | speed-up |",
              "|---|---|---:|---:|---:|"]
    for label, times in (("64, top-8", small), ("512, top-10", large)):
        for kind in ("forward", "fwd+bwd"):
            routed, every = times[f"routed {kind}"], times.get(f"all {kind}")
            lines.append(f"| {label} | {kind} | {routed:.3f} | "
                         + (f"{every:.3f} | {every / routed:.1f}× |" if every else "skipped (over budget) | — |"))
    lines += ["", "At 512 experts the all-experts path (≈ 51× the routed FLOPs, ~3 GB of expert "
              "activations) was skipped to fit the run's budget.", "",
              "## XLA temporary bytes of the compiled forward", "",
              "| experts | top-k | routed (MiB) | all experts (MiB) |", "|---:|---:|---:|---:|"]
    for E, k in ((64, 8), (512, 8), (64, 10), (512, 10)):
        lines.append(f"| {E} | {k} | {memory[(E, k, 'routed')] / 2**20:.1f} | {memory[(E, k, 'all')] / 2**20:.1f} |")
    routed_growth = memory[(512, 8, "routed")] / memory[(64, 8, "routed")]
    every_growth = memory[(512, 8, "all")] / memory[(64, 8, "all")]
    lines += ["", "The routed forward holds no per-row buffer: each block's rows are gathered, run through "
              "their expert and added, weighted, into the `[n, D]` output inside the loop. Its "
              "temporaries are that output, the routing's index arrays (a few bytes per padded row) and the "
              "router's `[n, E]` logits: from 64 to 512 experts at top-8 they grow "
              f"×{routed_growth:.2f} (the logits and indices), every expert's ×{every_growth:.1f}.", ""]
    (out / "moe.md").write_text("\n".join(lines))


def plot(path: Path, small: dict, large: dict, memory: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (times, temps) = plt.subplots(1, 2, figsize=(11, 4))
    labels, routed, every = [], [], []
    for label, data in (("64/top-8", small), ("512/top-10", large)):
        for kind in ("forward", "fwd+bwd"):
            labels.append(f"{label}\n{kind}")
            routed.append(data[f"routed {kind}"])
            every.append(data.get(f"all {kind}", 0.0))
    positions = range(len(labels))
    times.bar([p - 0.2 for p in positions], routed, 0.4, label="routed")
    times.bar([p + 0.2 for p in positions], every, 0.4, label="all experts (0: skipped)")
    times.set_xticks(list(positions), labels)
    times.set_ylabel("seconds (loaded CPU)")
    times.set_title("one MoE layer")
    times.legend()
    keys = [(64, 8), (512, 8), (64, 10), (512, 10)]
    temps.bar([i - 0.2 for i in range(4)], [memory[(*key, "routed")] / 2**20 for key in keys], 0.4, label="routed")
    temps.bar([i + 0.2 for i in range(4)], [memory[(*key, "all")] / 2**20 for key in keys], 0.4, label="all experts")
    temps.set_xticks(range(4), [f"E={E}\nk={k}" for E, k in keys])
    temps.set_yscale("log")
    temps.set_ylabel("XLA temp MiB (forward)")
    temps.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
