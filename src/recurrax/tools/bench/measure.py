"""Measuring one implementation on one input: compile, read memory, time.

For each registered implementation (default: reference for short inputs, scan, chunk), each
gate kind and each sequence length, two programs are compiled and timed:

| mode    | program                                                                  | model FLOPs   |
|---------|--------------------------------------------------------------------------|---------------|
| fwd     | `jit(recurrent)` returning `(output, final_state)`                       | 4·B·T·H·K·V   |
| fwd+bwd | `jit(value_and_grad(loss))` wrt query, key, value and every gate, where   | 12·B·T·H·K·V  |
|         | `loss = <output, d_output> + <final_state, d_state>` (random cotangents) |               |

The gate kinds `delta`, `delta_g`, `delta_gk` (`cases.DELTA_PRESETS`) measure
`recurrax.delta_rule` instead (DeltaNet, Gated DeltaNet, KDA; `qk_l2norm=True`; gradients
also wrt `beta`), with the implementations of its own registry, and model FLOPs 6·B·T·H·K·V
forward, 18·B·T·H·K·V forward and backward: per token and head the decay (K·V), the read
Sᵀk (2·K·V), the rank-one write (2·K·V) and the output (2·K·V), rounded up to 6·K·V, tripled
for the backward as for `recurrent`. These are the recurrence's FLOPs, not the chunk
algorithm's (which does more: its C×C products and triangular solve).

Compilation is not timed; a measurement is the median of `--repeats` runs, each ended by
`jax.block_until_ready`. Model-FLOP utilisation (MFU) divides model FLOPs per second by this
machine's float32 matmul peak, measured in the same run (a jitted `jnp.dot` of two square
float32 matrices, before and after the grid; the higher figure is used). Memory comes from
XLA's compiled memory analysis (`temp_size_in_bytes`, `peak_memory_in_bytes`, argument and
output sizes): it needs no run.

`--max-seconds` bounds each measurement: one run is timed first; if it exceeds the budget it
is the only sample, and a longer sequence is skipped (recorded as such, memory still
reported) whenever one run there is predicted, linearly in T, to exceed the budget.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

import recurrax

from ..cases import DELTA_PRESETS, GATE_PRESETS, Case, delta_benchmark_inputs, make_cotangents, make_inputs
from .machine import seconds_of

MODES = ("fwd", "fwd+bwd")

FLOPS_PER_ELEMENT = {"fwd": 4, "fwd+bwd": 12}
"""Model FLOPs per B·T·H·K·V: forward 4, forward and backward 12."""
DELTA_FLOPS_PER_ELEMENT = {"fwd": 6, "fwd+bwd": 18}
"""The delta rule's model FLOPs per B·T·H·K·V (see the module docstring)."""

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
    - `dtype`: dtype of the inputs (`"float32"` or `"bfloat16"`).
    """

    repeats: int
    max_seconds: float
    reference_max_len: int
    seed: int = 0
    dtype: str = "float32"

def model_flops(shape: Shape, mode: str, kind: str = "none") -> int:
    """Model FLOPs of one call: 4·B·T·H·K·V forward, 12·B·T·H·K·V forward and backward (the
    delta rule's kinds: 6 and 18)."""
    elements = shape.batch * shape.seq_len * shape.heads * shape.qk_dim * shape.v_dim
    return (DELTA_FLOPS_PER_ELEMENT if kind in DELTA_PRESETS else FLOPS_PER_ELEMENT)[mode] * elements

def utilisation(flops: float, seconds: float, peak_flops_per_s: float) -> float:
    """Model-FLOP utilisation: achieved FLOP/s as a fraction of the peak."""
    return flops / seconds / peak_flops_per_s

def predicted_seconds(seconds: float, from_len: int, to_len: int) -> float:
    """One run's time at `to_len`, extrapolated linearly in the sequence length."""
    return seconds * to_len / from_len


def make_arguments(shape: Shape, kind: str, seed: int, dtype: str = "float32") -> tuple[tuple, tuple]:
    """Random `(query, key, value, gates)` in `dtype` and cotangents `(d_output, d_state)` from
    the one input maker (`recurrax.tools.cases`), for the gate preset `kind`."""
    sizes = (shape.batch, shape.seq_len, shape.heads, shape.qk_dim, shape.v_dim)
    cotangents = make_cotangents(Case.benchmark(*sizes, dtype=dtype), seed + 1)
    if kind in DELTA_PRESETS:
        inputs = delta_benchmark_inputs(*sizes, kind, dtype, seed)
        gates = {name: inputs[name] for name in ("beta", "g", "gk") if name in inputs}
        return (inputs["query"], inputs["key"], inputs["value"], gates), cotangents
    inputs = make_inputs(Case.benchmark(*sizes, kind, dtype=dtype), seed)
    gates = {name: inputs[name] for name in ("g", "g_gamma", "gk", "gv") if name in inputs}
    return (inputs["query"], inputs["key"], inputs["value"], gates), cotangents


def forward_program(impl: str, kind: str = "none") -> Callable:
    """`(query, key, value, gates) -> (output, final_state)` with `impl`: `recurrent`, or
    `delta_rule` (with `qk_l2norm`) for the delta kinds, whose `gates` hold `beta`."""

    def forward(query, key, value, gates):
        if kind in DELTA_PRESETS:
            return recurrax.delta_rule(query, key, value, **gates, qk_l2norm=True, implementation=impl)
        return recurrax.recurrent(query, key, value, **gates, implementation=impl)

    return forward

def forward_backward_program(impl: str, kind: str = "none") -> Callable:
    """`(query, key, value, gates, d_output, d_state) -> (loss, grads)` with `impl`.

    The loss pairs both outputs with fixed random cotangents, so the backward sees the
    general case; grads cover query, key, value and every gate.
    """
    forward = forward_program(impl, kind)

    def loss(query, key, value, gates, d_output, d_state):
        output, final_state = forward(query, key, value, gates)
        return jnp.vdot(output, d_output) + jnp.vdot(final_state, d_state)

    return jax.value_and_grad(loss, argnums=(0, 1, 2, 3))

def program_and_arguments(impl: str, mode: str, primals: tuple, cotangents: tuple,
                          kind: str = "none") -> tuple[Callable, tuple]:
    """The function to compile for `mode` and the arguments it takes."""
    if mode == "fwd":
        return forward_program(impl, kind), primals
    return forward_backward_program(impl, kind), primals + cotangents

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
    """Whether `error` is a registry refusing the call (rather than a failure): a declared
    refusal, or a name the delta rule's registry does not hold (e.g. a kernel of `recurrent`
    asked for a delta kind)."""
    message = str(error)
    return isinstance(error, ValueError) and ("cannot run this call" in message or "implementation must be one of" in message)

def measure(
    impl: str, kind: str, shape: Shape, mode: str, settings: Settings, *, run: bool = True, skip_reason: str = ""
) -> dict[str, Any]:
    """Compile one program, read its memory, and (when `run`) time it. One record."""
    record: dict[str, Any] = {"impl": impl, "gates": kind, "mode": mode, **dataclasses.asdict(shape),
                              "dtype": settings.dtype}
    record["model_flops"] = model_flops(shape, mode, kind)
    primals, cotangents = make_arguments(shape, kind, settings.seed, settings.dtype)
    function, arguments = program_and_arguments(impl, mode, primals, cotangents, kind)
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
    impls: Sequence[str], kinds: Sequence[str], base: Shape, seq_lens: Sequence[int], settings: Settings, progress,
    on_record: Callable[[dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """Every measurement of the grid, in order; updates the `progress` bar and calls
    `on_record` (to save it at once) per measurement."""
    records, last_runs = [], {}
    for seq_len, kind, impl in grid_cells(impls, kinds, seq_lens, settings):
        for mode in MODES:
            progress.set_postfix_str(f"{impl} {kind} T={seq_len} {mode}")
            reason = budget_skip(last_runs.get((impl, kind, mode)), seq_len, settings)
            record = measure(impl, kind, base.with_seq_len(seq_len), mode, settings, run=not reason, skip_reason=reason)
            if record["status"] == "ok":
                last_runs[(impl, kind, mode)] = (seq_len, record["first_s"])
            records.append(record)
            if on_record is not None:
                on_record(record)
            progress.update()
    return records

def grid_size(impls: Sequence[str], kinds: Sequence[str], seq_lens: Sequence[int], settings: Settings) -> int:
    """How many measurements `run_grid` makes."""
    return len(MODES) * sum(1 for _ in grid_cells(impls, kinds, seq_lens, settings))
