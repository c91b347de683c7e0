"""A/B of the operation against another revision: time and XLA's temp bytes, side by side.

    python benchmarks/ab.py --against REV [--rounds 3] [--repeats 5] [--out FILE.md] [--quick]

Extracts `src/` of REV (`git archive`, nothing checked out) into a temporary folder and runs
the same measurements on it and on this working tree, each in a child process of its own
(`PYTHONPATH` pointing at one `src/`), alternating A, B, A, B … so that drift in the
machine's load falls on both. Only `recurrax.recurrent` is called, so any revision with it works.

Measured, float32, the default implementation of each side (`chunk` on a CPU):
- time: median of `--repeats` runs of `jit(value_and_grad)` of <o, do> + <final, dfinal>
  (fwd+bwd) and of `jit(recurrent)` (fwd), at B = 2, T = 2048, H = 8, K = V = 64;
- memory: `memory_analysis().temp_size_in_bytes` of the compiled fwd+bwd at B = 1,
  T = 16,384, H = 4, K = V = 64 (deterministic for a given JAX: measured once per side);
per gate kind: `g` per head, `gk` per key channel, `none`, `gk+gv`; and, not in the default
set, `short_conv`: `recurrax.nn.ShortConvolution` (4 taps, SiLU) over the same B and T with
C = H·(2K + V) channels, a layer's q, k, v convolution (fwd+bwd: the gradients of <y, dy> for
the input and kernel; it needs flax), `shared_qk`: Mamba-2's layout (one query/key head shared
by the H value heads, `g` per head) on one device, `shared_qk_parallel`: the same through
`recurrax.parallel.recurrent` with the tokens split over 2 host CPU devices (`sequence` axis),
and `decode`: a Qwen3.5-0.8B-shaped `recurrax.nn.pretrained.CausalLM` cut to two layers (one
Gated DeltaNet, one attention; its 248,320-token tied head kept), random weights: its greedy
decode step (the model's step, the cache donated, and `jnp.argmax`) at batch 1 and 8, and
`generate` of 16 tokens for 8 prompts of 16, greedy and sampled (temperature 1, top-p 0.9),
each call whole (prefill, steps, token choice). `--quick` shrinks the shapes (a smoke run of
the tool itself, not a measurement).

The report (markdown, printed and written to `--out`) gives each side's median over the
rounds of the per-round medians, the ratio this tree / REV (below 1: this tree is faster or
smaller), every round's figures, and the load average before and after. Run it on a quiet
machine and before closing any change to `recurrax/recurrence/_chunk/` (the issue-31 rule).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

GATES = ("g", "gk", "none", "gk+gv")
WORKLOADS = (*GATES, "short_conv", "shared_qk", "shared_qk_parallel", "decode")
HOST_DEVICES = {"shared_qk_parallel": 2}
"""Workloads run on a mesh of host CPU devices: how many (XLA_FLAGS of the child)."""
TIME_SHAPE = dict(B=2, T=2048, H=8, K=64, V=64)
MEMORY_SHAPE = dict(B=1, T=16384, H=4, K=64, V=64)
QUICK_SHAPE = dict(B=1, T=256, H=2, K=16, V=16)
REPOSITORY = Path(__file__).resolve().parent.parent
DECODE_MODEL = dict(
    model_type="qwen3_5_text", hidden_size=1024, intermediate_size=3584, num_attention_heads=8,
    num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128,
    linear_value_head_dim=128, linear_conv_kernel_dim=4, vocab_size=248320, tie_word_embeddings=True,
    rms_norm_eps=1e-6, hidden_act="silu", max_position_embeddings=4096, num_hidden_layers=2,
    layer_types=["linear_attention", "full_attention"],
    rope_parameters=dict(rope_type="default", rope_theta=10_000_000.0, partial_rotary_factor=0.25))
"""`decode`'s model: Qwen3.5-0.8B's text layer shapes and vocabulary (as `qwen3_5.py`), two layers."""
QUICK_DECODE_MODEL = {**DECODE_MODEL, "hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4,
                      "head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
                      "linear_key_head_dim": 16, "linear_value_head_dim": 16, "vocab_size": 4096}
METRICS = {"fwd_ms": "fwd (ms)", "fwd_bwd_ms": "fwd+bwd (ms)", "temp_mib": "temp (MiB)",
           "step_b1_ms": "decode step, batch 1 (ms)", "step_b8_ms": "decode step, batch 8 (ms)",
           "generate_greedy_ms": "generate 8 × 16, greedy (ms)",
           "generate_sampled_ms": "generate 8 × 16, top-p 0.9 (ms)"}


# ----------------------------------------------------------------------------- the child


def _inputs(gate: str, B: int, T: int, H: int, K: int, V: int):
    import jax
    import jax.numpy as jnp

    keys = jax.random.split(jax.random.key(0), 7)
    q, k = (jax.random.normal(keys[i], (B, T, H, K), jnp.float32) for i in (0, 1))
    v = jax.random.normal(keys[2], (B, T, H, V), jnp.float32)
    decay = lambda key, shape: jax.nn.log_sigmoid(jax.random.normal(key, shape)) / 16  # noqa: E731
    gates = {"none": {}, "g": {"g": decay(keys[3], (B, T, H))}, "gk": {"gk": decay(keys[4], (B, T, H, K))},
             "gk+gv": {"gk": decay(keys[4], (B, T, H, K)), "gv": decay(keys[5], (B, T, H, V))}}[gate]
    d_output = jax.random.normal(keys[6], (B, T, H, V), jnp.float32)
    d_final = jnp.ones((B, H, K, V), jnp.float32)
    return (q, k, v, gates), (d_output, d_final)


def _programs(operation=None):
    import jax
    import jax.numpy as jnp

    import recurrax

    operation = operation or recurrax.recurrent

    def loss(q, k, v, gates, d_output, d_final):
        output, final = operation(q, k, v, **gates)
        return jnp.sum(output * d_output) + jnp.sum(final * d_final)

    forward = jax.jit(lambda q, k, v, gates: operation(q, k, v, **gates))
    return forward, jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))


def _shared_inputs(gate: str, B: int, T: int, H: int, K: int, V: int):
    (q, k, v, gates), cotangents = _inputs("g", B, T, H, K, V)
    return (q[:, :, :1], k[:, :, :1], v, gates), cotangents


def _shared_programs():
    import jax
    import numpy as np
    from jax.sharding import Mesh

    from recurrax import parallel

    mesh = Mesh(np.array(jax.devices()[:HOST_DEVICES["shared_qk_parallel"]]), ("sequence",))
    return _programs(lambda q, k, v, **gates: parallel.recurrent(q, k, v, **gates, mesh=mesh, sequence_axis="sequence"))


def _median_seconds(fn, args, repeats: int) -> float:
    import jax

    jax.block_until_ready(fn(*args))  # compile and warm up
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def _conv_inputs(gate: str, B: int, T: int, H: int, K: int, V: int):
    import jax
    import jax.numpy as jnp

    keys = jax.random.split(jax.random.key(0), 3)
    C = H * (2 * K + V)
    x, d_output = (jax.random.normal(key, (B, T, C), jnp.float32) for key in keys[:2])
    return (x, jax.random.normal(keys[2], (4, C), jnp.float32) / 2), (d_output,)


def _conv_programs():
    import jax
    import jax.numpy as jnp
    from flax import nnx

    import recurrax.nn as rnn

    def convolution(x, kernel):
        layer = rnn.ShortConvolution(x.shape[-1], kernel.shape[0], rngs=nnx.Rngs(0))
        layer.kernel[...] = kernel  # the initialiser's draw is dead code under jit
        return layer(x)[0]

    def loss(x, kernel, d_output):
        return jnp.sum(convolution(x, kernel) * d_output)

    return jax.jit(convolution), jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


def _decode_child(repeats: int, quick: bool) -> dict:
    import functools

    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    try:
        from recurrax.generation import generate
    except ImportError:  # a revision from before recurrax.generation: the name's old path
        from recurrax.nn.pretrained import generate
    from recurrax.nn.pretrained import CausalLM

    model = CausalLM(QUICK_DECODE_MODEL if quick else DECODE_MODEL, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)

    @functools.partial(jax.jit, donate_argnums=(2,))
    def step(state, token, cache):
        logits, cache = nnx.merge(graphdef, state)(token, cache)
        return jnp.argmax(logits[:, -1], -1)[:, None].astype(jnp.int32), cache

    result = {}
    for batch in (1, 8):
        held = [jnp.zeros((batch, 1), jnp.int32), model.init_cache(batch, 64)]

        def one():
            held[:] = step(state, *held)
            return held[0]

        result[f"step_b{batch}_ms"] = 1e3 * _median_seconds(one, (), repeats)
    prompts = np.random.default_rng(0).integers(0, model.vocab_size, (8, 16)).tolist()
    for name, options in (("greedy", {}), ("sampled", dict(temperature=1.0, top_p=0.9))):
        call = lambda: generate(model, prompts, 16, stop_tokens=[], num_slots=8, **options)  # noqa: E731
        result[f"generate_{name}_ms"] = 1e3 * _median_seconds(call, (), repeats)
    return result


def child(gate: str, repeats: int, quick: bool) -> dict:
    """One side's measurements of one workload (run in a child process)."""
    if gate == "decode":
        return _decode_child(repeats, quick)
    programs, inputs = {"short_conv": (_conv_programs, _conv_inputs),
                        "shared_qk": (_programs, _shared_inputs),
                        "shared_qk_parallel": (_shared_programs, _shared_inputs)}.get(gate, (_programs, _inputs))
    forward, gradient = programs()
    arrays, cotangents = inputs(gate, **(QUICK_SHAPE if quick else TIME_SHAPE))
    result = {"fwd_ms": 1e3 * _median_seconds(forward, arrays, repeats),
              "fwd_bwd_ms": 1e3 * _median_seconds(gradient, (*arrays, *cotangents), repeats)}
    arrays, cotangents = inputs(gate, **(QUICK_SHAPE if quick else MEMORY_SHAPE))
    analysis = gradient.lower(*arrays, *cotangents).compile().memory_analysis()
    result["temp_mib"] = analysis.temp_size_in_bytes / 2**20
    return result


# ----------------------------------------------------------------------------- the parent


def _extract(revision: str, into: Path) -> Path:
    """`src/` of `revision` under `into`; returns that `src`."""
    archive = subprocess.run(["git", "-C", str(REPOSITORY), "archive", "--format=tar", revision, "src"],
                             check=True, capture_output=True).stdout
    path = into / "archive.tar"
    path.write_bytes(archive)
    with tarfile.open(path) as tar:
        tar.extractall(into, filter="data")
    return into / "src"


def _run_side(source: Path, gate: str, repeats: int, quick: bool) -> dict:
    environment = dict(os.environ, PYTHONPATH=str(source), JAX_PLATFORMS="cpu")
    if gate in HOST_DEVICES:
        environment["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={HOST_DEVICES[gate]}"
    command = [sys.executable, str(Path(__file__).resolve()), "--child", gate, "--repeats", str(repeats)]
    command += ["--quick"] if quick else []
    done = subprocess.run(command, env=environment, check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def _summary(rounds: list[dict], gates, revision: str, label: str) -> str:
    lines = [f"| gate | metric | {revision} | {label} | {label} / {revision} |", "|---|---|---:|---:|---:|"]
    for gate in gates:
        for metric in rounds[0][gate]["base"]:
            name = METRICS[metric]
            base = statistics.median(r[gate]["base"][metric] for r in rounds)
            new = statistics.median(r[gate]["new"][metric] for r in rounds)
            lines.append(f"| {gate} | {name} | {base:.1f} | {new:.1f} | {new / base:.3f} |")
    return "\n".join(lines)


def _rounds_table(rounds: list[dict], gates) -> str:
    lines = ["| round | gate | metric | base → new |", "|---:|---|---|---|"]
    for index, measured in enumerate(rounds, 1):
        for gate in gates:
            base, new = measured[gate]["base"], measured[gate]["new"]
            lines += [f"| {index} | {gate} | {METRICS[metric]} | {base[metric]:.1f} → {new[metric]:.1f} |"
                      for metric in base if metric != "temp_mib"]
    return "\n".join(lines)


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--against", help="the revision to compare with (a commit, tag or branch)")
    parser.add_argument("--gates", default=",".join(GATES), help="comma-separated gate kinds (default: %(default)s)")
    parser.add_argument("--rounds", type=_positive, default=3, help="alternating rounds (default: %(default)s)")
    parser.add_argument("--repeats", type=_positive, default=5, help="timed runs per measurement (default: %(default)s)")
    parser.add_argument("--out", type=Path, help="also write the report here (markdown)")
    parser.add_argument("--quick", action="store_true", help="tiny shapes: a smoke run of the tool, not a measurement")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.repeats, args.quick)))
        return 0
    if not args.against:
        parser.error("--against REVISION is required")
    gates = tuple(args.gates.split(","))
    unknown = sorted(set(gates) - set(WORKLOADS))
    if unknown:
        parser.error(f"--gates: unknown kinds {unknown}; choose from {list(WORKLOADS)}")
    label = "this tree"
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as scratch:
        base_source = _extract(args.against, Path(scratch))
        sides = {"base": base_source, "new": REPOSITORY / "src"}
        rounds = []
        for index in range(args.rounds):
            order = ("base", "new") if index % 2 == 0 else ("new", "base")
            measured = {gate: {side: _run_side(sides[side], gate, args.repeats, args.quick) for side in order}
                        for gate in gates}
            rounds.append(measured)
            print(f"round {index + 1}/{args.rounds} done", file=sys.stderr)
    report = "\n\n".join([
        f"# A/B: {label} against {args.against}",
        f"{args.rounds} alternating rounds, median of {args.repeats} runs each; load average "
        f"{load_before:.2f} before, {os.getloadavg()[0]:.2f} after. Time at {QUICK_SHAPE if args.quick else TIME_SHAPE}, "
        f"temp bytes of fwd+bwd at {QUICK_SHAPE if args.quick else MEMORY_SHAPE}; Python {sys.version.split()[0]}.",
        _summary(rounds, gates, args.against, label),
        "Every round:",
        _rounds_table(rounds, gates),
    ]) + "\n"
    print(report)
    if args.out:
        args.out.write_text(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
