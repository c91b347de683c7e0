"""Memory per device of a sharded training step, from XLA's memory analysis, compiled ahead of
time against meshes of up to 64 simulated devices: a 340M GLA and a Mamba-2-130M-shaped model.

    python benchmarks/sharded_memory.py            # writes results/sharded_memory.md, .json and .png
    python benchmarks/sharded_memory.py --tiny --out /tmp/memory   # tiny models: a smoke run
    python benchmarks/sharded_memory.py --part sequence   # re-measure one part, keep the other's rows

Each model is measured in a process of its own (both at once; `--jobs 1` for one at a time).

Nothing is run and nothing 340M-sized is made: each model is built abstractly (`nnx.eval_shape`,
shapes only) and one adamw training step (`examples/train_sharded.py`'s, with its shardings
and rules) is traced, lowered and compiled for a mesh of simulated CPU devices
(`jax_num_cpu_devices`), then `compiled.memory_analysis()` gives the bytes one device's
program holds:

- parameters and optimizer state per device: the sizes of their shards (each array's
  `sharding.shard_shape`), checked against XLA's argument bytes, which hold exactly them plus
  one device's tokens (the step donates them, so the outputs alias the arguments);
- temporaries: XLA's `temp_size_in_bytes` — activations kept for the backward, gradients
  (sharded like the parameters) and gathered weights.

Targets: parameters + optimizer state per device ≈ total / (FSDP × tensor) within 10%; the
temporaries of a 32,768-token context fall as the sequence axis grows. XLA's CPU compiler
lays out buffers without a memory-minimising schedule, so absolute temporaries are larger
than a GPU's or TPU's for the same program; the ratios between layouts are what carries over.
LLVM's optimisation is turned down (`--xla_backend_optimization_level=0`): it changes the
machine code, not the buffers, and saves compile time.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

DEVICES = 64
os.environ["XLA_FLAGS"] = " ".join(filter(None, [os.environ.get("XLA_FLAGS", ""), "--xla_backend_optimization_level=0",
                                                 "--xla_llvm_disable_expensive_passes=true"]))

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", DEVICES)

import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

import recurrax.nn as rnn  # noqa: E402
from recurrax.nn.pretrained import CausalLM  # noqa: E402
from recurrax.tools.bench.machine import machine_description  # noqa: E402

from mamba2_130m import MAMBA2_130M  # noqa: E402
from mamba2_130m import TINY as MAMBA2_TINY  # noqa: E402
from pretrained_340m import GLA_340M  # noqa: E402
from pretrained_340m import TINY as GLA_TINY  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).resolve().parent / "results"
MODELS = {"GLA 340M": (CausalLM, GLA_340M, GLA_TINY), "Mamba-2 130M": (CausalLM, MAMBA2_130M, MAMBA2_TINY)}
PARAMETER_LAYOUTS = ["data=16,tensor=4 fsdp"]
"""Layouts for parameters and optimizer state only (a short context: `--short-len` tokens per
row); the sequence layouts below count as parameter layouts too (FSDP 8)."""
SEQUENCE_LAYOUTS = ["data=8 fsdp", "data=8,sequence=2 fsdp", "data=8,sequence=8 fsdp"]
"""FSDP 8 with the 32,768-token context split over 1, 2, 8 devices (8 to 64 devices)."""
TINY_PARAMETER_LAYOUTS = ["data=4,tensor=2 fsdp"]
TINY_SEQUENCE_LAYOUTS = ["data=2 fsdp", "data=2,sequence=2 fsdp", "data=2,sequence=4 fsdp"]
MiB = 2**20
NOTES = [
    "Parameter and optimizer bytes are what the shardings hold; XLA's argument bytes (the "
    "arguments column) agree to within one device's tokens. Temporaries include the step's "
    "gradients (sharded like the parameters) and, under FSDP, the gathered weights of a layer.",
    "",
    "The temporaries at 32,768 tokens per row are the CPU compiler's buffer assignment of the whole "
    "step (130 to 160 GiB per device at sequence 1; the float32 logits alone are 32,768 × vocabulary × "
    "4 bytes, 4 GiB for GLA, per copy); a GPU or TPU compile, which schedules for memory, may hold "
    "much less (not measured here). The ratio column is the measured effect of the sequence axis: "
    "the models split the tokens themselves (`recurrax.parallel.recurrent` in the mixers, a "
    "neighbour exchange in the short convolutions).",
]
"""Read with the tables (written into the results file)."""


def example():
    """examples/train_sharded.py, imported by path: its step, shardings and rules."""
    spec = importlib.util.spec_from_file_location("train_sharded", ROOT / "examples" / "train_sharded.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def shard_bytes(tree, shardings) -> int:
    """Bytes one device holds of `tree` laid out by `shardings` (the largest shard of each array)."""
    return sum(math.prod(s.shard_shape(x.shape)) * x.dtype.itemsize
               for x, s in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings)))


def measure(train, model_class, config: dict, layout: str, batch: int, length: int) -> dict:
    """Compile one training step for `layout` ('data=8,tensor=2 fsdp') and read its memory."""
    mesh_text, _, fsdp = layout.partition(" ")
    sizes = train.parse_mesh(mesh_text)
    mesh = train.make_mesh(sizes)
    rules = train.rules(bool(fsdp))
    model = nnx.eval_shape(lambda: model_class(config, rngs=nnx.Rngs(0)))
    graphdef, params = nnx.split(model)
    optimizer = optax.adamw(1e-3)
    opt_state = jax.eval_shape(optimizer.init, params)
    params_sharding, opt_sharding = train.state_shardings(model, optimizer, mesh, bool(fsdp))
    step = train.jit_step(graphdef, optimizer, mesh, params_sharding, opt_sharding, donate=True)
    tokens = jax.ShapeDtypeStruct((batch * sizes["data"], length), jnp.int32,
                                  sharding=NamedSharding(mesh, PartitionSpec("data", "sequence")))
    started = time.perf_counter()
    with rnn.use_mesh(mesh, rules):
        compiled = step.trace(train.abstract(params, params_sharding), train.abstract(opt_state, opt_sharding),
                              tokens, tokens).lower().compile()
    memory = compiled.memory_analysis()
    total = shard_bytes(params, jax.tree.map(lambda _: NamedSharding(mesh, PartitionSpec()), params))
    return dict(
        layout=layout, devices=math.prod(sizes.values()), split=(sizes["data"] if fsdp else 1) * sizes["tensor"],
        sequence=sizes["sequence"], tokens=length, rows=batch * sizes["data"], total=total,
        count=sum(math.prod(x.shape) for x in jax.tree.leaves(params)),
        params=shard_bytes(params, params_sharding), opt=shard_bytes(opt_state, opt_sharding),
        batch=2 * shard_bytes([tokens], [tokens.sharding]), arguments=memory.argument_size_in_bytes,
        temp=memory.temp_size_in_bytes, seconds=time.perf_counter() - started,
    )


def mib(n: float) -> str:
    return f"{n / MiB:,.1f}"


def parameter_table(rows: list[dict]) -> list[str]:
    lines = ["| model | layout | devices | FSDP × tensor | params / device MiB | optimizer / device MiB | "
             "(params + opt) × FSDP × tensor / (params + opt of one copy) | XLA arguments MiB (= params + opt + tokens) | "
             "temporaries MiB | target (within 10%) |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        ratio = (r["params"] + r["opt"]) * r["split"] / (3 * r["total"])
        check = abs(r["arguments"] - (r["params"] + r["opt"] + r["batch"])) <= 64 * 1024
        lines.append(f"| {r['model']} | `{r['layout']}` | {r['devices']} | {r['split']} | {mib(r['params'])} | "
                     f"{mib(r['opt'])} | {ratio:.3f} | {mib(r['arguments'])}{'' if check else ' (differs!)'} | "
                     f"{mib(r['temp'])} | {'met' if abs(ratio - 1) <= 0.1 else 'MISSED'} |")
    return lines


def sequence_table(rows: list[dict]) -> list[str]:
    lines = ["| model | layout | devices | sequence | tokens / device | temporaries MiB | vs sequence 1 | "
             "params + opt / device MiB |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        first = next(f for f in rows if f["model"] == r["model"])
        lines.append(f"| {r['model']} | `{r['layout']}` | {r['devices']} | {r['sequence']} | "
                     f"{r['tokens'] // r['sequence']:,} | {mib(r['temp'])} | {r['temp'] / first['temp']:.2f} | "
                     f"{mib(r['params'] + r['opt'])} |")
    return lines


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for name in dict.fromkeys(r["model"] for r in rows):
        mine = sorted({r["split"]: r for r in rows if r["model"] == name}.values(), key=lambda r: r["split"])
        left.plot([r["split"] for r in mine], [(r["params"] + r["opt"]) / MiB for r in mine], "o-", label=name)
        left.plot([r["split"] for r in mine], [3 * r["total"] / r["split"] / MiB for r in mine], "k:", lw=0.8)
        seq = [r for r in rows if r["model"] == name and r["kind"] == "sequence"]
        right.plot([r["sequence"] for r in seq], [r["temp"] / MiB for r in seq], "o-", label=name)
    left.set(xscale="log", yscale="log", xlabel="FSDP × tensor", ylabel="MiB per device",
             title="parameters + adamw state (dotted: total / (FSDP × tensor))")
    right.set(xscale="log", yscale="log", xlabel="sequence axis size (FSDP over data)", ylabel="MiB per device",
              title=f"XLA temporaries, {rows[-1]['tokens']:,} tokens per row")
    for axis in (left, right):
        axis.legend()
        axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def measure_model(name: str, args: argparse.Namespace) -> list[dict]:
    """Every layout of `args.part` for the model `name` (run in a process of its own)."""
    model_class, config, tiny = MODELS[name]
    config = tiny if args.tiny else config
    train, rows = example(), []
    for kind in PARTS if args.part == "all" else (args.part,):
        layouts, length = layouts_of(kind, args)
        for layout in layouts:
            row = dict(model=name + (" (tiny)" if args.tiny else ""), kind=kind,
                       **measure(train, model_class, config, layout, 1, length))
            rows.append(row)
            print(f"{row['model']} {layout} T={length}: params+opt {mib(row['params'] + row['opt'])} MiB, "
                  f"temp {mib(row['temp'])} MiB ({row['seconds']:.0f} s)", file=sys.stderr, flush=True)
    return rows


PARTS = ("parameters", "sequence")


def layouts_of(kind: str, args: argparse.Namespace) -> tuple[list[str], int]:
    if kind == "parameters":
        return (TINY_PARAMETER_LAYOUTS if args.tiny else PARAMETER_LAYOUTS), args.short_len
    return (TINY_SEQUENCE_LAYOUTS if args.tiny else SEQUENCE_LAYOUTS), (512 if args.tiny else args.long_len)


def measure_all(argv: list[str], args: argparse.Namespace) -> list[dict]:
    """Start one process per model (`--jobs` at a time); their rows, in MODELS order."""
    rows, pending = {}, list(MODELS)
    running: list[tuple[str, subprocess.Popen]] = []
    while pending or running:
        while pending and len(running) < args.jobs:
            name = pending.pop(0)
            running.append((name, subprocess.Popen([sys.executable, __file__, *argv, "--model", name],
                                                   stdout=subprocess.PIPE, text=True)))
        name, process = running.pop(0)
        output, _ = process.communicate()
        if process.returncode:
            raise SystemExit(f"measuring {name} failed (exit {process.returncode})")
        rows[name] = json.loads(output.splitlines()[-1])
    return [row for name in MODELS for row in rows[name]]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tiny models on up to 8 devices (a smoke run)")
    parser.add_argument("--short-len", type=int, default=256, help="tokens per row for the parameter layouts")
    parser.add_argument("--long-len", type=int, default=32768, help="tokens per row for the sequence layouts")
    parser.add_argument("--part", choices=("all", *PARTS), default="all",
                        help="what to measure; the other part's rows are kept from the JSON in --out")
    parser.add_argument("--jobs", type=int, default=2, help="models measured at once (one process each)")
    parser.add_argument("--model", choices=list(MODELS), default=None, help="internal: measure one model, print JSON")
    parser.add_argument("--out", type=Path, default=RESULTS, help="directory for sharded_memory.md, .json and .png")
    args = parser.parse_args(argv)
    if args.model is not None:
        print(json.dumps(measure_model(args.model, args)))
        return 0
    started = time.perf_counter()
    rows = measure_all(argv, args)
    seconds = time.perf_counter() - started
    saved = args.out / "sharded_memory.json"
    if args.part != "all":
        kept = [r for r in json.loads(saved.read_text())["rows"] if r["kind"] != args.part]
        rows = sorted(kept + rows, key=lambda r: (list(MODELS).index(r["model"].removesuffix(" (tiny)")),
                                                  PARTS.index(r["kind"])))
    args.out.mkdir(parents=True, exist_ok=True)
    saved.write_text(json.dumps({"rows": rows}, indent=1) + "\n")
    (args.out / "sharded_memory.md").write_text(report(rows, args, seconds))
    plot(rows, args.out / "sharded_memory.png")
    print(f"wrote {args.out / 'sharded_memory.md'} in {seconds:.0f} s")
    return 0


def report(rows: list[dict], args: argparse.Namespace, seconds: float) -> str:
    machine = machine_description()
    names = list(dict.fromkeys(r["model"] for r in rows))
    totals = ", ".join(f"{name} {next(r['count'] for r in rows if r['model'] == name) / 1e6:,.1f}M parameters"
                       for name in names)
    short_len, long_len = (rows[i]["tokens"] for i in (0, -1))
    command = "python benchmarks/sharded_memory.py" + (" --tiny" if args.tiny else "")
    return "\n".join([
        "# Memory per device of a sharded training step (XLA's memory analysis)", "",
        f"Generated by `{command}`{'' if args.part == 'all' else f' (last: `--part {args.part}`)'}: "
        f"{seconds / 60:.1f} min (JAX {jax.__version__}, {DEVICES} simulated CPU devices, "
        f"{machine['usable_cpus']} cores, load average {os.getloadavg()[0]:.1f}, {args.jobs} models at once). "
        "Nothing runs: each step is compiled ahead of time for its mesh and `memory_analysis()` read "
        "(see the script's docstring).", "",
        f"Models: {totals}; float32, adamw (two moments per parameter: optimizer state = 2 × "
        "parameters). One row per `data` shard.", "",
        f"## Parameters and optimizer state ({short_len} tokens per row)", "",
        "Target: (params + opt) per device ≈ total / (FSDP × tensor) within 10%, i.e. the ratio ≈ 1.", "",
        *parameter_table(rows), "",
        f"## Temporaries vs the sequence axis ({long_len:,} tokens per row, FSDP over `data`)", "",
        "Target: activation memory per device falls as the sequence axis grows.", "",
        *sequence_table([r for r in rows if r["kind"] == "sequence"]), "",
        *NOTES, "",
        "![memory per device](sharded_memory.png)", "",
    ])


if __name__ == "__main__":
    sys.exit(main())
