"""The delta rule on a TPU at Qwen3-Next's layer shape: recurrax's Pallas TPU kernels, XLA `chunk`
and ejKernel's Pallas GDN kernel, forward and forward+backward (issue 28, item 5).

    python benchmarks/delta_rule_tpu.py --out benchmarks/results     # on a TPU VM (`tpu.sh` runs it)
    python benchmarks/delta_rule_tpu.py --smoke --out /tmp/d          # anywhere: tiny shape; what
                                                                      # cannot run here says why

Shape: B = 1, T ∈ {4096, 16384}, 32 value heads reading 16 query/key heads, K = V = 128,
bfloat16, Gated DeltaNet (a per-head log decay g = log_sigmoid(normal) / 16, β = sigmoid(normal),
`qk_l2norm=True`, scale K^−0.5). Inputs q, k, v standard normal; fwd+bwd is
`jax.value_and_grad` of <output, d_output> + <final_state, d_final> (fixed random cotangents)
with respect to q, k, v, β and g.

- **recurrax `pallas_tpu`**: what dispatch picks on the TPU for the call (the row names it, and
  a refusal's reason when it is not `pallas_tpu`).
- **recurrax `chunk`**: the XLA chunk algorithm, forced by name.
- **ejKernel Pallas GDN** (`ejkernel.kernels._pallas.tpu.gated_delta_rule`, its defaults:
  chunk 256), when `ejkernel` is importable; it takes as many query/key heads as value heads,
  so the 16 query/key heads are repeated to 32 inside its timed function.

Each program is jitted, compiled and run once, then timed `--repeats` times (min and median).
Every side's output, final state and gradients are compared with `chunk`'s on the same
inputs (max absolute difference relative to the largest entry of `chunk`'s). Writes
`delta_rule_tpu.md` and `delta_rule_tpu.json` to `--out`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import timed  # noqa: E402

import recurrax  # noqa: E402

SHAPE = dict(B=1, H=32, Hqk=16, K=128, V=128)
LENGTHS = (4096, 16384)
SMOKE = dict(B=1, H=4, Hqk=2, K=128, V=128)
SMOKE_LENGTHS = (256,)


def make_arrays(B: int, T: int, H: int, Hqk: int, K: int, V: int, seed: int = 0) -> dict:
    """bf16 q, k, v; float32 β and g; float32 cotangents of the output and final state."""
    rng = np.random.default_rng(seed)
    normal = lambda *shape: rng.standard_normal(shape, np.float32)  # noqa: E731
    bf16 = lambda x: jnp.asarray(x, jnp.bfloat16)  # noqa: E731
    return {
        "query": bf16(normal(B, T, Hqk, K)), "key": bf16(normal(B, T, Hqk, K)), "value": bf16(normal(B, T, H, V)),
        "beta": jnp.asarray(1 / (1 + np.exp(-normal(B, T, H)))),
        "g": jnp.asarray(-np.logaddexp(0, -normal(B, T, H)) / 16),
        "d_output": jnp.asarray(normal(B, T, H, V)), "d_final": jnp.asarray(normal(B, H, K, V)),
    }


def recurrax_call(implementation: str | None):
    def call(query, key, value, beta, g):
        return recurrax.delta_rule(query, key, value, beta, g=g, qk_l2norm=True, implementation=implementation)

    return call


def ejkernel_call():
    """ejKernel's Pallas TPU GDN kernel (query/key heads repeated to the value heads), or the
    reason it cannot run here."""
    try:
        from ejkernel.kernels._pallas.tpu.gated_delta_rule import gated_delta_rule
    except Exception as error:  # noqa: BLE001  (any import failure is a reason to report)
        return f"not importable: {type(error).__name__}: {error}"

    def call(query, key, value, beta, g):
        groups = value.shape[2] // query.shape[2]
        query, key = (jnp.repeat(x, groups, axis=2) for x in (query, key))
        return gated_delta_rule(query, key, value, beta, g, use_qk_l2norm=True)

    return call


def programs(call):
    """(forward, fwd+bwd) jitted; both take the arrays dict."""
    names = ("query", "key", "value", "beta", "g")

    def loss(diff, d_output, d_final):
        output, final = call(*(diff[n] for n in names))
        return jnp.sum(output.astype(jnp.float32) * d_output) + jnp.sum(final.astype(jnp.float32) * d_final)

    forward = jax.jit(lambda a: call(*(a[n] for n in names)))
    gradient = jax.jit(lambda a: jax.value_and_grad(loss)({n: a[n] for n in names}, a["d_output"], a["d_final"]))
    return forward, gradient


def relative_difference(results, baseline) -> float:
    """Max over leaves of max |x − y| / max |y|."""
    worst = 0.0
    for x, y in zip(jax.tree.leaves(results), jax.tree.leaves(baseline)):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        worst = max(worst, float(np.max(np.abs(x - y)) / max(np.max(np.abs(y)), 1e-30)))
    return worst


def measure(name: str, call, arrays: dict, repeats: int, baseline: dict | None) -> dict:
    """Times (seconds) of forward and fwd+bwd, and the difference from the baseline's results."""
    row = {"name": name}
    if isinstance(call, str):
        return {**row, "skipped": call}
    forward, gradient = programs(call)
    try:
        for label, program in (("forward", forward), ("fwd+bwd", gradient)):
            row[label] = timed(lambda: program(arrays), repeats)
            row[f"{label} results"] = jax.block_until_ready(program(arrays))
    except Exception as error:  # noqa: BLE001  (a side that fails is a row saying why)
        return {**row, "skipped": f"failed: {type(error).__name__}: {str(error).splitlines()[0][:200]}"}
    if baseline is not None:
        row["difference"] = max(relative_difference(row[f"{label} results"], baseline[f"{label} results"])
                                for label in ("forward", "fwd+bwd"))
    return row


def table(T: int, rows: list[dict]) -> list[str]:
    lines = [f"### T = {T:,}", "", "| implementation | forward ms (min / median) | fwd+bwd ms (min / median) "
             "| difference from chunk |", "|---|---|---|---|"]
    for row in rows:
        if "skipped" in row:
            lines.append(f"| {row['name']} | {row['skipped']} | | |")
            continue
        times = [f"{1e3 * min(row[k]):.2f} / {1e3 * float(np.median(row[k])):.2f}" for k in ("forward", "fwd+bwd")]
        difference = f"{row['difference']:.1e}" if "difference" in row else "(baseline)"
        lines.append(f"| {row['name']} | {times[0]} | {times[1]} | {difference} |")
    return lines + [""]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="benchmarks/results", help="folder for delta_rule_tpu.md / .json")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--smoke", action="store_true", help="a tiny shape (any machine)")
    args = parser.parse_args(argv)
    shape, lengths = (SMOKE, SMOKE_LENGTHS) if args.smoke else (SHAPE, LENGTHS)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = jax.devices()[0]
    report = [f"# The delta rule on {device.device_kind} ({jax.default_backend()})", "",
              f"GDN, B = {shape['B']}, H = {shape['H']} value / {shape['Hqk']} query-key heads, "
              f"K = V = {shape['K']}, bfloat16, `qk_l2norm`; JAX {jax.__version__}. Written by "
              "`benchmarks/delta_rule_tpu.py` (its docstring says what each row is).", ""]
    results = {}
    for T in lengths:
        arrays = make_arrays(T=T, **shape)
        request = {n: arrays[n] for n in ("query", "key", "value", "beta", "g")}
        picked = recurrax.delta.kernel_registry.select(**request, qk_l2norm=True)
        chunk = measure("recurrax chunk (XLA)", recurrax_call("chunk"), arrays, args.repeats, None)
        sides = [chunk]
        if picked.name == "pallas_tpu":
            sides.append(measure("recurrax pallas_tpu", recurrax_call("pallas_tpu"), arrays, args.repeats, chunk))
        else:
            reason = dict(picked.answers).get("pallas_tpu") or "not picked"
            sides.append({"name": "recurrax pallas_tpu", "skipped": f"dispatch picks {picked.name}: {reason}"})
        ejkernel = ejkernel_call()
        if not isinstance(ejkernel, str) and jax.default_backend() != "tpu":
            ejkernel = "not run: a TPU kernel, and this is not a TPU"
        sides.append(measure("ejKernel Pallas GDN", ejkernel, arrays, args.repeats, chunk))
        report += table(T, sides)
        results[T] = [{k: v for k, v in row.items() if not k.endswith("results")} for row in sides]
        (out / "delta_rule_tpu.md").write_text("\n".join(report))  # rewritten after every length
        (out / "delta_rule_tpu.json").write_text(json.dumps({"device": device.device_kind, "shape": shape,
                                                             "results": results}, indent=1))
        print("\n".join(table(T, sides)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
