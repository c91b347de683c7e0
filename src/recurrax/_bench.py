"""`recurrax bench`: time, model-FLOP utilisation and memory of every implementation.

For each registered implementation (default: reference for short inputs, scan, chunk), each
gate kind and each sequence length, two programs are compiled and timed:

| mode    | program                                                                  | model FLOPs   |
|---------|--------------------------------------------------------------------------|---------------|
| fwd     | `jit(recurrent)` returning `(output, final_state)`                       | 4·B·T·H·K·V   |
| fwd+bwd | `jit(value_and_grad(loss))` wrt query, key, value and every gate, where   | 12·B·T·H·K·V  |
|         | `loss = <output, d_output> + <final_state, d_state>` (random cotangents) |               |

Compilation is not timed; a measurement is the median of `--repeats` runs, each ended by
`jax.block_until_ready`. Model-FLOP utilisation (MFU) divides model FLOPs per second by this
machine's float32 matmul peak, measured in the same run (a jitted `jnp.dot` of two square
float32 matrices, before and after the grid; the higher figure is used). Memory comes from
XLA's compiled memory analysis (`temp_size_in_bytes`, `peak_memory_in_bytes`, argument and
output sizes): it needs no run.

`--max-seconds` bounds each measurement: one run is timed first; if it exceeds the budget it
is the only sample, and a longer sequence is skipped (recorded as such, memory still
reported) whenever one run there is predicted, linearly in T, to exceed the budget.

Outputs in `--out`: `results.md` (machine, matmul peak, targets, table), `results.json`
(raw records) and `results.png` (time vs T, log-log, one line per implementation × gate kind).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

import recurrax
from recurrax.registry import kernel_registry

GATE_KINDS = ("none", "g", "g_gamma", "gk", "gk+gv")
"""Gate kinds of the grid: no decay, per-head g, constant g_gamma, per-channel gk, gk and gv."""

GATE_WORDS = {
    "none": "no gate",
    "g": "per-head g",
    "g_gamma": "constant g_gamma",
    "gk": "per-channel gk",
    "gk+gv": "per-channel gk and gv",
}

MODES = ("fwd", "fwd+bwd")
FLOPS_PER_ELEMENT = {"fwd": 4, "fwd+bwd": 12}
"""Model FLOPs per B·T·H·K·V: forward 4, forward and backward 12."""

DEFAULT_IMPLS = ("reference", "scan", "chunk")
MiB = 2**20


@dataclasses.dataclass(frozen=True)
class Shape:
    """Problem sizes: batch, sequence length, heads, query/key and value head dims."""

    batch: int
    seq_len: int
    heads: int
    qk_dim: int
    v_dim: int

    def words(self) -> str:
        return f"B={self.batch} T={self.seq_len} H={self.heads} K={self.qk_dim} V={self.v_dim}"

    def with_seq_len(self, seq_len: int) -> Shape:
        return dataclasses.replace(self, seq_len=seq_len)


@dataclasses.dataclass(frozen=True)
class Settings:
    """How to measure.

    **Arguments:**
    - `repeats`: timed runs per measurement (the median is reported).
    - `max_seconds`: time budget of one measurement (see the module docstring).
    - `reference_max_len`: the reference runs only for sequences up to this length.
    - `seed`: seed of the random inputs.
    """

    repeats: int
    max_seconds: float
    reference_max_len: int
    seed: int = 0


# ----------------------------------------------------------------------------- arithmetic


def model_flops(shape: Shape, mode: str) -> int:
    """Model FLOPs of one call: 4·B·T·H·K·V forward, 12·B·T·H·K·V forward and backward."""
    elements = shape.batch * shape.seq_len * shape.heads * shape.qk_dim * shape.v_dim
    return FLOPS_PER_ELEMENT[mode] * elements


def matmul_flops(size: int) -> int:
    """FLOPs of a square `size × size` matrix product: 2·n³."""
    return 2 * size**3


def utilisation(flops: float, seconds: float, peak_flops_per_s: float) -> float:
    """Model-FLOP utilisation: achieved FLOP/s as a fraction of the peak."""
    return flops / seconds / peak_flops_per_s


def predicted_seconds(seconds: float, from_len: int, to_len: int) -> float:
    """One run's time at `to_len`, extrapolated linearly in the sequence length."""
    return seconds * to_len / from_len


# ----------------------------------------------------------------------------- machine


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo, or `platform.processor()`."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def cpu_vector_extensions() -> list[str]:
    """The matmul-relevant instruction-set flags (FMA, AVX*, AMX) of the CPU."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = line.split(":", 1)[1].split()
                return [f for f in flags if f.startswith(("fma", "avx", "amx"))]
    except OSError:
        pass
    return []


def memory_gib() -> float | None:
    """Total RAM in GiB from /proc/meminfo."""
    try:
        first = Path("/proc/meminfo").read_text().splitlines()[0]
        return int(first.split()[1]) / 2**20
    except (OSError, IndexError, ValueError):
        return None


def git_commit() -> str | None:
    """The short commit hash of the source tree, with `+dirty` when it has changes."""
    here = Path(__file__).resolve().parent
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True, check=True
        ).stdout.strip()
        status = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=here, capture_output=True, text=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return commit + ("+dirty" if status else "")


def machine_description() -> dict[str, Any]:
    """What the numbers were measured on."""
    import jaxlib

    device = jax.devices()[0]
    return {
        "cpu": cpu_model(),
        "logical_cpus": os.cpu_count(),
        "usable_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "cpu_extensions": cpu_vector_extensions(),
        "memory_gib": memory_gib(),
        "os": platform.platform(),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "recurrax": recurrax.__version__,
        "commit": git_commit(),
        "backend": jax.default_backend(),
        "device": f"{device.platform}:{device.device_kind}",
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "load_average_start": list(os.getloadavg()),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def seconds_of(run: Callable[[], Any]) -> float:
    """Wall time of one call of `run`, waiting for its results."""
    start = time.perf_counter()
    jax.block_until_ready(run())
    return time.perf_counter() - start


def matmul_peak(size: int, repeats: int) -> dict[str, float]:
    """This machine's float32 matmul throughput: median time of a jitted `jnp.dot`."""
    key_a, key_b = jax.random.split(jax.random.PRNGKey(0))
    a = jax.random.normal(key_a, (size, size), jnp.float32)
    b = jax.random.normal(key_b, (size, size), jnp.float32)
    dot = jax.jit(jnp.dot).lower(a, b).compile()
    seconds_of(lambda: dot(a, b))  # warm-up
    median = statistics.median(seconds_of(lambda: dot(a, b)) for _ in range(repeats))
    return {"size": size, "repeats": repeats, "median_s": median, "flops_per_s": matmul_flops(size) / median}


# ----------------------------------------------------------------------------- inputs


def make_gates(kind: str, shape: Shape, key: jax.Array) -> dict[str, jax.Array]:
    """Log-decay gates of `kind`, float32, in a realistic range (mostly -0.01 … -0.2)."""
    B, T, H, K, V = shape.batch, shape.seq_len, shape.heads, shape.qk_dim, shape.v_dim
    key_g, key_v = jax.random.split(key)

    def log_sigmoid_gate(key: jax.Array, dims: tuple[int, ...]) -> jax.Array:
        return jax.nn.log_sigmoid(jax.random.normal(key, dims, jnp.float32)) / 16

    if kind == "none":
        return {}
    if kind == "g":
        return {"g": log_sigmoid_gate(key_g, (B, T, H))}
    if kind == "g_gamma":  # RetNet's per-head decays log(1 - 2^(-5-h))
        return {"g_gamma": jnp.log1p(-(2.0 ** (-5.0 - jnp.arange(H, dtype=jnp.float32))))}
    if kind == "gk":
        return {"gk": log_sigmoid_gate(key_g, (B, T, H, K))}
    if kind == "gk+gv":
        return {"gk": log_sigmoid_gate(key_g, (B, T, H, K)), "gv": log_sigmoid_gate(key_v, (B, T, H, V))}
    raise ValueError(f"gate kind must be one of {GATE_KINDS}, got {kind!r}")


def make_arguments(shape: Shape, kind: str, seed: int) -> tuple[tuple, tuple]:
    """Random float32 `(query, key, value, gates)` and cotangents `(d_output, d_state)`."""
    B, T, H, K, V = shape.batch, shape.seq_len, shape.heads, shape.qk_dim, shape.v_dim
    keys = jax.random.split(jax.random.PRNGKey(seed), 6)
    normal = lambda key, dims: jax.random.normal(key, dims, jnp.float32)  # noqa: E731
    query, key_, value = normal(keys[0], (B, T, H, K)), normal(keys[1], (B, T, H, K)), normal(keys[2], (B, T, H, V))
    gates = make_gates(kind, shape, keys[3])
    cotangents = (normal(keys[4], (B, T, H, V)), normal(keys[5], (B, H, K, V)))
    return (query, key_, value, gates), cotangents


# ----------------------------------------------------------------------------- programs


def forward_program(impl: str) -> Callable:
    """`(query, key, value, gates) -> (output, final_state)` with `impl`."""

    def forward(query, key, value, gates):
        return recurrax.recurrent(query, key, value, **gates, implementation=impl)

    return forward


def forward_backward_program(impl: str) -> Callable:
    """`(query, key, value, gates, d_output, d_state) -> (loss, grads)` with `impl`.

    The loss pairs both outputs with fixed random cotangents, so the backward sees the
    general case; grads cover query, key, value and every gate.
    """
    forward = forward_program(impl)

    def loss(query, key, value, gates, d_output, d_state):
        output, final_state = forward(query, key, value, gates)
        return jnp.vdot(output, d_output) + jnp.vdot(final_state, d_state)

    return jax.value_and_grad(loss, argnums=(0, 1, 2, 3))


def program_and_arguments(impl: str, mode: str, primals: tuple, cotangents: tuple) -> tuple[Callable, tuple]:
    """The function to compile for `mode` and the arguments it takes."""
    if mode == "fwd":
        return forward_program(impl), primals
    return forward_backward_program(impl), primals + cotangents


# ----------------------------------------------------------------------------- measuring


def memory_of(compiled: Any) -> dict[str, int | None]:
    """Byte counts from XLA's compiled memory analysis (None where the backend gives none)."""
    stats = compiled.memory_analysis()
    field = lambda name: None if stats is None else getattr(stats, name, None)  # noqa: E731
    return {
        "temp_bytes": field("temp_size_in_bytes"),
        "peak_bytes": field("peak_memory_in_bytes"),
        "argument_bytes": field("argument_size_in_bytes"),
        "output_bytes": field("output_size_in_bytes"),
    }


def time_runs(run: Callable[[], Any], repeats: int, max_seconds: float) -> dict[str, Any]:
    """Median time of up to `repeats` runs within the budget; the first run decides how many.

    The first run is a warm-up unless it alone uses the budget, in which case it is the only
    sample (`over_budget` is then True).
    """
    first = seconds_of(run)
    more = min(repeats, int(max_seconds // first)) if first <= max_seconds else 0
    samples = [seconds_of(run) for _ in range(more)] or [first]
    return {
        "median_s": statistics.median(samples),
        "min_s": min(samples),
        "runs": len(samples),
        "first_s": first,
        "over_budget": first > max_seconds,
    }


def unsupported(error: Exception) -> bool:
    """Whether `error` is the registry refusing the call (rather than a failure)."""
    return isinstance(error, ValueError) and "cannot run this call" in str(error)


def measure(
    impl: str, kind: str, shape: Shape, mode: str, settings: Settings, *, run: bool = True, skip_reason: str = ""
) -> dict[str, Any]:
    """Compile one program, read its memory, and (when `run`) time it. One record."""
    record: dict[str, Any] = {"impl": impl, "gates": kind, "mode": mode, **dataclasses.asdict(shape)}
    record["model_flops"] = model_flops(shape, mode)
    primals, cotangents = make_arguments(shape, kind, settings.seed)
    function, arguments = program_and_arguments(impl, mode, primals, cotangents)
    try:
        start = time.perf_counter()
        compiled = jax.jit(function).lower(*arguments).compile()
        record["compile_s"] = time.perf_counter() - start
        record.update(memory_of(compiled))
        if not run:
            return {**record, "status": "skipped" if skip_reason else "compiled", "reason": skip_reason}
        record.update(time_runs(lambda: compiled(*arguments), settings.repeats, settings.max_seconds))
    except Exception as error:  # noqa: BLE001 - one failing cell must not end the benchmark
        status = "unsupported" if unsupported(error) else "error"
        return {**record, "status": status, "reason": f"{type(error).__name__}: {_first_line(error)}"}
    return {**record, "status": "ok", "reason": ""}


def _first_line(error: Exception) -> str:
    lines = [line for line in str(error).splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""


def add_utilisation(record: dict[str, Any], peak_flops_per_s: float) -> dict[str, Any]:
    """`record` with its MFU against `peak_flops_per_s` (None when not timed)."""
    timed = record.get("status") == "ok"
    mfu = utilisation(record["model_flops"], record["median_s"], peak_flops_per_s) if timed else None
    return {**record, "mfu": mfu}


# ----------------------------------------------------------------------------- grid


def grid_cells(impls: Sequence[str], kinds: Sequence[str], seq_lens: Sequence[int], settings: Settings):
    """The (T, gate kind, impl) cells in measuring order: implementations side by side."""
    for seq_len in sorted(seq_lens):
        for kind in kinds:
            for impl in impls:
                if impl == "reference" and seq_len > settings.reference_max_len:
                    continue
                yield seq_len, kind, impl


def budget_skip(last_run: tuple[int, float] | None, seq_len: int, settings: Settings) -> str:
    """Why to skip timing at `seq_len`, from the last timed `(seq_len, first_run_s)`, or ''."""
    if last_run is None:
        return ""
    predicted = predicted_seconds(last_run[1], last_run[0], seq_len)
    if predicted <= settings.max_seconds:
        return ""
    return f"one run predicted {predicted:.1f} s > --max-seconds {settings.max_seconds:g} (from T={last_run[0]})"


def run_grid(
    impls: Sequence[str], kinds: Sequence[str], base: Shape, seq_lens: Sequence[int], settings: Settings, progress
) -> list[dict[str, Any]]:
    """Every measurement of the grid, in order; updates the `progress` bar per measurement."""
    records, last_runs = [], {}
    for seq_len, kind, impl in grid_cells(impls, kinds, seq_lens, settings):
        for mode in MODES:
            progress.set_postfix_str(f"{impl} {kind} T={seq_len} {mode}")
            reason = budget_skip(last_runs.get((impl, kind, mode)), seq_len, settings)
            record = measure(impl, kind, base.with_seq_len(seq_len), mode, settings, run=not reason, skip_reason=reason)
            if record["status"] == "ok":
                last_runs[(impl, kind, mode)] = (seq_len, record["first_s"])
            records.append(record)
            progress.update()
    return records


def grid_size(impls: Sequence[str], kinds: Sequence[str], seq_lens: Sequence[int], settings: Settings) -> int:
    """How many measurements `run_grid` makes."""
    return len(MODES) * sum(1 for _ in grid_cells(impls, kinds, seq_lens, settings))


# ----------------------------------------------------------------------------- targets

TARGET_SHAPE = Shape(2, 2048, 8, 64, 64)
MEMORY_TARGET_SHAPE = Shape(1, 16384, 4, 64, 64)
QUICK_TARGET_SHAPE = Shape(1, 256, 2, 16, 16)
QUICK_MEMORY_TARGET_SHAPE = Shape(1, 1024, 2, 16, 16)


def target_measurements(impl: str | None) -> int:
    """How many measurements `run_targets` makes for `impl` (None: no targets)."""
    if impl is None:
        return 0
    return 4 + ("scan" in kernel_registry.names() and impl != "scan")


@dataclasses.dataclass(frozen=True)
class Target:
    """One line of issue 3's targets: a measured value against a threshold."""

    name: str
    impl: str
    value: float | None
    threshold: float
    at_least: bool
    unit: str
    note: str = ""

    @property
    def verdict(self) -> str:
        if self.value is None:
            return "n/a"
        passed = self.value >= self.threshold if self.at_least else self.value <= self.threshold
        return "pass" if passed else "FAIL"

    def formatted(self, value: float | None) -> str:
        if value is None:
            return "n/a"
        if self.unit == "%":
            return f"{100 * value:.1f}%"
        if self.unit == "×":
            return f"{value:.1f}×"
        return f"{value / MiB:.1f} MiB"

    def requirement(self) -> str:
        return ("≥ " if self.at_least else "≤ ") + self.formatted(self.threshold)


def target_impl(requested: str | None) -> str:
    """The implementation judged against the targets: `requested`, else chunk, else the default."""
    names = kernel_registry.names()
    if requested is not None:
        return requested
    return "chunk" if "chunk" in names else names[0]


def _mfu_target(name: str, record: dict[str, Any], threshold: float) -> Target:
    note = _note(record) or f"{1e3 * record['median_s']:.2f} ms, median of {record['runs']}"
    return Target(name, record["impl"], record.get("mfu"), threshold, True, "%", note)


def _note(record: dict[str, Any]) -> str:
    return "" if record["status"] in ("ok", "compiled") else f"{record['status']}: {record['reason']}"


def speedup_target(candidate: dict[str, Any], baseline: dict[str, Any] | None) -> Target:
    """fwd+bwd speed-up of the candidate over scan, measured side by side."""
    name = "fwd+bwd speed-up over scan, per-head g"
    if baseline is None:
        reason = "the judged implementation is scan" if candidate["impl"] == "scan" else "scan is not registered"
        return Target(name, candidate["impl"], None, 10.0, True, "×", reason)
    timed = candidate["status"] == "ok" and baseline["status"] == "ok"
    value = baseline["median_s"] / candidate["median_s"] if timed else None
    note = "; ".join(filter(None, (_note(candidate), _note(baseline))))
    if timed:
        note = f"scan {1e3 * baseline['median_s']:.1f} ms ({baseline['runs']} runs) vs {1e3 * candidate['median_s']:.1f} ms"
    return Target(name, candidate["impl"], value, 10.0, True, "×", note)


def memory_target(record: dict[str, Any], shape: Shape) -> Target:
    """fwd+bwd temporary memory with per-channel gk at the memory target's shape."""
    name = f"fwd+bwd temp memory, per-channel gk, {shape.words()}"
    return Target(name, record["impl"], record.get("temp_bytes"), 256 * MiB, False, "MiB", _note(record))


def run_targets(impl: str, shape: Shape, memory_shape: Shape, settings: Settings, progress) -> dict[str, Any]:
    """The measurements behind issue 3's targets for `impl`, by role (scan's is None if absent)."""

    def measured(name: str, kind: str, mode: str, target_shape: Shape = shape, run: bool = True):
        progress.set_postfix_str(f"targets: {name} {kind} T={target_shape.seq_len} {mode}")
        record = measure(name, kind, target_shape, mode, settings, run=run)
        progress.update()
        return {**record, "section": "targets"}

    has_scan = "scan" in kernel_registry.names() and impl != "scan"
    return {
        "head_train": measured(impl, "g", "fwd+bwd"),
        "scan_train": measured("scan", "g", "fwd+bwd") if has_scan else None,
        "channel_train": measured(impl, "gk", "fwd+bwd"),
        "head_forward": measured(impl, "g", "fwd"),
        "memory": measured(impl, "gk", "fwd+bwd", memory_shape, run=False),
    }


def judge_targets(records: dict[str, Any], memory_shape: Shape) -> list[Target]:
    """Issue 3's targets from `run_targets`' records (with their MFU already added)."""
    return [
        _mfu_target("fwd+bwd MFU, per-head g", records["head_train"], 0.10),
        _mfu_target("fwd+bwd MFU, per-channel gk", records["channel_train"], 0.06),
        _mfu_target("fwd MFU, per-head g", records["head_forward"], 0.15),
        speedup_target(records["head_train"], records["scan_train"]),
        memory_target(records["memory"], memory_shape),
    ]


# ----------------------------------------------------------------------------- reports


def _ms(record: dict[str, Any] | None) -> str:
    if record is None:
        return "—"
    if record["status"] != "ok":
        return record["status"]
    marker = "*" if record["over_budget"] else ""
    return f"{1e3 * record['median_s']:.2f}{marker}"


def _pct(record: dict[str, Any] | None) -> str:
    return "—" if record is None or record.get("mfu") is None else f"{100 * record['mfu']:.1f}%"


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


def targets_markdown(targets: Sequence[Target], shape: Shape, quick: bool) -> list[str]:
    """The targets section: one line per target with pass/fail."""
    lines = [f"## Targets (issue 3; f32, {shape.words()})", ""]
    if quick:
        lines += ["**Quick run: reduced shapes, not the targets' shapes — the verdicts mean nothing.**", ""]
    lines += ["| target | impl | measured | required | result | note |", "|---|---|---:|---:|---|---|"]
    for t in targets:
        lines.append(f"| {t.name} | {t.impl} | {t.formatted(t.value)} | {t.requirement()} | {t.verdict} | {t.note} |")
    return lines + [""]


def machine_markdown(machine: dict[str, Any], peaks: Sequence[dict[str, float]], peak: float) -> list[str]:
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
    return lines + [f"- MFU below divides by the higher: **{peak / 1e9:.1f} GFLOP/s**", ""]


METHOD = """## Method

- fwd: `jit(recurrax.recurrent)` returning `(output, final_state)`; model FLOPs 4·B·T·H·K·V.
- fwd+bwd: `jit(value_and_grad(loss))` wrt query, key, value and every gate, with
  `loss = <output, d_output> + <final_state, d_state>` (random cotangents); model FLOPs 12·B·T·H·K·V.
- Inputs float32, normal; gates `log_sigmoid(normal) / 16` (g_gamma: RetNet's `log(1 - 2^(-5-h))`).
- Compilation is not timed; times are medians of up to `--repeats` runs after one warm-up run,
  each ended by `jax.block_until_ready`. `*` marks a single run that alone exceeded `--max-seconds`;
  longer sequences predicted (linearly in T) to exceed it are skipped, their memory still reported.
- Memory: XLA's compiled memory analysis, no run needed: temp = `temp_size_in_bytes` (the temporary
  buffer; the memory target bounds it), peak = `peak_memory_in_bytes` (XLA's live-set peak of
  arguments, outputs and temporaries; it can be below temp, a laid-out allocation).
"""


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
    ]
    if report["targets"]:
        lines += targets_markdown([Target(**t) for t in report["targets"]], Shape(**report["target_shape"]), report["quick"])
    lines += [
        f"## Results ({shape.words().replace(' T=' + str(shape.seq_len), '')}, f32)",
        "",
        f"Implementations: {', '.join(report['impls'])}; reference only for T ≤ {settings['reference_max_len']}; "
        f"repeats {settings['repeats']}; budget {settings['max_seconds']:g} s per measurement.",
        "",
        TABLE_HEADER,
        *table_rows(report["records"]),
        "",
        *table_notes(report["records"] + report["target_records"]),
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
    styles = dict(zip(GATE_KINDS, ("-", "--", ":", "-.", (0, (5, 1, 1, 1)))))
    markers = dict(zip(GATE_KINDS, "osD^v"))
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


def write_outputs(report: dict[str, Any], out: Path) -> list[Path]:
    """results.md, results.json and results.png in `out`."""
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "results.md", out / "results.json", out / "results.png"]
    paths[0].write_text(results_markdown(report))
    paths[1].write_text(json.dumps(report, indent=1, default=_jsonable) + "\n")
    plot_results(report["records"], paths[2])
    return paths


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return str(value)


# ----------------------------------------------------------------------------- command line

FULL = {"seq_lens": "256,1024,4096,16384", "batch": 2, "heads": 8, "qk_dim": 64, "v_dim": 64,
        "repeats": 7, "max_seconds": 10.0, "matmul_size": 2048, "matmul_repeats": 10}
QUICK = {"seq_lens": "64,256", "batch": 1, "heads": 2, "qk_dim": 16, "v_dim": 16,
         "repeats": 3, "max_seconds": 5.0, "matmul_size": 512, "matmul_repeats": 5}


def parse_arguments(argv: Sequence[str]) -> argparse.Namespace:
    """Options of `recurrax bench`; unset sizes come from the full or the `--quick` grid."""
    parser = argparse.ArgumentParser(prog="recurrax bench", description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--quick", action="store_true", help="tiny grid and target shapes, for a smoke run of seconds")
    add("--impls", help="comma-separated implementations (default: those of reference,scan,chunk registered)")
    add("--gates", default=",".join(GATE_KINDS), help=f"comma-separated gate kinds among {','.join(GATE_KINDS)}")
    add("--seq-lens", help=f"comma-separated sequence lengths (default {FULL['seq_lens']}; quick {QUICK['seq_lens']})")
    add("--batch", type=int, help=f"batch size B (default {FULL['batch']})")
    add("--heads", type=int, help=f"heads H (default {FULL['heads']})")
    add("--qk-dim", type=int, help=f"query/key head dim K (default {FULL['qk_dim']})")
    add("--v-dim", type=int, help=f"value head dim V (default {FULL['v_dim']})")
    add("--repeats", type=int, help=f"timed runs per measurement (default {FULL['repeats']})")
    add("--max-seconds", type=float, help=f"time budget per measurement (default {FULL['max_seconds']:g})")
    add("--reference-max-len", type=int, default=1024, help="longest T the reference runs at (default 1024)")
    add("--matmul-size", type=int, help=f"side of the peak-measuring matmul (default {FULL['matmul_size']})")
    add("--matmul-repeats", type=int, help=f"timed runs of that matmul (default {FULL['matmul_repeats']})")
    add("--target-impl", help="implementation judged against the targets (default chunk, else the default one)")
    add("--no-targets", action="store_true", help="skip the targets section")
    add("--seed", type=int, default=0, help="seed of the random inputs")
    add("--out", type=Path, default=Path("benchmarks/results"), help="output directory (default benchmarks/results)")
    args = parser.parse_args(list(argv))
    for name, value in (QUICK if args.quick else FULL).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def chosen_implementations(requested: str | None) -> list[str]:
    """The implementations to measure; an unregistered name raises `ValueError`."""
    registered = kernel_registry.names()
    if requested is None:
        return [name for name in DEFAULT_IMPLS if name in registered]
    names = [name.strip() for name in requested.split(",") if name.strip()]
    unknown = [name for name in names if name not in registered]
    if unknown:
        raise ValueError(f"--impls: {unknown} not registered; registered: {registered}")
    return names


def chosen_gates(requested: str) -> list[str]:
    """The gate kinds to measure; an unknown kind raises `ValueError`."""
    kinds = [kind.strip() for kind in requested.split(",") if kind.strip()]
    unknown = [kind for kind in kinds if kind not in GATE_KINDS]
    if unknown:
        raise ValueError(f"--gates: {unknown} unknown; choose among {list(GATE_KINDS)}")
    return kinds


def run(args: argparse.Namespace, impls: list[str], kinds: list[str], argv: Sequence[str]) -> dict[str, Any]:
    """Measure everything `args` asks for; the report that `write_outputs` writes."""
    from tqdm.auto import tqdm

    seq_lens = sorted({int(t) for t in str(args.seq_lens).split(",") if t.strip()})
    settings = Settings(args.repeats, args.max_seconds, args.reference_max_len, args.seed)
    shape = Shape(args.batch, seq_lens[0], args.heads, args.qk_dim, args.v_dim)
    candidate = None if args.no_targets else target_impl(args.target_impl)
    target_shape = QUICK_TARGET_SHAPE if args.quick else TARGET_SHAPE
    memory_shape = QUICK_MEMORY_TARGET_SHAPE if args.quick else MEMORY_TARGET_SHAPE

    machine = machine_description()
    peaks = [matmul_peak(args.matmul_size, args.matmul_repeats)]
    total = grid_size(impls, kinds, seq_lens, settings) + target_measurements(candidate)
    with tqdm(total=total, desc="recurrax bench", unit="measurement", dynamic_ncols=True) as progress:
        records = run_grid(impls, kinds, shape, seq_lens, settings, progress)
        by_role = {} if candidate is None else run_targets(candidate, target_shape, memory_shape, settings, progress)
    peaks.append(matmul_peak(args.matmul_size, args.matmul_repeats))
    machine["load_average_end"] = list(os.getloadavg())
    peak = max(p["flops_per_s"] for p in peaks)
    by_role = {role: None if r is None else add_utilisation(r, peak) for role, r in by_role.items()}
    return {
        "argv": list(argv),
        "quick": args.quick,
        "machine": machine,
        "matmul_peaks": peaks,
        "peak_flops_per_s": peak,
        "settings": dataclasses.asdict(settings),
        "shape": dataclasses.asdict(shape),
        "impls": impls,
        "gate_kinds": kinds,
        "seq_lens": seq_lens,
        "records": [add_utilisation(r, peak) for r in records],
        "target_shape": dataclasses.asdict(target_shape),
        "memory_target_shape": dataclasses.asdict(memory_shape),
        "targets": [dataclasses.asdict(t) for t in judge_targets(by_role, memory_shape)] if by_role else [],
        "target_records": [r for r in by_role.values() if r is not None],
    }


def summary(report: dict[str, Any], paths: Sequence[Path]) -> str:
    """What to print at the end: the peak, the targets and where the files went."""
    lines = [f"float32 matmul peak: {report['peak_flops_per_s'] / 1e9:.1f} GFLOP/s "
             f"(before {report['matmul_peaks'][0]['flops_per_s'] / 1e9:.1f}, "
             f"after {report['matmul_peaks'][1]['flops_per_s'] / 1e9:.1f})"]
    lines += [TABLE_HEADER, *table_rows(report["records"])]
    for t in (Target(**t) for t in report["targets"]):
        lines.append(f"[{t.verdict:>4}] {t.name} ({t.impl}): {t.formatted(t.value)} (target {t.requirement()})")
    lines += [f"wrote {path}" for path in paths]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """`recurrax bench [options]`: 0 on success, 1 if a measurement failed, 2 on bad options."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_arguments(argv)
    try:
        impls, kinds = chosen_implementations(args.impls), chosen_gates(args.gates)
        if args.target_impl is not None:
            chosen_implementations(args.target_impl)
    except ValueError as error:
        print(f"recurrax bench: {error}", file=sys.stderr)
        return 2
    report = run(args, impls, kinds, argv)
    paths = write_outputs(report, args.out)
    print(summary(report, paths))
    failed = [r for r in report["records"] + report["target_records"] if r["status"] == "error"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
