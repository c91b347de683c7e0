"""A mamba2-130m-shaped model, recurrax side by side with `transformers` (PyTorch CPU), one run.

    python benchmarks/mamba2_130m.py --torch-python TORCH_PYTHON [--threads 2]
    python benchmarks/mamba2_130m.py --torch-python TORCH_PYTHON --tiny   # the same steps on a tiny model (seconds)

TORCH_PYTHON is an interpreter of another environment with torch (CPU build) and `transformers`
5.25 (the one tests/fixtures/transformers/make_fixtures.py describes), e.g. `venv-hf/bin/python`.

Builds `transformers`' Mamba2 in the shape of state-spaces/mamba2-130m (d_model 768, 24 layers,
24 heads × 64, state 128, one group, vocab 50,280, tied embeddings) with random weights (dt and
A initialised as `transformers` does), writes it with recurrax's `save_pretrained` and measures,
for recurrax (JAX) and then, in a subprocess of the same run, `transformers`
(`mamba2_130m_torch.py`, torch with `--threads` threads, pure-PyTorch path), float32, on the
same checkpoint and inputs:
- load time (`from_pretrained` of the directory);
- prefill tokens/s: 8 prompts × 512 tokens in one call (`[8, 512]`), logits of the last
  position only on both sides (`logits_to_keep=1` for transformers);
- decode tokens/s at batch 1, 8 and 64: one token per sequence per step through the cache
  (ours donated to the step, so updated in place as `transformers` updates its own).
Each figure is the median of `--repeats` runs (decode: of `--decode-steps` steps, 16), after
a warm-up; the spread is min–max. Also the max logit difference on a check batch `[2, 64]` against
`transformers` and against a float64 run of ours; where our time goes (`_mamba2_parts.py`:
each part of a layer timed alone); and this CPU's floors (`_floors.py` and the torch side):
float32 matmul GFLOP/s at the model's shapes and streaming-read GB/s, hence the least time a
prefill (its FLOPs at the measured matmul rates) and a decode step (the bytes it must read at
the measured bandwidth, or its FLOPs if slower) can take, and the highest ratio to
`transformers` reachable here. Writes results/mamba2_130m.md and .png, and adds a row of
ratios to results/mamba2_130m_runs.md.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from recurrax.chunk import default_tiling
from recurrax.generation import greedy_tokens
from recurrax.nn.pretrained import CausalLM, from_pretrained, save_pretrained, size_config
from recurrax.tools.bench.machine import machine_description

from _floors import matmul_gflops, read_gbps
from _mamba2_parts import part_seconds, repeated_ssd_seconds
from _timing import timed

MAMBA2_130M = size_config("mamba2-130m")
"""state-spaces/mamba2-130m's shape in `transformers`' Mamba2Config."""
TINY = {**MAMBA2_130M, "hidden_size": 64, "num_hidden_layers": 2, "num_heads": 4, "head_dim": 32, "state_size": 16,
        "vocab_size": 256}
RESULTS = Path(__file__).resolve().parent / "results"
BATCHES = (1, 8, 64)
RUNS = "mamba2_130m_runs.md"
RUNS_HEADER = """# mamba2-130m shape: every run's ratios to transformers

One row per run of `python benchmarks/mamba2_130m.py` (appended by the script; the newest
run's details are in `mamba2_130m.md`): the run-to-run spread of the side-by-side ratios on
this shared 2-CPU machine.

| date (UTC) | commit | load start → end | prefill | decode b=1 | decode b=8 | decode b=64 |
|---|---|---|---:|---:|---:|---:|
"""


def append_run(path: Path, commit: str, load_start: float, load_end: float, ratios: dict) -> None:
    """Add one row of `ratios` (prefill and decode per batch, ours over transformers') to the runs table."""
    if not path.exists():
        path.write_text(RUNS_HEADER)
    cells = [f"{ratios['prefill']:.1f}×"] + [f"{ratios[f'decode b={b}']:.1f}×" for b in BATCHES]
    date = time.strftime("%Y-%m-%d %H:%M", time.gmtime())
    with path.open("a") as table:
        table.write(f"| {date} | {commit} | {load_start:.1f} → {load_end:.1f} | " + " | ".join(cells) + " |\n")


def random_model(config: dict, seed: int = 0) -> CausalLM:
    """Random weights; dt_bias and A_log as `transformers` initialises them (dt in [1e-3, 0.1])."""
    model = CausalLM(config, rngs=nnx.Rngs(seed))
    rng = np.random.default_rng(seed)
    for block in model.body.layers:
        H = block.mixer.num_heads
        dt = np.exp(rng.random(H) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3)).clip(1e-4)
        block.mixer.dt_bias.set_value(jnp.asarray(dt + np.log(-np.expm1(-dt)), jnp.float32))
        block.mixer.A_log.set_value(jnp.log(jnp.arange(1, H + 1, dtype=jnp.float32)))
    return model


def last_logits(model: CausalLM, tokens):
    """The last position's logits only (as transformers' `logits_to_keep=1`): the layers on every
    token, the head on the last."""
    return model(tokens, logits_to_keep=1)[:, 0]


def spread(samples) -> str:
    return f"{min(samples) * 1e3:,.1f}–{max(samples) * 1e3:,.1f} ms"


def ours(directory: Path, inputs: dict, repeats: int, decode_steps: int) -> dict:
    start = time.perf_counter()
    model = from_pretrained(directory)
    jax.block_until_ready(jax.tree.leaves(nnx.state(model)))
    load = time.perf_counter() - start
    graphdef, state = nnx.split(model)
    forward = jax.jit(lambda state, tokens: last_logits(nnx.merge(graphdef, state), tokens))
    prompts = jnp.asarray(inputs["prefill"], jnp.int32)
    prefill = timed(lambda: forward(state, prompts), repeats)

    @functools.partial(jax.jit, donate_argnums=(2,))  # the cache is updated in place, as transformers' is
    def step(state, token, cache):
        logits, cache = nnx.merge(graphdef, state)(token, cache)
        return greedy_tokens(logits[:, -1])[:, None], cache  # generate's greedy choice

    decode = {}
    for batch in BATCHES:
        cache = model.init_cache(batch, decode_steps + 1)  # attention layers hold the tokens decoded here
        token = jnp.asarray(np.random.default_rng(batch).integers(0, model.vocab_size, (batch, 1)), jnp.int32)
        token, cache = step(state, token, cache)  # warm-up (compiles)
        samples = []
        for _ in range(decode_steps):
            start = time.perf_counter()
            token, cache = jax.block_until_ready(step(state, token, cache))
            samples.append(time.perf_counter() - start)
        decode[batch] = samples
    check = jnp.asarray(inputs["check"], jnp.int32)
    logits = np.asarray(jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))(state, check))
    return dict(load=load, prefill=prefill, decode=decode, logits=logits, model=model, state=state, graphdef=graphdef)


def float64_logits(directory: Path, check) -> np.ndarray:
    with jax.enable_x64(True):
        model = from_pretrained(directory, dtype=jnp.float64)
        return np.asarray(model(jnp.asarray(check, jnp.int32)))


def workload(config: dict, batch: int, length: int, parameters: int) -> dict:
    """The model's matmul shapes ('MxKxN' for the prefill and the decode batches), the prefill's
    FLOPs per matmul shape and of the SSD (the chunk algorithm's forward at its CPU tiling), and
    the bytes a decode step must read (every parameter once, the states read and written)."""
    D, L, V = config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]
    H, P, N, G = config["num_heads"], config["head_dim"], config["state_size"], config["n_groups"]
    I = H * P
    in_dim = 2 * I + 2 * G * N + H
    tokens = batch * length
    C = default_tiling(False).fitted(length).chunk_size
    prefill = {f"{tokens}x{D}x{in_dim}": 2 * tokens * D * in_dim * L, f"{tokens}x{I}x{D}": 2 * tokens * I * D * L,
               f"{batch}x{D}x{V}": 2 * batch * D * V}
    # the shared-query/key chunk forward: per head 2·C·P (scores applied) + 4·N·P (state update,
    # inter-chunk product), per group 2·C·N (the scores, formed once for the group's heads)
    ssd = tokens * L * (H * (4 * N * P + 2 * C * P) + G * 2 * C * N)
    return dict(prefill_flops=prefill, ssd_flops=ssd, chunk=C,
                param_bytes=4 * parameters, state_bytes=2 * 4 * L * H * N * P,
                step_flops=2 * (L * (D * in_dim + I * D) + D * V), in_proj=f"{tokens}x{D}x{in_dim}")


def floors(work: dict, rates: dict, read: float, torch_prefill: float, torch_decode: dict) -> dict:
    """Least seconds of a prefill and of a decode step per batch at the measured rates, and the
    highest ratio to transformers' measured times that they allow."""
    prefill = sum(flops / (rates[shape] * 1e9) for shape, flops in work["prefill_flops"].items())
    prefill += work["ssd_flops"] / (rates[work["in_proj"]] * 1e9)
    best_rate = max(rates.values()) * 1e9
    decode = {b: max((work["param_bytes"] + b * work["state_bytes"]) / (read * 1e9),
                     b * work["step_flops"] / best_rate) for b in BATCHES}
    return dict(prefill=prefill, decode=decode, prefill_ratio=torch_prefill / prefill,
                decode_ratio={b: torch_decode[b] / decode[b] for b in BATCHES})


def parts_table(parts: dict, prefill: float, decode: dict, batch: int, length: int, layers: int,
                how: str | None = None) -> list[str]:
    """Markdown: each part's ms (and share of the whole call) for the prefill and each decode batch
    (the parts in `parts["prefill"]`'s order; `how` says how they were timed, default Mamba-2's)."""
    columns = ["prefill"] + list(BATCHES)
    whole = {"prefill": prefill, **decode}
    head = [f"prefill {batch} × {length}"] + [f"decode step b={b}" for b in BATCHES]
    how = how or (f"`_mamba2_parts.py`: each part of a layer jitted and timed alone, × {layers} layers; the head "
                  "once; the rest is the whole call's median minus the parts: the glue between them — splits, dt "
                  "and gate math, the D skip, residuals, cache writes, argmax — and dispatch")
    lines = ["", f"Where our time goes ({how}):", "",
             "| part | " + " | ".join(head) + " |", "|---|" + "---:|" * len(columns)]
    share = lambda t, c: f"{t * 1e3:,.1f} ms ({t / whole[c]:.0%})"  # noqa: E731
    for name in parts["prefill"]:
        lines.append(f"| {name} | " + " | ".join(share(parts[c][name], c) for c in columns) + " |")
    rest = {c: whole[c] - sum(parts[c].values()) for c in columns}
    lines.append("| rest | " + " | ".join(share(rest[c], c) for c in columns) + " |")
    lines.append("| whole (median above) | " + " | ".join(f"{whole[c] * 1e3:,.1f} ms" for c in columns) + " |")
    return lines


def floor_lines(work: dict, xla: dict, theirs: dict, batch: int, length: int) -> list[str]:
    """Markdown: this CPU's measured rates, the least times they allow and the highest ratios."""
    med = statistics.median
    torch = theirs["floors"]
    torch_prefill = med(theirs["prefill_seconds"])
    torch_decode = {b: med(theirs["decode_seconds"][str(b)]) for b in BATCHES}
    ours_floor = floors(work, xla["matmul_gflops"], max(xla["read_gbps"], torch["read_gbps"]), torch_prefill,
                        torch_decode)
    torch_floor = floors(work, torch["matmul_gflops"], max(xla["read_gbps"], torch["read_gbps"]), torch_prefill,
                         torch_decode)
    names = dict(zip(work["prefill_flops"], work.get("matmul_names", ("in_proj", "out_proj", "head"))))
    lines = ["", "This CPU's floors (float32, medians, measured in the same run):", "",
             "| | XLA (recurrax) | torch (transformers) |", "|---|---:|---:|"]
    for shape in work["prefill_flops"]:
        lines.append(f"| matmul {shape.replace('x', ' × ', 1).replace('x', ' @ ', 1)} ({names[shape]}), GFLOP/s | "
                     f"{xla['matmul_gflops'][shape]:.0f} | {torch['matmul_gflops'][shape]:.0f} |")
    lines.append(f"| streaming read of {work['param_bytes'] / 1e6:,.0f} MB (the weights), GB/s | "
                 f"{xla['read_gbps']:.1f} | {torch['read_gbps']:.1f} |")
    gflop = sum(work["prefill_flops"].values()) / 1e9
    mixer = work.get("mixer_text", f"our SSD (the chunk algorithm's forward at C = {work['chunk']}, query/key shared "
                                   "by the heads); at XLA's measured rates (the SSD at in_proj's)")
    lines += [
        "",
        f"- Prefill {batch} × {length}: {gflop:,.0f} GFLOP of matmuls (projections and the last-position head, the "
        f"same on both sides) and {work['ssd_flops'] / 1e9:,.0f} GFLOP in {mixer} that is at least "
        f"**{ours_floor['prefill']:.2f} s**, so at most **{ours_floor['prefill_ratio']:.1f}×** transformers' "
        f"{torch_prefill:.2f} s on this machine (transformers' own floor at torch's rates: "
        f"{torch_floor['prefill']:.2f} s).",
        f"- Decode step: every weight read once ({work['param_bytes'] / 1e6:,.0f} MB) plus "
        f"{work.get('state_text', 'the SSM states')} read and written ({work['state_bytes'] / 1e6:.1f} MB per row), at the best measured read bandwidth, or the step's "
        f"FLOPs at the best matmul rate if slower: at least "
        + "; ".join(f"b={b} **{ours_floor['decode'][b] * 1e3:,.1f} ms** (at most "
                    f"**{ours_floor['decode_ratio'][b]:.1f}×** transformers' {torch_decode[b] * 1e3:,.1f} ms)"
                    for b in BATCHES) + ".",
    ]
    return lines


def figure(ours_tps: dict, torch_tps: dict, path: Path,
           title: str = "mamba2-130m shape, float32, this CPU (shared)") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(ours_tps)
    x = np.arange(len(labels))
    fig, ax = plt.subplots(figsize=(7, 3.6))
    ax.bar(x - 0.2, [torch_tps[k] for k in labels], 0.4, label="transformers (PyTorch CPU)")
    ax.bar(x + 0.2, [ours_tps[k] for k in labels], 0.4, label="recurrax (JAX CPU)")
    for i, k in enumerate(labels):
        ax.text(i + 0.2, ours_tps[k], f"{ours_tps[k] / torch_tps[k]:.1f}×", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(x, labels)
    ax.set_yscale("log")
    ax.set_ylabel("tokens / s (median)")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--torch-python", required=True,
                        help="an interpreter with torch and transformers 5.25 (runs mamba2_130m_torch.py)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--decode-steps", type=int, default=16)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    config = TINY if args.tiny else MAMBA2_130M
    batch, length = (8, 512) if not args.tiny else (2, 16)
    rng = np.random.default_rng(0)
    inputs = dict(prefill=rng.integers(0, config["vocab_size"], (batch, length)),
                  check=rng.integers(0, config["vocab_size"], (2, 64 if not args.tiny else 8)))
    load_at_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as scratch:
        directory = Path(scratch)
        built = random_model(config)
        save_pretrained(built, directory)
        np.savez(directory / "inputs.npz", **inputs)
        parameters = sum(x.size for x in jax.tree.leaves(nnx.state(built, nnx.Param)))
        work = workload(config, batch, length, parameters)
        (directory / "floor_shapes.json").write_text(json.dumps(
            dict(matmuls=list(work["prefill_flops"]), read_bytes=work["param_bytes"])))
        mine = ours(directory, inputs, args.repeats, args.decode_steps)
        exact = float64_logits(directory, inputs["check"])
        parts = {"prefill": part_seconds(mine["model"], batch, length, False, args.repeats)}
        parts.update({b: part_seconds(mine["model"], b, 1, True, args.repeats) for b in BATCHES})
        repeated_ssd = repeated_ssd_seconds(mine["model"], batch, length, args.repeats)
        xla_floor = dict(matmul_gflops=matmul_gflops(
            [tuple(int(n) for n in key.split("x")) for key in work["prefill_flops"]], args.repeats),
            read_gbps=read_gbps(work["param_bytes"], args.repeats))
        command = [args.torch_python, str(Path(__file__).with_name("mamba2_130m_torch.py")), str(directory),
                   "--threads", str(args.threads), "--repeats", str(args.repeats),
                   "--decode-steps", str(args.decode_steps)]
        subprocess.run(command, check=True)
        theirs = json.loads((directory / "torch_measurements.json").read_text())
        torch_logits = np.load(directory / "torch_logits.npy")

    scale = np.abs(exact).max()
    errors = dict(ours_vs_f64=np.abs(mine["logits"] - exact).max(), torch_vs_f64=np.abs(torch_logits - exact).max(),
                  ours_vs_torch=np.abs(mine["logits"] - torch_logits).max())
    med = statistics.median
    ours_tps = {"prefill": batch * length / med(mine["prefill"])}
    torch_tps = {"prefill": batch * length / med(theirs["prefill_seconds"])}
    for b in BATCHES:
        ours_tps[f"decode b={b}"] = b / med(mine["decode"][b])
        torch_tps[f"decode b={b}"] = b / med(theirs["decode_seconds"][str(b)])
    ratios = {key: ours_tps[key] / torch_tps[key] for key in ours_tps}
    machine = machine_description()
    lines = [
        "# mamba2-130m shape: recurrax vs transformers on this CPU" if not args.tiny else "# Tiny Mamba2 (smoke run)",
        "",
        f"`python benchmarks/mamba2_130m.py` — {parameters / 1e6:.1f}M parameters, float32, random weights; "
        f"{machine['cpu']}, {machine['usable_cpus']} CPUs, load average {load_at_start:.1f} at the start and "
        f"{os.getloadavg()[0]:.1f} at the end (a machine shared with other jobs: the ratios are side by side in "
        f"one run, each side under the load of its turn); JAX {jax.__version__}; torch {theirs['versions']['torch']} with "
        f"{theirs['threads']} threads, transformers {theirs['versions']['transformers']} (pure-PyTorch path); "
        f"commit {machine['commit']}.",
        "",
        "| measurement | recurrax (JAX) | transformers (PyTorch) | ratio |",
        "|---|---:|---:|---:|",
        f"| `from_pretrained` | {mine['load']:.2f} s | {theirs['load_seconds']:.2f} s | "
        f"{theirs['load_seconds'] / mine['load']:.1f}× |",
        f"| prefill {batch} × {length}, tokens/s (median; min–max time) | {ours_tps['prefill']:,.0f} "
        f"({spread(mine['prefill'])}) | {torch_tps['prefill']:,.0f} ({spread(theirs['prefill_seconds'])}) | "
        f"**{ratios['prefill']:.1f}×** |",
    ]
    for b in BATCHES:
        key = f"decode b={b}"
        lines.append(f"| decode batch {b}, tokens/s (median; min–max step) | {ours_tps[key]:,.0f} "
                     f"({spread(mine['decode'][b])}) | {torch_tps[key]:,.0f} "
                     f"({spread(theirs['decode_seconds'][str(b)])}) | **{ratios[key]:.1f}×** |")
    layers = config["num_hidden_layers"]
    lines += [
        "",
        f"Logits on a check batch [2, {inputs['check'].shape[1]}] (max |logit| {scale:.2f}), max absolute difference: "
        f"recurrax float32 vs recurrax float64 {errors['ours_vs_f64']:.2e}; transformers float32 vs recurrax float64 "
        f"{errors['torch_vs_f64']:.2e}; recurrax vs transformers {errors['ours_vs_torch']:.2e} "
        f"({errors['ours_vs_torch'] / scale:.1e} relative).",
    ]
    lines += parts_table(parts, med(mine["prefill"]), {b: med(mine["decode"][b]) for b in BATCHES}, batch, length,
                         layers)
    lines += ["", f"The prefill's SSD with B/C repeated to all {config['num_heads']} heads first (as before `recurrent` "
              f"took query and key shared by the heads), timed the same way: {repeated_ssd * 1e3:,.1f} ms, against "
              f"{parts['prefill']['SSD'] * 1e3:,.1f} ms shared "
              f"({repeated_ssd / parts['prefill']['SSD']:.2f}×)."]
    lines += floor_lines(work, xla_floor, theirs, batch, length)
    text = "\n".join(lines) + "\n"
    print(text)
    if not args.tiny:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "mamba2_130m.md").write_text(text)
        figure(ours_tps, torch_tps, args.out / "mamba2_130m.png")
        append_run(args.out / RUNS, machine["commit"], load_at_start, os.getloadavg()[0], ratios)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
