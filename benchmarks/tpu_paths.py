"""Both operations on a TPU, every path that can run each call, beside the chip's roofline.

    python benchmarks/tpu_paths.py --out benchmarks/results          # on a TPU VM (`tpu.sh` runs it)
    python benchmarks/tpu_paths.py --smoke --out /tmp/t               # anywhere: tiny shapes

For each row (an operation, its gates, a shape, a dtype) this times, forward and forward+backward
(`jax.value_and_grad` of ⟨output, d_output⟩ + ⟨final_state, d_final⟩ with respect to every
floating input), the token arrays held [B, T, heads · D] as a model's projections give them
(`projected`): the Pallas TPU kernel (`pallas_tpu`, forced by name, or the reason it refuses
the call) and the XLA chunk algorithm (`chunk`), each at the precision a call gets by default
(float32 inputs: HIGHEST; bfloat16: the chip's one-pass product). It records what dispatch
picks for the call (`kernel_registry.select`) and says which path was measured faster.

Roofline, per row (v5e: 197 TFLOP/s bf16, 819 GB/s HBM; other chips: `--peak-tflops`, `--hbm-gbs`):
- HBM floor: every input, the output and the final state cross HBM once (forward); forward+backward
  adds the inputs and the output cotangent read again and one gradient per input written.
- MXU floor: the chunk form's matmul FLOPs at C = 64 over the bf16 peak (`recurrent`: forward
  4·K·V + 2·C·(K + V) per token and head, backward 8·K·V + 2·C·(3·K + 2·V); the delta rule: forward
  6·K·V + 2·C·(2·K + V) + C²·K/3, backward twice that).
- `% roof` is max(HBM floor, MXU floor) over the measured time.

Every row's result also goes to `tpu.json`; `tpu.md` is rewritten after every row, so a
run stopped by its time budget keeps what it measured. Times: one call's share of calls dispatched
back to back (`_timing.back_to_back`: what a training loop sees, the host dispatching ahead of
the chip), and beside it the median of `--repeats` calls each waited for (`_timing.timed`: a
host round trip of about 0.5 ms on a v5e VM included).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import back_to_back, timed  # noqa: E402

import recurrax  # noqa: E402

PATHS = ("pallas_tpu", "chunk")
C = 64


def rows(smoke: bool) -> list[dict]:
    """(operation, gate, B, T, H (value heads), Hqk, K, V, dtype) of every timed row."""
    if smoke:
        return [dict(op="recurrent", gate="gk", B=1, T=256, H=2, Hqk=2, K=64, V=64, dtype="bfloat16"),
                dict(op="delta_rule", gate="g", B=1, T=256, H=2, Hqk=1, K=128, V=128, dtype="float32")]
    recurrent = lambda gate, T, dtype="bfloat16": dict(op="recurrent", gate=gate, B=4, T=T, H=16, Hqk=16,  # noqa: E731
                                                       K=64, V=64, dtype=dtype)
    delta = lambda gate, T, dtype="bfloat16": dict(op="delta_rule", gate=gate, B=1, T=T, H=32, Hqk=16,  # noqa: E731
                                                   K=128, V=128, dtype=dtype)
    table = [recurrent(gate, 4096) for gate in ("gk", "g", "g_gamma")] + [delta(gate, 4096) for gate in ("g", "gk")]
    table += [recurrent(gate, 16384) for gate in ("gk", "g")] + [delta(gate, 16384) for gate in ("g", "gk")]
    table += [recurrent(gate, 4096, "float32") for gate in ("gk", "g")]
    table += [delta(gate, 4096, "float32") for gate in ("g", "gk")]
    table += [dict(op="recurrent", gate="gk", B=2, T=8192, H=16, Hqk=16, K=128, V=128, dtype="bfloat16"),
              dict(op="recurrent", gate="g", B=8, T=2048, H=32, Hqk=32, K=64, V=64, dtype="bfloat16")]
    return table


def label(row: dict) -> str:
    kind = {"recurrent": "GLA", "delta_rule": "GDN" if row["gate"] == "g" else "KDA"}[row["op"]]
    heads = f"H{row['H']}" if row["H"] == row["Hqk"] else f"Hv{row['H']} Hqk{row['Hqk']}"
    shape = f"B{row['B']} T{row['T']} {heads} K{row['K']} V{row['V']}"
    return f"{row['op']} `{row['gate']}` ({kind}), {shape}, {row['dtype']}"


def make_arrays(row: dict, seed: int = 0) -> tuple[dict, dict]:
    """(inputs, cotangents): q, k, v in the row's dtype, gates and β in float32."""
    rng = np.random.default_rng(seed)
    B, T, H, Hqk, K, V = (row[n] for n in ("B", "T", "H", "Hqk", "K", "V"))
    dtype = jnp.dtype(row["dtype"])
    normal = lambda *s: rng.standard_normal(s, np.float32)  # noqa: E731
    log_sigmoid = lambda x: -np.logaddexp(0, -x)  # noqa: E731
    inputs = {"query": jnp.asarray(normal(B, T, Hqk, K), dtype), "key": jnp.asarray(normal(B, T, Hqk, K), dtype),
              "value": jnp.asarray(normal(B, T, H, V), dtype)}
    if row["op"] == "delta_rule":
        inputs["beta"] = jnp.asarray(1 / (1 + np.exp(-normal(B, T, H))))
    if row["gate"] == "g":
        inputs["g"] = jnp.asarray(log_sigmoid(normal(B, T, H)) / 16)
    elif row["gate"] == "gk":
        inputs["gk"] = jnp.asarray(log_sigmoid(normal(B, T, H, K)) / 16)
    else:
        inputs["g_gamma"] = jnp.asarray(-np.exp(-rng.uniform(2, 6, H)), jnp.float32)
    cotangents = {"d_output": jnp.asarray(normal(B, T, H, V)), "d_final": jnp.asarray(normal(B, H, K, V))}
    return inputs, cotangents


TOKEN_ARRAYS = ("query", "key", "value", "gk")


def projected(inputs: dict, cotangents: dict):
    """(inputs, cotangents, wrap) with the token arrays held as a model's projections give them,
    [B, T, heads · D]; `wrap(call)` reshapes them to [B, T, heads, D] inside the program and hands
    the output back as [B, T, H · V] (as a model's output projection reads it). On a TPU an array
    held as [B, T, H, 64] is tiled over (H, D), so a path that reads [B, T, H · D] pays a
    relayout copy of it that a model does not."""
    shapes = {name: x.shape for name, x in inputs.items() if name in TOKEN_ARRAYS}
    merged = lambda x: x.reshape(*x.shape[:2], -1)  # noqa: E731

    def wrap(call):
        def run(kw):
            output, final = call({n: (x.reshape(shapes[n]) if n in shapes else x) for n, x in kw.items()})
            return merged(output), final

        return run

    flat = {name: (merged(x) if name in shapes else x) for name, x in inputs.items()}
    return flat, {**cotangents, "d_output": merged(cotangents["d_output"])}, wrap


def call_of(row: dict, implementation: str | None):
    if row["op"] == "recurrent":
        return lambda kw: recurrax.recurrent(**kw, implementation=implementation)
    return lambda kw: recurrax.delta_rule(**kw, qk_l2norm=True, implementation=implementation)


def programs(call):
    def loss(inputs, d_output, d_final):
        output, final = call(inputs)
        return jnp.sum(output.astype(jnp.float32) * d_output) + jnp.sum(final * d_final)

    differentiable = lambda inputs: {n: x for n, x in inputs.items() if n != "g_gamma"}  # noqa: E731
    forward = jax.jit(call)
    gradient = jax.jit(lambda inputs, cot: jax.value_and_grad(
        lambda diff: loss({**inputs, **diff}, cot["d_output"], cot["d_final"]))(differentiable(inputs)))
    return forward, gradient


def floors(row: dict, inputs: dict, chip: dict) -> dict:
    """Seconds: the HBM and MXU floors of forward and forward+backward."""
    B, T, H, K, V = (row[n] for n in ("B", "T", "H", "K", "V"))
    in_bytes = sum(x.nbytes for x in inputs.values())
    out_bytes = B * T * H * V * jnp.dtype(row["dtype"]).itemsize + B * H * K * V * 4
    hbm_fwd = (in_bytes + out_bytes) / (chip["hbm_gbs"] * 1e9)
    hbm_both = (3 * in_bytes + 2 * out_bytes) / (chip["hbm_gbs"] * 1e9)
    if row["op"] == "recurrent":
        fwd, bwd = 4 * K * V + 2 * C * (K + V), 8 * K * V + 2 * C * (3 * K + 2 * V)
    else:
        fwd = 6 * K * V + 2 * C * (2 * K + V) + C * C * K / 3
        bwd = 2 * fwd
    tokens_heads = B * T * H
    peak = chip["peak_tflops"] * 1e12
    return {"hbm forward": hbm_fwd, "hbm fwd+bwd": hbm_both,
            "mxu forward": tokens_heads * fwd / peak, "mxu fwd+bwd": tokens_heads * (fwd + bwd) / peak}


def measure(row: dict, repeats: int, chip: dict) -> dict:
    inputs, cotangents = make_arrays(row)
    registry = recurrax.kernel_registry if row["op"] == "recurrent" else recurrax.delta.kernel_registry
    extra = {} if row["op"] == "recurrent" else {"qk_l2norm": True}
    result = {**row, "label": label(row), "floors": floors(row, inputs, chip),
              "dispatch": registry.select(**inputs, **extra).name, "paths": {}}
    for name in PATHS:
        try:
            registry.select(**inputs, **extra, implementation=name)
        except ValueError as refusal:
            result["paths"][name] = {"refused": str(refusal).splitlines()[0][:160]}
            continue
        flat, flat_cotangents, wrap = projected(inputs, cotangents)
        forward, gradient = programs(wrap(call_of(row, name)))
        try:
            result["paths"][name] = {
                "forward": back_to_back(lambda: forward(flat)),
                "fwd+bwd": back_to_back(lambda: gradient(flat, flat_cotangents), calls=10),
                "forward synced": statistics.median(timed(lambda: forward(flat), repeats)),
                "fwd+bwd synced": statistics.median(timed(lambda: gradient(flat, flat_cotangents), repeats)),
            }
        except Exception as error:  # noqa: BLE001  (a path that fails is a row saying why)
            result["paths"][name] = {"failed": f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"}
    return result


def faster(result: dict, direction: str) -> str | None:
    timed_paths = {n: p[direction] for n, p in result["paths"].items() if direction in p}
    return min(timed_paths, key=timed_paths.get) if timed_paths else None


def report(results: list[dict], chip: dict) -> str:
    device = jax.devices()[0]
    lines = [f"# Both operations on {device.device_kind}", "",
             f"JAX {jax.__version__}; roofline {chip['peak_tflops']:g} TFLOP/s, {chip['hbm_gbs']:g} GB/s. "
             "Written by `benchmarks/tpu_paths.py` (its docstring defines every column); token arrays "
             "held [B, T, heads·D] as a model projects them. Times are "
             "in ms, forward / forward+backward: calls back to back, and each waited for (`synced`); `% roof` is "
             "the roofline floor over the back-to-back time.", "",
             "| row | path | forward ms | fwd+bwd ms | synced fwd / fwd+bwd | % roof fwd / fwd+bwd | dispatch picks "
             "| faster fwd / fwd+bwd |",
             "|---|---|---:|---:|---:|---:|---|---|"]
    for result in results:
        roof_fwd = max(result["floors"]["hbm forward"], result["floors"]["mxu forward"])
        roof_both = max(result["floors"]["hbm fwd+bwd"], result["floors"]["mxu fwd+bwd"])
        for name, path in result["paths"].items():
            if "forward" in path:
                cells = (f"{1e3 * path['forward']:.2f}", f"{1e3 * path['fwd+bwd']:.2f}",
                         f"{1e3 * path['forward synced']:.2f} / {1e3 * path['fwd+bwd synced']:.2f}",
                         f"{100 * roof_fwd / path['forward']:.1f}% / {100 * roof_both / path['fwd+bwd']:.1f}%")
            else:
                cells = (path.get("refused", path.get("failed", "")), "", "", "")
            lines.append(f"| {result['label']} | `{name}` | {' | '.join(cells)} | `{result['dispatch']}` "
                         f"| `{faster(result, 'forward')}` / `{faster(result, 'fwd+bwd')}` |")
    lines += ["", "Floors (ms), HBM / MXU, forward and forward+backward:", ""]
    for result in results:
        f = {k: 1e3 * v for k, v in result["floors"].items()}
        lines.append(f"- {result['label']}: {f['hbm forward']:.3f} / {f['mxu forward']:.3f}; "
                     f"{f['hbm fwd+bwd']:.3f} / {f['mxu fwd+bwd']:.3f}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="benchmarks/results", help="folder for tpu.md, tpu.json and tpu.png")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--budget", type=float, default=360, help="seconds; rows after it are skipped")
    parser.add_argument("--peak-tflops", type=float, default=197.0)
    parser.add_argument("--hbm-gbs", type=float, default=819.0)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (any machine)")
    args = parser.parse_args(argv)
    chip = {"peak_tflops": args.peak_tflops, "hbm_gbs": args.hbm_gbs}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start, results = time.perf_counter(), []
    for row in rows(args.smoke):
        if time.perf_counter() - start > args.budget:
            print(f"tpu_paths: budget spent, skipping {label(row)}", file=sys.stderr)
            continue
        results.append(measure(row, args.repeats, chip))
        (out / "tpu.md").write_text(report(results, chip))
        (out / "tpu.json").write_text(json.dumps(results, indent=1))
        print(f"tpu_paths: {label(row)} done at {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    plot(results, out / "tpu.png")
    print(report(results, chip))
    return 0


def plot(results: list[dict], path: Path) -> None:
    """Each row's fraction of its roofline, forward+backward, per path (skipped without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("tpu_paths: no matplotlib, no PNG", file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(10, 0.45 * len(results) + 1.5))
    for offset, name in enumerate(PATHS):
        fractions = []
        for result in results:
            roof = max(result["floors"]["hbm fwd+bwd"], result["floors"]["mxu fwd+bwd"])
            timing = result["paths"].get(name, {})
            fractions.append(100 * roof / timing["fwd+bwd"] if "fwd+bwd" in timing else 0)
        ax.barh(np.arange(len(results)) + 0.4 * offset, fractions, height=0.4, label=name)
    ax.set_yticks(np.arange(len(results)) + 0.2, [r["label"].replace("`", "") for r in results], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("% of roofline, forward+backward (higher is better)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
