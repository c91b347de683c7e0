"""The reports of `recurrax bench`: markdown tables, the machine section, the plot, the files."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..cases import DELTA_PRESETS, GATE_PRESETS
from .measure import MODES, MiB, Shape

GATE_KINDS = (*GATE_PRESETS, *DELTA_PRESETS)

def _ms(record: dict[str, Any] | None) -> str:
    if record is None:
        return "—"
    if record["status"] != "ok":
        return record["status"]
    marker = "*" if record["over_budget"] else ""
    return f"{1e3 * record['median_s']:.2f}{marker}"

def _pct(record: dict[str, Any] | None) -> str:
    """MFU as a percentage: one decimal, or two significant digits below 1% (never a bare 0.0%)."""
    if record is None or record.get("mfu") is None:
        return "—"
    percent = 100 * record["mfu"]
    return f"{percent:.1f}%" if percent >= 1 else f"{percent:.2g}%"


def _mib(record: dict[str, Any] | None, field: str) -> str:
    value = None if record is None else record.get(field)
    if value is None:
        return "—"
    return f"{value / MiB:.1f}" if value >= 10 * MiB else f"{value / MiB:.2f}"

TABLE_HEADER = (
    "| impl | gates | T | fwd ms | fwd MFU | fwd+bwd ms | fwd+bwd MFU "
    "| fwd temp MiB | fwd+bwd temp MiB | fwd+bwd peak MiB |\n"
    "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"
)

def table_rows(records: Sequence[dict[str, Any]]) -> list[str]:
    """One markdown row per (impl, gates, T), pairing its fwd and fwd+bwd records."""
    cells: dict[tuple, dict[str, dict]] = {}
    for record in records:
        cells.setdefault((record["impl"], record["gates"], record["seq_len"]), {})[record["mode"]] = record
    order = sorted(cells, key=lambda c: (c[0], GATE_KINDS.index(c[1]) if c[1] in GATE_KINDS else 99, c[2]))
    rows = []
    for impl, kind, seq_len in order:
        fwd, train = cells[(impl, kind, seq_len)].get("fwd"), cells[(impl, kind, seq_len)].get("fwd+bwd")
        rows.append(
            f"| {impl} | {kind} | {seq_len} | {_ms(fwd)} | {_pct(fwd)} | {_ms(train)} | {_pct(train)} "
            f"| {_mib(fwd, 'temp_bytes')} | {_mib(train, 'temp_bytes')} | {_mib(train, 'peak_bytes')} |"
        )
    return rows

def table_notes(records: Sequence[dict[str, Any]]) -> list[str]:
    """Why any measurement was skipped, refused or failed."""
    notes = []
    for r in records:
        if r["status"] not in ("ok", "compiled"):
            notes.append(f"- {r['impl']} {r['gates']} T={r['seq_len']} {r['mode']}: {r['status']} — {r['reason']}")
    return notes

def machine_markdown(machine: dict[str, Any], peaks: Sequence[dict[str, float]], peak: float | None) -> list[str]:
    """The machine description and the measured matmul peak."""
    memory = "?" if machine["memory_gib"] is None else f"{machine['memory_gib']:.1f} GiB"
    load = lambda key: ", ".join(f"{x:.2f}" for x in machine.get(key, []))  # noqa: E731
    lines = [
        "## Machine",
        "",
        f"- CPU: {machine['cpu']}; {machine['logical_cpus']} logical CPUs ({machine['usable_cpus']} usable); RAM {memory}",
        f"- vector extensions: {' '.join(machine['cpu_extensions']) or '?'}",
        f"- {machine['os']}; Python {machine['python']}",
        f"- jax {machine['jax']}, jaxlib {machine['jaxlib']}; backend {machine['backend']} ({machine['device']})"
        + (f"; XLA_FLAGS={machine['xla_flags']}" if machine["xla_flags"] else ""),
        f"- recurrax {machine['recurrax']}, commit {machine['commit']}; {machine['date']}",
        f"- load average (1, 5, 15 min) at start: {load('load_average_start')}; at end: {load('load_average_end')}",
        "",
        "## float32 matmul peak (measured in this run)",
        "",
    ]
    for when, p in zip(("before the grid", "after the grid"), peaks):
        lines.append(
            f"- {when}: `jnp.dot` {p['size']}×{p['size']} f32, median of {p['repeats']}: "
            f"{1e3 * p['median_s']:.2f} ms → **{p['flops_per_s'] / 1e9:.1f} GFLOP/s**"
        )
    if peak is None:
        return lines + ["- not measured (interrupted first)", ""]
    return lines + [f"- MFU below divides by the higher: **{peak / 1e9:.1f} GFLOP/s**", ""]

METHOD = """## Method

- fwd: `jit(recurrax.recurrent)` returning `(output, final_state)`; model FLOPs 4·B·T·H·K·V.
- fwd+bwd: `jit(value_and_grad(loss))` wrt query, key, value and every gate, with
  `loss = <output, d_output> + <final_state, d_state>` (random cotangents); model FLOPs 12·B·T·H·K·V.
- Inputs in `--dtype` (float32 unless given), normal; gates `log_sigmoid(normal) / 16` (g_gamma: RetNet's `log(1 - 2^(-5-h))`).
- Compilation is not timed; times are medians of up to `--repeats` runs after one warm-up run,
  each ended by `jax.block_until_ready`. `*` marks a single run that alone exceeded `--max-seconds`;
  longer sequences predicted (linearly in T) to exceed it are skipped, their memory still reported.
- Memory: XLA's compiled memory analysis, no run needed: temp = `temp_size_in_bytes` (the temporary
  buffer; the memory target bounds it), peak = `peak_memory_in_bytes` (XLA's live-set peak of
  arguments, outputs and temporaries; it can be below temp, a laid-out allocation).
"""

def progress_note(report: dict[str, Any]) -> list[str]:
    """A line saying the results are partial, while measuring or after an interruption."""
    status = report.get("status", "complete")
    if status == "complete":
        return []
    done, total = len(report["records"]), report["measurements"]
    why = "interrupted" if status == "interrupted" else "still measuring"
    return [f"**Partial results ({why}): {done} of {total} measurements.**", ""]

def results_markdown(report: dict[str, Any]) -> str:
    """The whole results.md."""
    settings, shape = report["settings"], Shape(**report["shape"])
    lines = [
        "# recurrax benchmark results",
        "",
        f"Command: `{' '.join(['recurrax', 'bench', *report['argv']])}`",
        "",
        *machine_markdown(report["machine"], report["matmul_peaks"], report["peak_flops_per_s"]),
        METHOD,
        *progress_note(report),
    ]
    for section in report.get("sections", []):
        lines += [section, ""]
    lines += [
        f"## Results ({shape.words().replace(' T=' + str(shape.seq_len), '')}, {settings.get('dtype', 'float32')})",
        "",
        f"Implementations: {', '.join(report['impls'])}; reference only for T ≤ {settings['reference_max_len']}; "
        f"repeats {settings['repeats']}; budget {settings['max_seconds']:g} s per measurement.",
        "",
        TABLE_HEADER,
        *table_rows(report["records"]),
        "",
        *table_notes(report["records"] + report.get("extra_records", [])),
    ]
    return "\n".join(lines).rstrip() + "\n"

def plot_results(records: Sequence[dict[str, Any]], path: Path) -> None:
    """Time vs T, log-log: forward and forward+backward panels, a line per impl × gate kind."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(13, 5), sharey=True)
    impls = sorted({r["impl"] for r in records})
    seq_lens = sorted({r["seq_len"] for r in records})
    colours = {impl: f"C{i}" for i, impl in enumerate(impls)}
    styles = dict(zip(GATE_KINDS, ("-", "--", ":", "-.", (0, (5, 1, 1, 1)), "-", "--", ":")))
    markers = dict(zip(GATE_KINDS, "osD^vPX*"))
    for axis, mode in zip(axes, MODES):
        for impl in impls:
            for kind in GATE_KINDS:
                points = [(r["seq_len"], r["median_s"]) for r in records
                          if (r["impl"], r["gates"], r["mode"], r["status"]) == (impl, kind, mode, "ok")]
                if points:
                    xs, ys = zip(*sorted(points))
                    axis.plot(xs, ys, color=colours[impl], linestyle=styles[kind], marker=markers[kind],
                              label=f"{impl} · {kind}")
        axis.set(xscale="log", yscale="log", xlabel="sequence length T", title=mode)
        axis.set_xticks(seq_lens, [str(t) for t in seq_lens])
        axis.minorticks_off()
        axis.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("time per call (s)")
    axes[1].legend(fontsize=8, loc="upper left", ncol=1 + len(impls) // 2)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)

def write_outputs(report: dict[str, Any], out: Path, *, plot: bool = True) -> list[Path]:
    """results.md, results.json and (when `plot` and anything was measured) results.png in
    `out`; the paths written. Each file is replaced whole, so an interruption never leaves
    half a file."""
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "results.md", out / "results.json"]
    _replace(paths[0], results_markdown(report))
    _replace(paths[1], json.dumps(report, indent=1, default=_jsonable) + "\n")
    if plot and report["records"]:
        paths.append(out / "results.png")
        plot_results(report["records"], paths[2])
    return paths

def _replace(path: Path, text: str) -> None:
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    partial.replace(path)

def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return str(value)
