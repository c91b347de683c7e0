"""The delta rule (Gated DeltaNet and KDA) against its peers on this CPU, side by side in one run.

    python benchmarks/delta_rule.py --torch-python TORCH_PYTHON --ejkernel-python EJKERNEL_PYTHON
    python benchmarks/delta_rule.py --quick --out /tmp/delta   # tiny shapes, peers optional (a smoke run)

TORCH_PYTHON is an interpreter of an environment with torch (CPU build) and `transformers`
5.25; EJKERNEL_PYTHON one with `ejkernel` 0.0.80.3 (it brings JAX 0.10). A peer whose
interpreter is not given, or is missing, is reported as not run.

Issue 32's targets. Shape B = 2, T = 2048, H = Hqk = 4, K = V = 128, float32, `qk_l2norm=True`,
in two variants: GDN (a per-head log decay `g` [B, T, H]) and KDA (a per-key-channel `gk`
[B, T, H, K]). Inputs: q, k, v standard normal, β = sigmoid(normal), decays
`log_sigmoid(normal) / 16`; the fwd+bwd program is the gradient of
<output, d_output> + <final_state, d_final> (fixed random cotangents) with respect to q, k, v,
β and the decay. Every side reads the same arrays (written to a scratch folder as `.npz`).

- **recurrax**: `recurrax.delta_rule(..., implementation=name)` for every implementation of
  `recurrax.delta.kernel_registry` that runs on this machine's backend, interpreters left out (`reference`, the token loop, only in the first round and
  with one repeat: it is the slow oracle), each jitted, compiled and run once before timing;
  then `--rounds` rounds, each timing every implementation `--repeats` times in a rotated order
  (the machine is shared and noisy: drift falls on all of them). Min and median of all samples.
- **transformers** (`delta_rule_torch.py`, in TORCH_PYTHON, torch with `--torch-threads`):
  `torch_chunk_gated_delta_rule` (qwen3_next) and `chunk_kimi_delta_attention` (kimi_linear),
  their pure-PyTorch chunk loops, backward by autograd. Run while nothing else of this
  benchmark runs (PyTorch's CPU path slows 10–50× on an oversubscribed machine); the load
  average before and after is recorded.
- **ejKernel** (`delta_rule_ejkernel.py`, in EJKERNEL_PYTHON): its XLA `gated_delta_rule`
  (defaults: chunk 256), backward by JAX's autodiff. Its `kernel_delta_attention` takes a
  per-head decay only, so it has no KDA row.

Each peer's output, final state and gradients are compared with recurrax's on the same inputs
(max absolute difference; gradients relative to the largest entry of recurrax's), and every
forward output with a float64 run of recurrax's `reference`.

**Model FLOPs** (the chunk algorithm's, independent of how an implementation tiles: counted
at C = 64 for both variants; per head, per chunk of C tokens; matmuls 2·m·n·k):

    key scores K Kᵀ and query scores Q Kᵀ (C×C, full)   2·(2·C²·K)
    triangular solve (I + M) X = [β V, β K e^A]          C²·(K + V)     (C²/2 multiply-adds per column)
    state read by the corrections and the queries        2·(2·C·K·V)
    intra-chunk output (P ⊙ mask) U                      2·C²·V
    state update (K e^{A_C − A})ᵀ U                      2·C·K·V

so forward FLOPs = B·T·H·(C·(5K + 3V) + 6·K·V) (2.68 GFLOP at the target shape), and fwd+bwd
= 3 × forward (a matmul's backward is two matmuls of the same size; the recomputation inside
the chunks is not counted). MFU = those FLOPs / time / the matmul peak measured in the same
run (the median of a jitted 2048² float32 `jnp.dot`, before and after; the higher is used).

**Memory:** XLA's `temp_size_in_bytes` of the compiled fwd+bwd at B = 1, T = 16,384 (same H, K, V;
per-token states would be 4 GiB), for each recurrax implementation (and ejKernel's, measured
in its own process).

Writes `delta_rule.md` (tables and goals), `delta_rule.json` (every sample) and `delta_rule.png`
(needs matplotlib, the `bench` extra) to `--out` (default benchmarks/results).
"""

from __future__ import annotations

import argparse
import json
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

import recurrax
from recurrax.delta import IMPLEMENTATIONS, kernel_registry
from recurrax.registry import Backend, current_backend
from recurrax.tools.bench.machine import machine_description, matmul_peak

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
SHAPE = dict(B=2, T=2048, H=4, K=128, V=128)
MEMORY_SHAPE = dict(B=1, T=16384, H=4, K=128, V=128)
QUICK_SHAPE = dict(B=1, T=64, H=2, K=16, V=16)
QUICK_MEMORY_SHAPE = dict(B=1, T=256, H=2, K=16, V=16)
MODEL_CHUNK = 64
VARIANTS = {"gdn": "g", "kda": "gk"}
"""Variant -> the name of its decay argument (per head `g`, per key channel `gk`)."""
TITLES = {"gdn": "Gated DeltaNet (per-head g)", "kda": "KDA (per-channel gk)"}
GOALS = (  # (mode, peer, at least this many times faster)
    ("fwd_bwd", "recurrax scan", 10.0), ("fwd_bwd", "transformers", 5.0), ("fwd_bwd", "ejKernel", 5.0),
    ("fwd", "transformers", 2.0), ("fwd", "ejKernel", 4.0),
)
MEMORY_GOAL_MIB = 256
FORWARD_MFU_GOAL = 0.25
PEERS = {"transformers": "delta_rule_torch.py", "ejKernel": "delta_rule_ejkernel.py"}


# ----------------------------------------------------------------------------- inputs and FLOPs


def make_arrays(variant: str, B: int, T: int, H: int, K: int, V: int, seed: int = 0) -> dict[str, np.ndarray]:
    """float32 NumPy inputs and cotangents of one variant (the names every side reads)."""
    rng = np.random.default_rng(seed)
    normal = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    log_sigmoid = lambda x: -np.logaddexp(0.0, -x)  # noqa: E731
    decay_shape = (B, T, H) if variant == "gdn" else (B, T, H, K)
    return dict(
        query=normal(B, T, H, K), key=normal(B, T, H, K), value=normal(B, T, H, V),
        beta=(1 / (1 + np.exp(-normal(B, T, H)))).astype(np.float32),
        decay=(log_sigmoid(normal(*decay_shape)) / 16).astype(np.float32),
        d_output=normal(B, T, H, V), d_final=normal(B, H, K, V),
    )


def forward_flops(B: int, T: int, H: int, K: int, V: int, C: int = MODEL_CHUNK) -> int:
    """The chunk algorithm's forward FLOPs (the table in the module docstring)."""
    return B * T * H * (C * (5 * K + 3 * V) + 6 * K * V)


def mebibytes(n: float) -> float:
    return n / 2**20


# ----------------------------------------------------------------------------- recurrax


def programs(variant: str, implementation: str):
    """(jit forward, jit fwd+bwd) of `recurrax.delta_rule` with `implementation`."""
    decay_name = VARIANTS[variant]

    def call(q, k, v, beta, decay):
        return recurrax.delta_rule(q, k, v, beta, **{decay_name: decay}, qk_l2norm=True,
                                   implementation=implementation)

    def loss(q, k, v, beta, decay, d_output, d_final):
        output, final = call(q, k, v, beta, decay)
        return jnp.sum(output * d_output) + jnp.sum(final * d_final)

    return jax.jit(call), jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)))


def _args(arrays: dict) -> tuple:
    return tuple(jnp.asarray(arrays[n]) for n in ("query", "key", "value", "beta", "decay"))


def _cotangents(arrays: dict) -> tuple:
    return jnp.asarray(arrays["d_output"]), jnp.asarray(arrays["d_final"])


def _seconds(fn, repeats: int) -> list[float]:
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        samples.append(time.perf_counter() - start)
    return samples


class Ours:
    """The compiled programs of every recurrax implementation of one variant, and their samples."""

    def __init__(self, variant: str, arrays: dict, names: list[str]):
        self.variant, self.names = variant, names
        self.args, self.cotangents = _args(arrays), _cotangents(arrays)
        self.compiled, self.samples, self.compile_s, self.results = {}, {}, {}, {}
        for name in names:
            forward, gradient = programs(variant, name)
            start = time.perf_counter()
            fwd = forward.lower(*self.args).compile()
            fwd_bwd = gradient.lower(*self.args, *self.cotangents).compile()
            self.compile_s[name] = time.perf_counter() - start
            self.compiled[name] = (fwd, fwd_bwd)
            output, final = jax.block_until_ready(fwd(*self.args))  # warm-up, kept for the comparisons
            _, grads = jax.block_until_ready(fwd_bwd(*self.args, *self.cotangents))
            self.results[name] = dict(output=np.asarray(output), final=np.asarray(final),
                                      grads=[np.asarray(g) for g in grads])
            self.samples[name] = {"fwd": [], "fwd_bwd": []}

    def round(self, index: int, repeats: int) -> None:
        """One round: every implementation (rotated order), forward then fwd+bwd; `reference`
        only in round 0, once."""
        order = self.names[index % len(self.names):] + self.names[:index % len(self.names)]
        for name in order:
            if name == "reference" and index > 0:
                continue
            count = 1 if name == "reference" else repeats
            fwd, fwd_bwd = self.compiled[name]
            self.samples[name]["fwd"] += _seconds(lambda: fwd(*self.args), count)
            self.samples[name]["fwd_bwd"] += _seconds(lambda: fwd_bwd(*self.args, *self.cotangents), count)


def temp_mib(variant: str, implementation: str, shape: dict) -> float:
    """XLA's temp bytes (MiB) of the compiled fwd+bwd at `shape` (compiled, not run)."""
    _, gradient = programs(variant, implementation)
    arrays = make_arrays(variant, **shape)
    spec = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)  # noqa: E731
    compiled = gradient.lower(*map(spec, _args(arrays)), *map(spec, _cotangents(arrays))).compile()
    return mebibytes(compiled.memory_analysis().temp_size_in_bytes)


def float64_reference(variant: str, arrays: dict) -> dict:
    """Output and final state of recurrax's `reference` in float64 (the ground truth)."""
    with jax.enable_x64(True):
        args = [jnp.asarray(arrays[n], jnp.float64) for n in ("query", "key", "value", "beta", "decay")]
        call = jax.jit(lambda q, k, v, b, d: recurrax.delta_rule(
            q, k, v, b, **{VARIANTS[variant]: d}, qk_l2norm=True, implementation="reference"))
        output, final = call(*args)
        return dict(output=np.asarray(output), final=np.asarray(final))


# ----------------------------------------------------------------------------- peers


def run_peer(peer: str, python: str | None, directory: Path, args) -> dict:
    """Run a peer's script in its own interpreter; its report, or {'not_run': why}."""
    if not python:
        return {"not_run": "no interpreter given (--torch-python / --ejkernel-python)"}
    if not Path(python).exists():
        return {"not_run": f"interpreter {python} not found"}
    command = [python, str(HERE / PEERS[peer]), str(directory), "--repeats", str(args.peer_repeats),
               "--max-seconds", str(args.max_seconds)]
    if peer == "transformers":
        command += ["--threads", str(args.torch_threads)]
    environment = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH="", JAX_PLATFORMS="cpu")
    load_before = os.getloadavg()[0]
    done = subprocess.run(command, env=environment, capture_output=True, text=True)
    if done.returncode:
        return {"not_run": f"failed (exit {done.returncode}): " + done.stderr.strip().splitlines()[-1][:300]
                if done.stderr.strip() else f"failed (exit {done.returncode})"}
    report = json.loads((directory / f"{peer}.json").read_text())
    report["load_before"], report["load_after"] = load_before, os.getloadavg()[0]
    for variant in list(report["variants"]):
        entry = report["variants"][variant]
        if "not_run" not in entry:
            with np.load(directory / f"{peer}_{variant}.npz") as saved:
                entry["arrays"] = {name: saved[name] for name in saved.files}
    return report


# ----------------------------------------------------------------------------- comparison and report


def max_abs(x, y) -> float:
    return float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))))


def grad_difference(grads: list, baseline: list) -> float:
    """Max over inputs of max |grad − baseline| / max |baseline|."""
    return max(max_abs(g, b) / max(float(np.max(np.abs(b))), 1e-30) for g, b in zip(grads, baseline))


def row_stats(samples: dict) -> dict:
    stats = {}
    for mode in ("fwd", "fwd_bwd"):
        values = samples.get(mode) or []
        stats[mode] = dict(min=min(values), median=statistics.median(values), n=len(values)) if values else None
    return stats


def collect_rows(variant: str, ours: Ours, peers: dict, exact: dict, memory: dict) -> list[dict]:
    """One row per implementation: times, comparisons, memory."""
    baseline = ours.results.get("chunk") or next(iter(ours.results.values()))
    rows = []
    for name in ours.names:
        result = ours.results[name]
        rows.append(dict(name=f"recurrax {name}", stats=row_stats(ours.samples[name]), temp_mib=memory.get(name),
                         output_vs_f64=max_abs(result["output"], exact["output"]),
                         output_vs_chunk=max_abs(result["output"], baseline["output"]),
                         grads_vs_chunk=grad_difference(result["grads"], baseline["grads"])))
    for peer, report in peers.items():
        entry = report.get("variants", {}).get(variant) if "not_run" not in report else None
        if entry is None or "not_run" in entry:
            why = report.get("not_run") or (entry or {}).get("not_run", "no result")
            rows.append(dict(name=peer, not_run=why))
            continue
        saved = entry["arrays"]
        grads = [saved[f"d_{n}"] for n in ("query", "key", "value", "beta", "decay")]
        rows.append(dict(name=peer, label=entry.get("function", peer), stats=row_stats(entry["seconds"]),
                         temp_mib=entry.get("temp_mib"),
                         output_vs_f64=max_abs(saved["output"], exact["output"]),
                         output_vs_chunk=max_abs(saved["output"], baseline["output"]),
                         final_vs_chunk=max_abs(saved["final"], baseline["final"]),
                         grads_vs_chunk=grad_difference(grads, baseline["grads"])))
    return rows


def _ms(stat) -> str:
    return "—" if stat is None else f"{stat['min'] * 1e3:,.1f} / {stat['median'] * 1e3:,.1f}"


def _ratio(chunk_stat, other_stat) -> float | None:
    if chunk_stat is None or other_stat is None:
        return None
    return other_stat["median"] / chunk_stat["median"]


def _times(x: float | None) -> str:
    return "—" if x is None else f"{x:.2f}×"


def _percent(x: float | None) -> str:
    return "—" if x is None else f"{x:.1%}"


def variant_table(variant: str, rows: list[dict], flops: int, peak: float) -> list[str]:
    chunk = next((r for r in rows if r["name"] == "recurrax chunk"), None)
    lines = [f"### {TITLES[variant]}", "",
             "| implementation | forward ms (min / median) | fwd+bwd ms (min / median) | chunk's speed-up: forward | "
             "chunk's speed-up: fwd+bwd | MFU forward | MFU fwd+bwd | temp MiB (B=1, T=16,384) | "
             "output max abs Δ vs float64 | output max abs Δ vs chunk | gradients max rel Δ vs chunk |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        if "not_run" in row:
            lines.append(f"| {row['name']} | not run: {row['not_run']} |" + " |" * 9)
            continue
        stats = row["stats"]
        mfu = {mode: None if stats[mode] is None else (flops * (3 if mode == "fwd_bwd" else 1)
                                                         / stats[mode]["median"] / peak) for mode in stats}
        speed = {mode: _ratio(chunk["stats"][mode], stats[mode]) if chunk else None for mode in stats}
        temp = "—" if row.get("temp_mib") is None else f"{row['temp_mib']:,.0f}"
        label = row["name"] if "label" not in row else f"{row['name']} `{row['label']}`"
        lines.append(f"| {label} | {_ms(stats['fwd'])} | {_ms(stats['fwd_bwd'])} | {_times(speed['fwd'])} | "
                     f"{_times(speed['fwd_bwd'])} | {_percent(mfu['fwd'])} | {_percent(mfu['fwd_bwd'])} | {temp} | "
                     f"{row['output_vs_f64']:.1e} | {row['output_vs_chunk']:.1e} | {row['grads_vs_chunk']:.1e} |")
    return lines


def goal_lines(variant: str, rows: list[dict], flops: int, peak: float) -> list[str]:
    by_name = {r["name"]: r for r in rows if "not_run" not in r}
    chunk = by_name.get("recurrax chunk")
    lines = [f"Goals for `chunk` ({TITLES[variant]}; a speed-up is the ratio of medians, judged, and of minima, "
             "in brackets: on a loaded machine the minima say more about the code, the medians about the load):", "",
             "| goal | measured | verdict |", "|---|---:|---|"]
    for mode, peer, least in GOALS:
        other = by_name.get(peer)
        ratio = _ratio(chunk["stats"][mode], other["stats"][mode]) if chunk and other else None
        verdict = "n/a (not run)" if ratio is None else ("pass" if ratio >= least else "FAIL")
        what = "fwd+bwd" if mode == "fwd_bwd" else "forward"
        minima = "" if ratio is None else f" ({other['stats'][mode]['min'] / chunk['stats'][mode]['min']:.2f}×)"
        lines.append(f"| {what} ≥ {least:g}× {peer} | {_times(ratio)}{minima} | {verdict} |")
    if chunk:
        mfu = flops / chunk["stats"]["fwd"]["median"] / peak
        lines.append(f"| forward MFU ≥ {FORWARD_MFU_GOAL:.0%} | {mfu:.1%} | {'pass' if mfu >= FORWARD_MFU_GOAL else 'FAIL'} |")
        temp = chunk.get("temp_mib")
        if temp is not None:
            lines.append(f"| fwd+bwd temp at B=1, T=16,384 ≤ {MEMORY_GOAL_MIB} MiB | {temp:,.0f} MiB | "
                         f"{'pass' if temp <= MEMORY_GOAL_MIB else 'FAIL'} |")
    return lines


def figure(tables: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(tables), figsize=(6 * len(tables), 4.2), squeeze=False)
    for ax, (variant, rows) in zip(axes[0], tables.items()):
        timed = [r for r in rows if "not_run" not in r]
        x = np.arange(len(timed))
        for offset, mode, label in ((-0.2, "fwd", "forward"), (0.2, "fwd_bwd", "fwd+bwd")):
            heights = [r["stats"][mode]["median"] * 1e3 if r["stats"][mode] else np.nan for r in timed]
            bars = ax.bar(x + offset, heights, 0.4, label=label)
            ax.bar_label(bars, [f"{h:,.0f}" if np.isfinite(h) else "" for h in heights], fontsize=7)
        ax.set_xticks(x, [r["name"].replace("recurrax ", "recurrax\n") for r in timed], fontsize=8)
        ax.set_yscale("log")
        ax.set_ylabel("ms (median)")
        ax.set_title(TITLES[variant], fontsize=10)
        ax.legend(fontsize=8)
    fig.suptitle("delta rule, B=2 T=2048 H=4 K=V=128 float32, this CPU", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# ----------------------------------------------------------------------------- main


def _to_json(value):
    if isinstance(value, dict):
        return {k: _to_json(v) for k, v in value.items() if k != "arrays"}
    if isinstance(value, (list, tuple)):
        return [_to_json(v) for v in value]
    if isinstance(value, (np.floating, np.integer)):
        return value.item()
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--torch-python", help="interpreter with torch and transformers 5.25 (delta_rule_torch.py)")
    parser.add_argument("--ejkernel-python", help="interpreter with ejkernel 0.0.80.3 (delta_rule_ejkernel.py)")
    parser.add_argument("--torch-threads", type=int, default=2)
    parser.add_argument("--variants", default="gdn,kda", help="comma-separated: gdn, kda (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=4, help="alternating rounds of recurrax's implementations")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per implementation per round")
    parser.add_argument("--peer-repeats", type=int, default=7, help="timed runs per peer program")
    parser.add_argument("--max-seconds", type=float, default=30.0,
                        help="a peer stops repeating a program after this many seconds (at least one sample)")
    parser.add_argument("--no-reference", action="store_true", help="do not time recurrax's token loop")
    parser.add_argument("--no-memory", action="store_true", help="skip the T = 16,384 temp-bytes compiles")
    parser.add_argument("--matmul-size", type=int, default=2048)
    parser.add_argument("--quick", action="store_true", help="tiny shapes: a smoke run, not a measurement")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    variants = args.variants.split(",")
    if set(variants) - set(VARIANTS):
        parser.error(f"--variants: choose from {list(VARIANTS)}")
    shape, memory_shape = (QUICK_SHAPE, QUICK_MEMORY_SHAPE) if args.quick else (SHAPE, MEMORY_SHAPE)
    runnable = [impl.name for impl in kernel_registry.implementations() if impl.priority >= 0
                and (impl.backend is Backend.ANY or impl.backend.value == current_backend())]
    names = [n for n in runnable if not (n == "reference" and args.no_reference)]
    names.sort(key=lambda n: (n != "chunk", n))
    notes = [] if "scan" in IMPLEMENTATIONS else [
        "`scan` is not registered in this tree (`recurrax.delta.IMPLEMENTATIONS` = "
        f"{sorted(IMPLEMENTATIONS)}): its goal is n/a until it is."]

    machine = machine_description()
    loads = {"start": os.getloadavg()[0]}
    peaks = [matmul_peak(args.matmul_size if not args.quick else 128, 10 if not args.quick else 1)]
    flops = forward_flops(**shape)
    tables, raw = {}, {}
    with tempfile.TemporaryDirectory() as scratch:
        directory = Path(scratch)
        every = {v: make_arrays(v, **shape) for v in variants}
        for variant, arrays in every.items():
            np.savez(directory / f"inputs_{variant}.npz", **arrays)
        (directory / "spec.json").write_text(json.dumps(dict(variants=variants, memory_shape=memory_shape)))
        ours = {}
        for variant in variants:
            ours[variant] = Ours(variant, every[variant], names)
            print(f"{variant}: compiled {ours[variant].compile_s}", file=sys.stderr)
        first = max(1, args.rounds // 2)  # rounds before the peers' turn; the rest after it
        for index in range(first):
            for variant in variants:
                ours[variant].round(index, args.repeats)
        peers = {}
        for peer, python in (("transformers", args.torch_python), ("ejKernel", args.ejkernel_python)):
            print(f"running {peer} …", file=sys.stderr)
            peers[peer] = run_peer(peer, python, directory, args)
        for index in range(first, args.rounds):
            for variant in variants:
                ours[variant].round(index, args.repeats)
        peaks.append(matmul_peak(args.matmul_size if not args.quick else 128, 10 if not args.quick else 1))
        loads["end_timing"] = os.getloadavg()[0]
        peak = max(p["flops_per_s"] for p in peaks)
        for variant in variants:
            memory = {} if args.no_memory else {n: temp_mib(variant, n, memory_shape) for n in names}
            exact = float64_reference(variant, every[variant])
            tables[variant] = collect_rows(variant, ours[variant], peers, exact, memory)
            raw[variant] = dict(rows=tables[variant], compile_s=ours[variant].compile_s,
                                samples=ours[variant].samples)
    loads["end"] = os.getloadavg()[0]

    peer_lines = []
    for peer, report in peers.items():
        if "not_run" in report:
            peer_lines.append(f"- {peer}: not run ({report['not_run']}).")
            continue
        versions = ", ".join(f"{k} {v}" for k, v in report["versions"].items())
        extra = f", {report['threads']} threads" if "threads" in report else ""
        peer_lines.append(f"- {peer}: {versions}{extra}; load average {report['load_before']:.2f} before its turn, "
                          f"{report['load_after']:.2f} after (nothing else of this benchmark ran meanwhile)."
                          + "".join(f" {n}" for n in report.get("notes", [])))
    text_lines = [
        "# The delta rule: recurrax against its peers on this CPU" if not args.quick else "# Delta rule (smoke run)",
        "",
        f"`python benchmarks/delta_rule.py` — B={shape['B']}, T={shape['T']}, H=Hqk={shape['H']}, "
        f"K={shape['K']}, V={shape['V']}, float32, `qk_l2norm=True`; {machine['cpu']}, {machine['usable_cpus']} "
        f"usable CPUs; Python {machine['python']}, JAX {machine['jax']}; recurrax commit {machine['commit']}; "
        f"{machine['date']}.",
        "",
        f"Load average (1 min): {loads['start']:.2f} at the start, {loads['end_timing']:.2f} after the timings, "
        f"{loads['end']:.2f} at the end (a shared machine: side-by-side ratios are what this run can say).",
        *([] if max(loads.values()) <= (machine["usable_cpus"] or 1) else [
            "", f"**Loaded machine:** the load average exceeded the {machine['usable_cpus']} usable CPUs during this "
            "run, so these are not the quiet-machine figures issue 32's goals are judged on; rerun when the "
            "machine is quiet."]),
        "",
        f"Matmul peak (jitted {peaks[0]['size']}² float32 `jnp.dot`, median): "
        + " and ".join(f"{p['flops_per_s'] / 1e9:,.0f}" for p in peaks)
        + f" GFLOP/s before and after; MFU uses {peak / 1e9:,.0f}. Model FLOPs: forward "
        f"B·T·H·(C·(5K + 3V) + 6·K·V) at C = {MODEL_CHUNK} = {flops / 1e9:.2f} GFLOP, fwd+bwd 3× that "
        "(see the module docstring).",
        "",
        f"recurrax: {args.rounds} rounds × {args.repeats} runs per implementation (`reference`: 1 run); "
        f"peers: up to {args.peer_repeats} runs after a warm-up. Times are min / median in ms; "
        "\"chunk's speed-up\" is that row's median over chunk's.",
        *peer_lines,
        *[f"- {n}" for n in notes],
        "",
    ]
    for variant, rows in tables.items():
        text_lines += variant_table(variant, rows, flops, peak) + [""] + goal_lines(variant, rows, flops, peak) + [""]
    text = "\n".join(text_lines)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "delta_rule.md").write_text(text)
    record = dict(machine=machine, loads=loads, peaks=peaks, flops_forward=flops, shape=shape,
                  memory_shape=memory_shape, variants=raw, peers=peers, notes=notes)
    (args.out / "delta_rule.json").write_text(json.dumps(_to_json(record), indent=1))
    try:
        figure(tables, args.out / "delta_rule.png")
    except ImportError:
        print("matplotlib not installed: no delta_rule.png (pip install -e '.[bench]')", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
