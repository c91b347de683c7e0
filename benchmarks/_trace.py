"""Reading one traced run of a program on the device back, without xprof: the device's self time
per kind of XLA op and per op (`jax.profiler.trace`, then `jax.profiler.ProfileData`), for the TPU
benchmarks (`tpu_train.py`, `tpu_generate.py`)."""

from __future__ import annotations

import collections
import glob
import re
import tempfile

import jax


def traced_ops(run, step_seconds: float, most: int = 12) -> dict:
    """One step under `jax.profiler.trace`, read back with `jax.profiler.ProfileData`: the device's
    self time (an op's time less the ops nested in it, e.g. a scanned layer's `while` less its body)
    per kind of op (`kind_of_op`) and of the `most` longest ops, each as a share of the timed step, and
    how many ops of each kind ran (`kind_count`: a loop's body counts once per iteration)."""
    directory = tempfile.mkdtemp()
    with jax.profiler.trace(directory):
        jax.block_until_ready(run())
    (path,) = glob.glob(f"{directory}/**/*.xplane.pb", recursive=True)
    by_kind, by_op, count = collections.Counter(), collections.Counter(), collections.Counter()
    for plane in jax.profiler.ProfileData.from_file(path).planes:
        if not plane.name.startswith("/device:"):
            continue
        for line in (line for line in plane.lines if line.name == "XLA Ops"):
            for text, seconds in self_times(line.events):
                name = text.split(" = ")[0].strip()
                by_kind[kind_of_op(text)] += seconds
                count[kind_of_op(text)] += 1
                by_op[f"{name} ({kind_of_op(text)})"] += seconds
    return {"device_s": sum(by_kind.values()),
            "kind_share": {k: v / step_seconds for k, v in by_kind.most_common()},
            "op_share": {k: v / step_seconds for k, v in by_op.most_common(most)},
            "kind_count": {k: count[k] for k, _ in by_kind.most_common()}}


def self_times(events) -> list[tuple[str, float]]:
    """(name, seconds) of each event less the events nested inside it (same line, within its span)."""
    ordered = sorted(events, key=lambda e: (e.start_ns, -e.duration_ns))
    own = [e.duration_ns for e in ordered]
    open_spans: list[int] = []  # indices of the events that enclose the current one
    for i, event in enumerate(ordered):
        while open_spans and ordered[open_spans[-1]].end_ns <= event.start_ns:
            open_spans.pop()
        if open_spans:
            own[open_spans[-1]] -= event.duration_ns
        open_spans.append(i)
    return [(e.name, max(t, 0) * 1e-9) for e, t in zip(ordered, own)]


def kind_of_op(text: str) -> str:
    """An XLA op's kind from its HLO text: a Pallas kernel's name, `matmul` for a convolution (fusion),
    else its opcode (a fusion with its fusion kind)."""
    if "custom_call_target=" in text:
        name = text.split(" = ")[0].lstrip("%").rsplit(".", 1)[0]
        return f"kernel {name}" if "tpu_custom_call" in text else f"custom-call {name}"
    if "convolution" in text.split(" = ")[0] or " convolution(" in text:
        return "matmul"
    opcode = re.search(r"\s([a-z][\w-]*)\(", text.split(" = ", 1)[-1])
    opcode = opcode.group(1) if opcode else "?"
    kind = re.search(r"kind=(k\w+)", text)
    return f"{opcode} {kind.group(1)}" if opcode == "fusion" and kind else opcode
