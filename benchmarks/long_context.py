"""Long context on TPU, proven by the TPU compiler: one full training step (forward, backward,
AdamW) of 1B-class models at 32k to 128k tokens per sequence, compiled ahead of time with
libtpu on this CPU (no TPU) for a v5e-8 slice (2×4 chips, 16 GiB each) and one v6e chip
(32 GiB); `memory_analysis()` gives the bytes one chip must hold.

    python benchmarks/long_context.py                 # every case: results/long_context.md, .json, .png
    python benchmarks/long_context.py --tiny --out /tmp/long   # tiny models: a smoke run
    python benchmarks/long_context.py --models "GLA 1.3B" --lengths 131072   # some cases; other rows kept
    python benchmarks/long_context.py --report-only   # rewrite the .md and .png from the .json

Needs libtpu (`pip install 'recurrax[compile-tpu]'`); the environment of
`recurrax.targets.ENVIRONMENT` is set before JAX starts. Each case is compiled in a process of
its own (a 1.3B step takes minutes on two cores).

The step is `examples/train_sharded.py`'s (`jax.value_and_grad` of `token_losses`, the chunked
cross entropy, so the `[B, T, vocab]` logits are never held; optax's adamw; parameters and
optimizer state donated), built on abstract parameters (`nnx.eval_shape`: nothing 1.3B-sized is
allocated) and the mesh of the TPU topology's devices (`recurrax.targets.topology`).
`benchmarks/sharded_memory.py`'s `shard_bytes` counts the parameters and optimizer state
each chip holds. Layouts: the tokens of each row split over `sequence` (the mixers' sequence
parallelism), batch 1 per `data` shard; the parameters' `embed` axis is split over every axis
of the mesh (FSDP over `data` × `sequence`: ZeRO-3 over the whole slice), optionally `tensor`.
Remat: the models' `remat="block"` (each block keeps its input only). Compiled with
`recurrax.targets.TPU_TRAINING_OPTIONS` (no windowed einsums: with them libtpu held every
layer's collective-matmul output buffers through the whole backward, 1 GiB per GLA layer at
128k).

What the hybrid's softmax layers do under sequence parallelism is whatever the library does
when the script runs (today: K/V all-gathered over `sequence`); rerunning the script after a
change is the whole re-measurement.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from recurrax.targets import prepare_environment

prepare_environment()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

import recurrax.nn as rnn  # noqa: E402
from recurrax import targets  # noqa: E402
from recurrax.nn.pretrained import CausalLM  # noqa: E402


RESULTS = Path(__file__).resolve().parent / "results"
GiB = 2**30

GLA_1B3 = dict(
    model_type="gla", hidden_size=2048, num_hidden_layers=24, num_heads=4, expand_k=0.5, expand_v=1, hidden_ratio=4,
    intermediate_size=None, vocab_size=32000, tie_word_embeddings=True, use_short_conv=False, use_output_gate=True,
    norm_eps=1e-6, max_position_embeddings=2048, attn=None)
"""fla's GLA 1.3B training config (`gla_1B.json`: width 2048, 24 layers, 4 heads)."""

MAMBA2_1B3 = dict(
    model_type="mamba2", architectures=["Mamba2ForCausalLM"], hidden_size=2048, num_hidden_layers=48, num_heads=64,
    head_dim=64, expand=2, state_size=128, n_groups=1, conv_kernel=4, chunk_size=256, vocab_size=50288,
    tie_word_embeddings=True, use_bias=False, use_conv_bias=True, residual_in_fp32=True, layer_norm_epsilon=1e-5,
    time_step_limit=[0.0, math.inf])
"""state-spaces/mamba2-1.3b's config (d_model 2048, 48 layers, head dim 64, state 128)."""

HYBRID_1B = dict(
    model_type="qwen3_5_text", vocab_size=248320, hidden_size=2048, intermediate_size=6144, num_hidden_layers=12,
    num_attention_heads=8, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16,
    linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4, full_attention_interval=4,
    tie_word_embeddings=True, hidden_act="silu", rms_norm_eps=1e-6, max_position_embeddings=262144)
"""Qwen3.5-shaped (dense), about 1B: Gated DeltaNet layers with every fourth layer softmax
attention (gated, grouped KV), Qwen3.5's 248k vocabulary (tied), width 2048, 12 layers
(3 attention): 1.19B parameters."""

TINY = {
    "GLA 1.3B": dict(GLA_1B3, hidden_size=64, num_hidden_layers=2, vocab_size=512),
    "Mamba-2 1.3B": dict(MAMBA2_1B3, hidden_size=64, num_hidden_layers=2, num_heads=4, head_dim=32, state_size=16,
                         vocab_size=512, chunk_size=64),
    "Hybrid 1B (Qwen3.5-shaped)": dict(HYBRID_1B, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                       num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                                       linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=32,
                                       linear_value_head_dim=32, vocab_size=512),
}
MODELS = {"GLA 1.3B": GLA_1B3, "Mamba-2 1.3B": MAMBA2_1B3, "Hybrid 1B (Qwen3.5-shaped)": HYBRID_1B}
LENGTHS = (32768, 65536, 131072)
SLICES = {"v5e-8": ("v5e:2x4", ["data=1,sequence=8", "data=2,sequence=4"]), "v6e-1": ("v6e:1x1", ["data=1"])}
"""Each slice: its `recurrax.targets` name and the meshes tried (axes `data`, `tensor`,
`sequence`; missing ones are 1). FSDP always spans the whole mesh."""
AXES = ("data", "tensor", "sequence")


def parse_mesh(text: str) -> dict[str, int]:
    sizes = dict.fromkeys(AXES, 1)
    for part in text.split(","):
        name, _, size = part.partition("=")
        sizes[name] = int(size)
    return sizes


def fsdp_rules():
    """`recurrax.nn.logical_rules("fsdp", "tensor", "sequence")` with the parameters' `embed`
    axis over `data` and `sequence` together: each chip holds 1 / (data × sequence) of them."""
    return tuple((name, ("data", "sequence") if name == "embed" else axis)
                 for name, axis in rnn.logical_rules("fsdp", "tensor", "sequence"))


def measure(name: str, config: dict, slice_name: str, layout: str, remat: str | None, length: int,
            layers: int | None = None) -> dict:
    """Compile one training step for `layout` on the slice and read its memory per chip (with
    `layers`, the model cut to that many layers)."""
    from sharded_memory import example, shard_bytes  # here: it sets jax_num_cpu_devices on import

    full_depth = config["num_hidden_layers"]
    config = dict(config, num_hidden_layers=layers or full_depth)
    train = example()
    target, _ = SLICES[slice_name]
    sizes = parse_mesh(layout)
    devices = targets.topology(target).devices
    if math.prod(sizes.values()) != len(devices):
        raise SystemExit(f"{layout} does not cover the {len(devices)} chips of {target}")
    mesh = jax.make_mesh(tuple(sizes[a] for a in AXES), AXES, axis_types=(jax.sharding.AxisType.Auto,) * 3,
                         devices=devices)
    rules = fsdp_rules()
    model = nnx.eval_shape(lambda: CausalLM(config, remat=remat, rngs=nnx.Rngs(0)))
    graphdef, params = nnx.split(model)
    optimizer = optax.adamw(1e-4)
    opt_state = jax.eval_shape(optimizer.init, params)
    params_sharding = rnn.parameter_shardings(model, mesh, rules)
    opt_sharding = optax.tree_map_params(optimizer, lambda _, sharding: sharding, opt_state, params_sharding,
                                         transform_non_params=lambda _: NamedSharding(mesh, PartitionSpec()))
    step = train.jit_step(graphdef, optimizer, mesh, params_sharding, opt_sharding, donate=True)
    tokens = jax.ShapeDtypeStruct((sizes["data"], length), jnp.int32,
                                  sharding=NamedSharding(mesh, PartitionSpec("data", "sequence")))
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as dump:  # libtpu's buffer assignment, for `largest_allocations`
        try:  # the step carries TPU_TRAINING_OPTIONS (`jit_step` on TPU devices); these add the dump
            with rnn.use_mesh(mesh, rules):
                compiled = step.trace(train.abstract(params, params_sharding), train.abstract(opt_state, opt_sharding),
                                      tokens, tokens).lower().compile(
                    compiler_options=dict(xla_dump_to=dump, xla_dump_hlo_as_text=True))
        except jax.errors.JaxRuntimeError as error:
            needed = HBM_OOM.search(str(error))
            if needed is None:
                raise
            return dict(model=name, slice=slice_name, layout=layout, remat=remat or "none", tokens=length,
                        layers=config["num_hidden_layers"], full_depth=full_depth,
                        seconds=time.perf_counter() - started,
                        failed=f"libtpu: HLO temporaries {needed[1]}iB exceed the HBM available ({needed[2]}iB)",
                        compiler_options=targets.TPU_TRAINING_OPTIONS)
        allocations = largest_allocations(Path(dump))
    memory = compiled.memory_analysis()
    chip = targets.get_target(target).spec
    row = dict(model=name, slice=slice_name, layout=layout, remat=remat or "none", tokens=length,
               layers=config["num_hidden_layers"], full_depth=full_depth,
               chips=len(devices), hbm=chip.hbm_bytes,
               count=sum(math.prod(x.shape) for x in jax.tree.leaves(params)),
               params=shard_bytes(params, params_sharding), opt=shard_bytes(opt_state, opt_sharding),
               arguments=int(memory.argument_size_in_bytes), outputs=int(memory.output_size_in_bytes),
               aliased=int(memory.alias_size_in_bytes), temp=int(memory.temp_size_in_bytes),
               seconds=time.perf_counter() - started, compiler_options=targets.TPU_TRAINING_OPTIONS)
    row["peak"] = row["arguments"] + row["outputs"] - row["aliased"] + row["temp"]
    row["allocations"] = allocations
    return row


HBM_OOM = re.compile(r"CompileTimeHbmOom.*?temporaries \(([\d.]+G)\) exceeds available HBM \(([\d.]+G)\)")
"""libtpu refuses a program whose temporaries exceed the chip's HBM (the bytes it needed, the HBM)."""
ALLOCATION = re.compile(r"^\s*[\d.]+\w+\(\s*\d+%\);\s*([\d.]+)([KMG]i)?B;\s*\d+;\s*\d+;\s*(.+)$", re.MULTILINE)
UNITS = {"": 1, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30}


def largest_allocations(dump: Path, count: int = 6) -> list[list]:
    """The `count` largest allocations of libtpu's buffer assignment for the step (its dumped
    memory-usage report): [bytes, the values placed in it over the step]. An allocation names
    every value that takes its bytes in turn (an instruction's output and the bitcasts and
    in-place updates of it), which the program's largest single values do not."""
    reports = sorted(dump.glob("*jit_step*memory-usage-report.txt"))
    if not reports:
        return []
    report = reports[-1].read_text()
    allocations = [[round(float(size) * UNITS[unit]), values.strip()] for size, unit, values in ALLOCATION.findall(report)]
    return sorted(allocations, key=lambda allocation: -allocation[0])[:count]


def cases(args) -> list[tuple[str, str, str, str | None, int]]:
    """(model, slice, layout, remat, tokens) of every case asked for."""
    chosen = []
    for name in args.models:
        for slice_name in args.slices:
            layouts = [l for l in SLICES[slice_name][1] if args.layouts is None or l in args.layouts]
            for length in args.lengths:
                chosen += [(name, slice_name, layout, args.remat, length, layers) for layout in layouts
                           for layers in args.layers or [None]]
    return chosen


def key(row: dict) -> tuple:
    return row["model"], row["slice"], row["layout"], row["remat"], row["tokens"], row.get("layers")


def run_case(case, args) -> dict | None:
    """Measure one case in a child process; None (and the error printed) when it fails."""
    name, slice_name, layout, remat, length, layers = case
    command = [sys.executable, __file__, "--case", json.dumps(case)]
    command += ["--tiny"] if args.tiny else []
    done = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    sys.stderr.write(done.stderr)
    if done.returncode:
        errors = [line for line in done.stderr.splitlines() if re.match(r"[\w.]+(Error|Exception): ", line)]
        reason = f"exit {done.returncode}" + (f": `{errors[-1][:300].replace('|', '/')}`" if errors else "")
        print(f"{case}: failed ({reason})", file=sys.stderr, flush=True)
        return dict(model=name, slice=slice_name, layout=layout, remat=remat or "none", tokens=length,
                    layers=layers, failed=reason, compiler_options=targets.TPU_TRAINING_OPTIONS)
    row = json.loads(done.stdout.splitlines()[-1])
    if "failed" in row:
        print(f"{case}: {row['failed']}", file=sys.stderr, flush=True)
        return row
    print(f"{name} ({row['layers']} layers) {slice_name} {layout} remat={row['remat']} T={length}: "
          f"peak {row['peak'] / GiB:.2f} GiB "
          f"(arguments {row['arguments'] / GiB:.2f}, temporaries {row['temp'] / GiB:.2f}; {row['seconds']:.0f} s)",
          file=sys.stderr, flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tiny models (a smoke run)")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--slices", nargs="+", default=list(SLICES), choices=list(SLICES))
    parser.add_argument("--lengths", nargs="+", type=int, default=list(LENGTHS), help="tokens per sequence")
    parser.add_argument("--layouts", nargs="+", default=None, help="only these meshes of the slices' (default: all)")
    parser.add_argument("--remat", default="block", type=lambda text: None if text == "none" else text,
                        help="the models' remat: none, block or dots")
    parser.add_argument("--layers", nargs="+", type=int, default=None,
                        help="compile the models cut to these depths (the report extrapolates to the full depth)")
    parser.add_argument("--report-only", action="store_true", help="rewrite the .md and .png from the .json")
    parser.add_argument("--case", default=None, help="internal: measure one case (JSON), print its row")
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder for long_context.md, .json and .png")
    args = parser.parse_args(argv)
    models = TINY if args.tiny else MODELS
    if args.case is not None:
        name, slice_name, layout, remat, length, layers = json.loads(args.case)
        print(json.dumps(measure(name, models[name], slice_name, layout, remat, length, layers)))
        return 0
    saved = args.out / "long_context.json"
    rows = json.loads(saved.read_text())["rows"] if saved.exists() else []
    if not args.report_only:
        for case in cases(args):
            row = run_case(case, args)
            rows = json.loads(saved.read_text())["rows"] if saved.exists() else []  # another run's rows kept
            rows = [r for r in rows if key(r) != key(row)] + [row]
            args.out.mkdir(parents=True, exist_ok=True)
            saved.write_text(json.dumps({"tiny": args.tiny, "rows": rows}, indent=1) + "\n")
    (args.out / "long_context.md").write_text(report(rows))
    plot(rows, args.out / "long_context.png")
    print(f"wrote {args.out / 'long_context.md'}")
    return 0


def full(row: dict) -> bool:
    """A compile of the whole model (not cut to fewer layers, not an estimate) that succeeded."""
    return "failed" not in row and "basis" not in row and row.get("layers") == row.get("full_depth")


def estimates(rows: list[dict]) -> list[dict]:
    """The full-depth estimates of the cases with no full-depth compile (a compile supersedes
    an estimate)."""
    compiled = {key(r)[:-1] for r in rows if full(r)}
    return [e for e in extrapolated(rows) if key(e)[:-1] not in compiled]


def fits(row: dict) -> bool:
    return "failed" not in row and row["peak"] <= row["hbm"]


def best(rows: list[dict]) -> list[dict]:
    """Per (model, slice, tokens): the measured layout and remat with the smallest peak."""
    chosen: dict[tuple, dict] = {}
    for row in rows:
        if "failed" in row:
            continue
        group = row["model"], row["slice"], row["tokens"]
        if row.get("layers", row.get("full_depth")) != row.get("full_depth"):
            continue  # a cut model (see `extrapolated`)
        if group not in chosen or row["peak"] < chosen[group]["peak"]:
            chosen[group] = row
    return sorted(chosen.values(), key=order)


def order(row: dict) -> tuple:
    """Rows by model (as `MODELS` lists them), slice, tokens."""
    return list(MODELS).index(row["model"]), row["slice"], row["tokens"]


def gib(n: int) -> str:
    return f"{n / GiB:.2f}"


def extrapolation(rows: list[dict]) -> list[str]:
    wanted = estimates(rows)
    compiled = {key(r)[:-1]: r for r in rows if full(r)}
    checks = [f"{e['model']}, {e['slice']} `{e['layout']}`, {e['tokens']:,} tokens: estimated {gib(e['peak'])} GiB "
              f"from {e['basis']}, compiled {gib(compiled[key(e)[:-1]]['peak'])} GiB"
              for e in extrapolated(rows) if key(e)[:-1] in compiled]
    if not wanted and not checks:
        return []
    lines = ["## Full depth, extrapolated from the models cut to two depths", "",
             "Where the full-depth step's compile did not finish on this machine, the model was compiled cut to "
             "two depths (every other figure as the full model) and each byte count extended linearly to the full "
             "depth (see `extrapolated`). Compile s: both compiles.", ""]
    lines += [*table(sorted(wanted, key=order)), ""] if wanted else []
    if checks:
        lines += ["Estimates checked against a full-depth compile (libtpu's schedule is not linear in the depth; "
                  "where both exist, the compile is what the tables above report):", "",
                  *(f"- {check}" for check in checks), ""]
    return lines


def table(rows: list[dict]) -> list[str]:
    lines = ["| model | layers | slice | mesh | remat | tokens / sequence | params + opt / chip GiB | arguments GiB | "
             "outputs GiB | temporaries GiB | peak / chip GiB | HBM GiB | fits | compile s |",
             "|---|---:|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
    for r in rows:
        if "failed" in r:
            lines.append(f"| {r['model']} | {r.get('layers') or 'all'} | {r['slice']} | `{r['layout']}` | "
                         f"{r['remat']} | {r['tokens']:,} | | | | | | | NO: {r['failed']} | "
                         f"{'' if r.get('seconds') is None else round(r['seconds'])} |")
            continue
        depth = f"{r.get('layers') or 'all'}{' (est.)' if 'basis' in r else ''}"
        lines.append(f"| {r['model']} | {depth} | {r['slice']} | `{r['layout']}` | {r['remat']} | {r['tokens']:,} | "
                     f"{gib(r['params'] + r['opt'])} | {gib(r['arguments'])} | {gib(r['outputs'])} | "
                     f"{gib(r['temp'])} | "
                     f"**{gib(r['peak'])}** | {r['hbm'] // GiB} | {'yes' if fits(r) else 'NO'} | {r['seconds']:.0f} |")
    return lines


def report(rows: list[dict]) -> str:
    names = list(dict.fromkeys(r["model"] for r in rows if full(r)))
    counts = ", ".join(f"{n} {next(r['count'] for r in rows if r['model'] == n and full(r)) / 1e9:.2f}B parameters"
                       for n in names)
    ordered = sorted(rows, key=lambda r: (list(MODELS).index(r["model"]), r["slice"], r["tokens"], r["layout"]))
    return "\n".join([
        "# Long context: a training step's memory per TPU chip (libtpu's memory analysis)", "",
        f"Generated by `python benchmarks/long_context.py` (JAX {jax.__version__}): each step compiled ahead of time "
        "for the slice by libtpu on a CPU, without a TPU; nothing ran. Models (float32 parameters, compute and "
        "AdamW state)" + (f": {counts}." if counts else "; parameter counts: see the configs in the script."), "",
        "One step: forward, backward (`jax.value_and_grad` of the chunked cross entropy `token_losses`: the "
        "`[B, T, vocab]` logits are never held) and AdamW (optax), parameters and optimizer state donated. "
        "Batch: one sequence per `data` shard. FSDP: the parameters' `embed` axis is split over the whole mesh "
        "(`data` × `sequence`). Peak = arguments + outputs − aliased + temporaries (what one chip holds at once, "
        "per the compiler).", "",
        *defaults(rows),
        "## The best layout per model and length", "", *table(best([*rows, *estimates(rows)])), "",
        *extrapolation(rows),
        "## Every case measured", "", *table(ordered), "",
        *holders(ordered),
        "![max context that fits](long_context.png)", "",
    ])


def defaults(rows: list[dict]) -> list[str]:
    """The cases compiled with libtpu's default options (before `TPU_TRAINING_OPTIONS`)."""
    older = [f"{r['model']} ({r.get('layers') or 'all'} layers, {r['tokens']:,} tokens)" for r in rows
             if "compiler_options" not in r]
    if not older:
        return []
    return [f"Compiled with `recurrax.targets.TPU_TRAINING_OPTIONS` (no windowed einsums), except with libtpu's "
            f"defaults (windowed einsums on, which held every layer's collective-matmul outputs through the "
            f"backward: more memory per layer): {', '.join(older)}.", ""]


def extrapolated(rows: list[dict]) -> list[dict]:
    """Full-depth estimates where a case was compiled at two depths L1 < L2 short of the full
    depth L: each byte count b(L) = b(L1) + (L − L1)(b(L2) − b(L1)) / (L2 − L1) (parameters,
    optimizer state and the blocks' kept inputs grow by the same amount per layer; one layer's
    recompute and the loss do not grow). No estimate where the deeper model's temporaries are
    smaller (each layer keeps at least its block input: the two compiles were scheduled
    differently, and a line through them says nothing)."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        if "failed" not in r and r.get("layers", r.get("full_depth")) != r.get("full_depth"):
            groups.setdefault(key(r)[:-1], []).append(r)
    estimates = []
    for cut in groups.values():
        if len({r["layers"] for r in cut}) < 2:
            continue
        low, high = sorted(cut, key=lambda r: r["layers"])[::len(cut) - 1]
        if high["temp"] < low["temp"]:
            continue  # fewer temporaries at the greater depth: libtpu scheduled the two differently
        scale = (low["full_depth"] - low["layers"]) / (high["layers"] - low["layers"])
        estimate = dict(low, layers=low["full_depth"], seconds=low["seconds"] + high["seconds"],
                        basis=f"{low['layers']} and {high['layers']} layers", count=None,
                        allocations=high.get("allocations", []), allocations_from=high["layers"])
        for field in ("params", "opt", "arguments", "outputs", "aliased", "temp", "peak"):
            estimate[field] = round(low[field] + scale * (high[field] - low[field]))
        estimates.append(estimate)
    return estimates


def holders(rows: list[dict]) -> list[str]:
    """Where a case does not fit: the largest allocations of its buffer assignment."""
    missed = [r for r in [*rows, *estimates(rows)] if not fits(r) and r.get("allocations")]
    if not missed:
        return []
    lines = ["## What holds the memory where a case does not fit", "",
             "The largest allocations of libtpu's buffer assignment for the step (its memory-usage report: bytes, "
             "and the values placed in each in turn):", ""]
    for r in missed:
        values = "; ".join(f"{size / GiB:.2f} GiB ({shapes})" for size, shapes in r["allocations"])
        values += f" (in the {r['allocations_from']}-layer compile)" if "allocations_from" in r else ""
        lines.append(f"- {r['model']} ({r['layers']} layers), {r['slice']} `{r['layout']}`, {r['tokens']:,} tokens: "
                     f"{values}")
    return [*lines, ""]


def plot(rows: list[dict], path: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no plot (rerun with --report-only where it is)", file=sys.stderr)
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(8, 4.5))
    for name in dict.fromkeys(r["model"] for r in rows):
        for slice_name, style in (("v5e-8", "o-"), ("v6e-1", "s--")):
            mine = [r for r in best([*rows, *estimates(rows)]) if r["model"] == name and r["slice"] == slice_name]
            if mine:
                axis.plot([r["tokens"] for r in mine], [r["peak"] / GiB for r in mine], style,
                          label=f"{name}, {slice_name}")
    for hbm, label in ((16, "v5e HBM (16 GiB)"), (32, "v6e HBM (32 GiB)")):
        axis.axhline(hbm, color="k", ls=":", lw=0.8)
        axis.text(LENGTHS[0], hbm * 1.03, label, fontsize=8)
    axis.set(xscale="log", yscale="log", xlabel="tokens per sequence", ylabel="peak GiB per chip (compiler)",
             title="Training step memory per chip: a model fits where its line is under its HBM line")
    axis.set_xticks(LENGTHS, [f"{n // 1024}k" for n in LENGTHS])
    axis.set_xticks([], minor=True)
    axis.set_yticks([2, 4, 8, 16, 32, 64], ["2", "4", "8", "16", "32", "64"])
    axis.set_yticks([], minor=True)
    axis.legend(fontsize=8)
    axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
