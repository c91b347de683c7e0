"""ejKernel's side of `delta_rule.py`: its XLA delta-rule functions on the same inputs.

    EJKERNEL_PYTHON benchmarks/delta_rule_ejkernel.py DIR [--repeats 7] [--max-seconds 30]

Run by `delta_rule.py` (not on its own): reads DIR/spec.json and DIR/inputs_<variant>.npz, writes
DIR/ejKernel.json (versions, samples, temp bytes) and DIR/ejKernel_<variant>.npz (output, final
state, gradients). GDN: `ejkernel.kernels._xla.gated_delta_rule` with its defaults (chunked,
chunk 256) and `use_qk_l2norm=True`; KDA: `kernel_delta_attention`, tried with the per-channel
decay (a variant it rejects is reported as not run, with its error). Each program is jitted,
compiled and run once before timing; fwd+bwd is `jax.value_and_grad` of
<output, d_output> + <final, d_final> with respect to q, k, v, β and the decay. Also XLA's temp
bytes of the compiled fwd+bwd at spec.json's `memory_shape`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from importlib.metadata import version
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

NAMES = ("query", "key", "value", "beta", "decay")


def functions() -> dict:
    """Variant -> (qualified name, function)."""
    from ejkernel.kernels._xla import gated_delta_rule, kernel_delta_attention

    return {"gdn": ("kernels._xla.gated_delta_rule", gated_delta_rule.gated_delta_rule
                    if hasattr(gated_delta_rule, "gated_delta_rule") else gated_delta_rule),
            "kda": ("kernels._xla.kernel_delta_attention", kernel_delta_attention.kernel_delta_attention
                    if hasattr(kernel_delta_attention, "kernel_delta_attention") else kernel_delta_attention)}


def programs(function):
    def call(q, k, v, beta, decay):
        return function(q, k, v, beta, decay, use_qk_l2norm=True)

    def loss(q, k, v, beta, decay, d_output, d_final):
        output, final = call(q, k, v, beta, decay)
        return jnp.sum(output * d_output) + jnp.sum(final * d_final)

    return jax.jit(call), jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)))


def samples(fn, repeats: int, max_seconds: float) -> list[float]:
    """Seconds of up to `repeats` calls after a warm-up; stops once `max_seconds` are spent."""
    jax.block_until_ready(fn())
    seconds, spent = [], 0.0
    while len(seconds) < repeats and (not seconds or spent < max_seconds):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        seconds.append(time.perf_counter() - start)
        spent += seconds[-1]
    return seconds


def temp_mib(gradient, variant: str, shape: dict) -> float:
    B, T, H, K, V = (shape[n] for n in "BTHKV")
    f32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)  # noqa: E731
    decay = f32(B, T, H) if variant == "gdn" else f32(B, T, H, K)
    specs = (f32(B, T, H, K), f32(B, T, H, K), f32(B, T, H, V), f32(B, T, H), decay, f32(B, T, H, V), f32(B, H, K, V))
    return gradient.lower(*specs).compile().memory_analysis().temp_size_in_bytes / 2**20


def measure(variant: str, function, arrays: dict, args, memory_shape: dict) -> tuple[dict, dict]:
    forward, gradient = programs(function)
    inputs = tuple(jnp.asarray(arrays[n]) for n in NAMES)
    cotangents = (jnp.asarray(arrays["d_output"]), jnp.asarray(arrays["d_final"]))
    try:
        fwd = forward.lower(*inputs).compile()
        fwd_bwd = gradient.lower(*inputs, *cotangents).compile()
    except Exception as error:  # a variant the function does not take (e.g. a per-channel decay)
        first = str(error).strip().splitlines()[0][:200] if str(error).strip() else ""
        return {"not_run": f"rejects this variant's inputs: {type(error).__name__}: {first}"}, {}
    seconds = {"fwd": samples(lambda: fwd(*inputs), args.repeats, args.max_seconds),
               "fwd_bwd": samples(lambda: fwd_bwd(*inputs, *cotangents), args.repeats, args.max_seconds)}
    output, final = fwd(*inputs)
    _, grads = fwd_bwd(*inputs, *cotangents)
    saved = dict(output=np.asarray(output), final=np.asarray(final),
                 **{f"d_{n}": np.asarray(g) for n, g in zip(NAMES, grads)})
    return dict(seconds=seconds, temp_mib=temp_mib(gradient, variant, memory_shape)), saved


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--max-seconds", type=float, default=30.0)
    args = parser.parse_args(argv)
    spec = json.loads((args.directory / "spec.json").read_text())
    available = functions()
    report = dict(versions=dict(ejkernel=version("ejkernel"), jax=jax.__version__), variants={})
    for variant in spec["variants"]:
        name, function = available[variant]
        arrays = dict(np.load(args.directory / f"inputs_{variant}.npz"))
        entry, saved = measure(variant, function, arrays, args, spec["memory_shape"])
        entry["function"] = name
        if saved:
            np.savez(args.directory / f"ejKernel_{variant}.npz", **saved)
        report["variants"][variant] = entry
        print(variant, entry.get("not_run") or {mode: min(s) for mode, s in entry["seconds"].items()}, file=sys.stderr)
    (args.directory / "ejKernel.json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
