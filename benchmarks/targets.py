"""The speed and memory targets of the XLA chunk algorithm's work item (issue 3), measured
with `recurrax.tools.bench`: `benchmarks/run.py` adds them to the committed results.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from recurrax.registry import kernel_registry
from recurrax.tools.bench.measure import MiB, Settings, Shape, add_utilisation, measure

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

def targets_markdown(targets: Sequence[Target], shape: Shape, quick: bool) -> list[str]:
    """The targets section: one line per target with pass/fail."""
    lines = [f"## Targets (issue 3; f32, {shape.words()})", ""]
    if quick:
        lines += ["**Quick run: reduced shapes, not the targets' shapes — the verdicts mean nothing.**", ""]
    lines += ["| target | impl | measured | required | result | note |", "|---|---|---:|---:|---|---|"]
    for t in targets:
        lines.append(f"| {t.name} | {t.impl} | {t.formatted(t.value)} | {t.requirement()} | {t.verdict} | {t.note} |")
    return lines + [""]


def add_targets(report: dict[str, Any], impl: str, quick: bool) -> None:
    """Measure the targets for `impl` (shapes by `quick`) and add their records and their
    markdown section to a `recurrax bench` report (MFU against the report's matmul peak)."""
    settings = Settings(**report["settings"])
    shape = QUICK_TARGET_SHAPE if quick else TARGET_SHAPE
    memory_shape = QUICK_MEMORY_TARGET_SHAPE if quick else MEMORY_TARGET_SHAPE
    with tqdm(total=target_measurements(impl), desc="targets", unit="measurement", dynamic_ncols=True) as progress:
        by_role = run_targets(impl, shape, memory_shape, settings, progress)
    peak = report["peak_flops_per_s"]
    by_role = {role: None if r is None else add_utilisation(r, peak) for role, r in by_role.items()}
    targets = judge_targets(by_role, memory_shape)
    report["targets"] = [dataclasses.asdict(t) for t in targets]
    report["extra_records"] += [r for r in by_role.values() if r is not None]
    report["sections"].append("\n".join(targets_markdown(targets, shape, quick)))
