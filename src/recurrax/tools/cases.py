"""The one maker of test and benchmark inputs, and the comparison against the reference.

Used by the tests, `recurrax check`, `recurrax bench` and every script in `benchmarks/`; the
last section does the same for `delta_rule` (`DeltaCase`, `make_delta_inputs`, `compare_delta`).

`assert_matches(name, case)` compares forward outputs, final state and every gradient (via
`jax.vjp` with random cotangents for both outputs) of an implementation against the
`reference` implementation run on the same inputs in float64 (when x64 is enabled), so a
float32 implementation is measured against the exact answer, not against float32 rounding.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

import recurrax

from recurrax._core.problem import Gate, canonicalize

GATE_ARGUMENTS = {
    "g_head": Gate.HEAD,
    "g_channel": Gate.KEY,
    "g_gamma": Gate.HEAD,
    "g_gamma_rows": Gate.HEAD,
    "gk": Gate.KEY,
    "gv": Gate.VALUE,
}
"""The public gate arguments a case can carry (`g` split by its shape, `g_gamma` as `[H]` or
one row per batch row / packed sequence) and the canonical `Gate` each folds into."""
GATES = ("g_head", "g_channel", "g_gamma", "gk", "gv")
GATE_COMBOS = ((), ("g_head",), ("g_channel",), ("g_gamma",), ("gk",), ("gv",), GATES)
GATE_PRESETS = {"none": (), "g": ("g_head",), "g_gamma": ("g_gamma",), "gk": ("gk",), "gk+gv": ("gk", "gv")}
"""The named gate sets of the benchmarks: no decay, per-head g, constant g_gamma, per-channel
gk, gk and gv."""
DIFF_ARGS = ("query", "key", "value", "g", "g_gamma", "gk", "gv", "initial_state")


@dataclasses.dataclass(frozen=True)
class Case:
    """One call of `recurrent`: shapes, gates, options. `cu_seqlens` implies packed B = 1."""

    B: int = 2
    T: int = 9
    H: int = 4
    Hkv: int = 2
    K: int = 8
    V: int = 6
    gates: tuple[str, ...] = ()
    reverse: bool = False
    initial_state: bool = True
    cu_seqlens: tuple[int, ...] | None = None
    packed_3d: bool = False
    dtype: str = "float64"
    gate_low: float = -1.0
    """With `gate_law="uniform"`, gates (log decays) are drawn uniformly from [gate_low, 0]."""
    scale: float | None = None
    gate_law: str = "uniform"
    """`"uniform"`, or `"log_sigmoid"`: `log_sigmoid(normal) / 16` (mostly −0.01 … −0.2, as
    GLA's gates; what the benchmarks use)."""
    Hqk: int | None = None
    """Query/key heads shared by groups of the H value heads (Mamba-2's layout; `Hkv` is then
    unused), or None: query with H heads, key and value with `Hkv`."""

    @classmethod
    def benchmark(cls, B: int, T: int, H: int, K: int, V: int, gates: str = "none", **overrides) -> Case:
        """A float32 benchmark case: `gates` one of `GATE_PRESETS`, realistic gates, no GQA,
        no initial state."""
        if gates not in GATE_PRESETS:
            raise ValueError(f"gates must be one of {list(GATE_PRESETS)}, got {gates!r}")
        fields = dict(B=B, T=T, H=H, Hkv=H, K=K, V=V, gates=GATE_PRESETS[gates], initial_state=False,
                      dtype="float32", gate_law="log_sigmoid")
        return cls(**{**fields, **overrides})


def make_inputs(case: Case, seed: int = 0) -> dict:
    """Random keyword arguments for `recurrax.recurrent` (as NumPy arrays)."""
    rng = np.random.default_rng(seed)
    dtype = case.dtype
    B, T = (1, case.cu_seqlens[-1]) if case.cu_seqlens else (case.B, case.T)
    lead = (T,) if case.packed_3d else (B, T)
    normal = lambda *shape: rng.standard_normal(shape)  # noqa: E731

    def gate(*shape):
        if case.gate_law == "log_sigmoid":
            return -np.logaddexp(0.0, -rng.standard_normal(shape)) / 16
        return rng.uniform(case.gate_low, 0.0, size=shape)

    query_heads, key_heads, value_heads = (case.H, case.Hkv, case.Hkv) if case.Hqk is None else (
        case.Hqk, case.Hqk, case.H)
    kwargs = dict(
        query=normal(*lead, query_heads, case.K),
        key=normal(*lead, key_heads, case.K),
        value=normal(*lead, value_heads, case.V),
        reverse=case.reverse,
        softmax_scale=case.scale,
    )
    if "g_head" in case.gates:
        kwargs["g"] = gate(*lead, case.H)
    if "g_channel" in case.gates:
        kwargs["g"] = gate(*lead, case.H, case.K)
    rows = len(case.cu_seqlens) - 1 if case.cu_seqlens else B
    if "g_gamma" in case.gates:
        kwargs["g_gamma"] = gate(case.H)
    if "g_gamma_rows" in case.gates:
        kwargs["g_gamma"] = gate(rows, case.H)
    if "gk" in case.gates:
        kwargs["gk"] = gate(*lead, case.H, case.K)
    if "gv" in case.gates:
        kwargs["gv"] = gate(*lead, case.H, case.V)
    if case.initial_state:
        kwargs["initial_state"] = normal(rows, case.H, case.K, case.V)
    if case.cu_seqlens:
        kwargs["cu_seqlens"] = np.asarray(case.cu_seqlens, np.int32)
    for name in DIFF_ARGS:
        if name in kwargs:
            kwargs[name] = jnp.asarray(kwargs[name], dtype)
    return kwargs


def split_args(kwargs: dict) -> tuple[dict, dict]:
    """(differentiable arrays, everything else)."""
    diff = {k: v for k, v in kwargs.items() if k in DIFF_ARGS}
    rest = {k: v for k, v in kwargs.items() if k not in DIFF_ARGS}
    return diff, rest


ARGUMENTS = tuple((name, False if name == "reverse" else None) for name in (
    "query", "key", "value", "g", "g_gamma", "gk", "gv", "softmax_scale", "initial_state", "reverse", "cu_seqlens"
))


def canonical(kwargs: dict):
    """`canonicalize` of `recurrent`'s keyword arguments, absent ones at their defaults:
    (problem, config, layout)."""
    return canonicalize(*(kwargs.get(name, default) for name, default in ARGUMENTS))


def call(implementation: str | Callable, **kwargs):
    """`recurrent` through a registered name, or straight through an algorithm function
    `fn(problem, *, scale, reverse)` (e.g. a `functools.partial` with a chunk size)."""
    if isinstance(implementation, str):
        return recurrax.recurrent(**kwargs, implementation=implementation)
    problem, config, layout = canonical(kwargs)
    output, final_state = implementation(problem, scale=config.scale, reverse=config.reverse)
    return layout.restore(output), final_state


def make_cotangents(case: Case, seed: int = 1) -> tuple:
    """Random `(d_output, d_final_state)` for `case`'s outputs, in the output dtypes."""
    rng = np.random.default_rng(seed)
    B, T = (1, case.cu_seqlens[-1]) if case.cu_seqlens else (case.B, case.T)
    lead = (T,) if case.packed_3d else (B, T)
    rows = len(case.cu_seqlens) - 1 if case.cu_seqlens else B
    state_dtype = jnp.promote_types(case.dtype, jnp.float32)
    d_output = jnp.asarray(rng.standard_normal((*lead, case.H, case.V)), case.dtype)
    return d_output, jnp.asarray(rng.standard_normal((rows, case.H, case.K, case.V)), state_dtype)


def run_vjp(implementation: str | Callable, kwargs: dict, seed: int = 1):
    """Forward outputs and the gradients of every differentiable argument (one jitted call)."""
    step, diff = vjp_step(implementation, kwargs, seed)
    return step(diff)


def vjp_step(implementation: str | Callable, kwargs: dict, seed: int = 1) -> tuple[Callable, dict]:
    """`run_vjp` as a jitted function of the differentiable arguments, and those arguments:
    `step(diff)` gives (output, final state, gradients)."""
    diff, rest = split_args(kwargs)

    def forward_backward(diff):
        (o, state), pullback = jax.vjp(lambda diff: call(implementation, **diff, **rest), diff)
        rng = np.random.default_rng(seed)
        do = jnp.asarray(rng.standard_normal(o.shape), o.dtype)
        dstate = jnp.asarray(rng.standard_normal(state.shape), state.dtype)
        (grads,) = pullback((do, dstate))
        return o, state, grads

    return jax.jit(forward_backward), diff


def max_rel_error(x, y, floor: float = 1e-30) -> float:
    """max |x − y| / max(max |y|, floor): a scale-aware error."""
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    return float(np.max(np.abs(x - y)) / max(np.max(np.abs(y)), floor)) if y.size else 0.0


ZERO_FLOOR = 1e-6
"""An array whose exact value is (near) zero — a gate gradient with nothing to decay, e.g. one
token and no initial state — is judged against `ZERO_FLOOR` times the largest reference
array of the same call instead of its own vanishing scale: rounding of O(1) terms that
cancel exactly is no error, while any real one still shows up as O(1) / 1e-6."""


def _exact(kwargs: dict) -> dict:
    """The same inputs in float64 when x64 is on (the oracle's precision), else unchanged."""
    if not jax.config.jax_enable_x64:
        return kwargs
    return {k: (v.astype(jnp.float64) if k in DIFF_ARGS else v) for k, v in kwargs.items()}


def compare(implementation: str | Callable, case: Case, seed: int = 0, oracle: str = "reference") -> dict[str, float]:
    """Max relative errors of `implementation` vs `oracle` (in float64), per output and gradient."""
    kwargs = make_inputs(case, seed)
    return compare_results(run_vjp(implementation, kwargs), oracle_results(kwargs, oracle), kwargs)


def oracle_results(kwargs: dict, oracle: str = "reference"):
    """`oracle`'s (output, final state, gradients) on `kwargs` in float64 (x64 on)."""
    return run_vjp(oracle, _exact(kwargs))


def compare_results(results, exact, kwargs: dict) -> dict[str, float]:
    """Max relative errors of `run_vjp`'s `results` on `kwargs` against the `exact` ones; the
    gradients must have their arguments' dtypes and shapes (an `AssertionError` otherwise)."""
    o, _, grads = results
    for name, grad in grads.items():
        assert grad.dtype == kwargs[name].dtype, (name, grad.dtype)
        assert grad.shape == kwargs[name].shape, (name, grad.shape)
    assert o.dtype == kwargs["query"].dtype
    return relative_errors(results, exact)


def relative_errors(results, exact) -> dict[str, float]:
    """Max relative errors of (output, final state, gradients) against the `exact` ones, an
    array near zero judged against `ZERO_FLOOR` times the largest exact array."""
    (o, state, grads), (o_ref, state_ref, grads_ref) = results, exact
    scale = max(float(np.max(np.abs(np.asarray(y, np.float64)), initial=0.0)) for y in (o_ref, state_ref, *grads_ref.values()))
    floor = max(ZERO_FLOOR * scale, 1e-30)
    errors = {"output": max_rel_error(o, o_ref, floor), "final_state": max_rel_error(state, state_ref, floor)}
    errors.update({"d" + name: max_rel_error(grads[name], grads_ref[name], floor) for name in grads})
    return errors


def default_tolerance(dtype: str) -> float:
    """Scale-relative tolerance vs the float64 reference, by input dtype."""
    return {"float64": 1e-9, "float32": 2e-4, "float16": 2e-2, "bfloat16": 5e-2}[dtype]


def assert_matches(implementation: str | Callable, case: Case, tol: float | None = None, seed: int = 0) -> None:
    """Every output and gradient within `tol` (scale-relative) of the reference."""
    tol = tol if tol is not None else default_tolerance(case.dtype)
    errors = compare(implementation, case, seed)
    bad = {k: v for k, v in errors.items() if not v <= tol}
    assert not bad, f"{implementation} vs reference on {case}: {bad} (tol {tol})"


# ----------------------------------------------------------------------------- the delta rule


@dataclasses.dataclass(frozen=True)
class DeltaCase:
    """One call of `delta_rule`: shapes, gates (`"g"` per head, `"gk"` per key channel),
    options. `cu_seqlens` implies packed B = 1; `Hqk` query/key heads shared by the H value heads."""

    gates: tuple[str, ...] = ()
    B: int = 2
    T: int = 19
    Hqk: int = 2
    H: int = 2
    K: int = 8
    V: int = 4
    initial_state: bool = True
    cu_seqlens: tuple[int, ...] | None = None
    beta_range: tuple[float, float] = (0.0, 1.0)
    gate_range: tuple[float, float] = (-1.0, 0.0)
    qk_l2norm: bool = False
    scale: float | None = None

    def __str__(self):
        fields = [f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self)
                  if getattr(self, f.name) != f.default]
        return ",".join(fields) or "plain"


DELTA_DIFF_ARGS = ("query", "key", "value", "beta", "g", "gk", "initial_state")

DELTA_PRESETS = {"delta": (), "delta_g": ("g",), "delta_gk": ("gk",)}
"""The benchmarks' delta-rule kinds: DeltaNet (no gate), Gated DeltaNet (per-head g) and KDA
(per-channel gk), each with `qk_l2norm=True`, β ∈ [0, 1] and gates in [−0.1, 0]."""


def delta_benchmark_inputs(B: int, T: int, H: int, K: int, V: int, kind: str, dtype: str = "float32",
                           seed: int = 0) -> dict:
    """`delta_rule`'s arrays for the benchmark kind `kind` (a key of `DELTA_PRESETS`): no
    grouped heads, no initial state, in `dtype`."""
    case = DeltaCase(gates=DELTA_PRESETS[kind], B=B, T=T, Hqk=H, H=H, K=K, V=V, initial_state=False,
                     gate_range=(-0.1, 0.0), qk_l2norm=True)
    return {n: jnp.asarray(x, dtype) for n, x in make_delta_inputs(case, seed).items()}


def make_delta_inputs(case: DeltaCase, seed: int = 0) -> dict:
    """float64 NumPy arrays of `delta_rule` (the array arguments only; `cu_seqlens`, `qk_l2norm`
    and the scale are the case's). Without `qk_l2norm` the keys are unit vectors (then
    I − β k kᵀ is a contraction for β ∈ [0, 2] and the state stays bounded); with β's range
    reaching 2, one β is exactly 2."""
    rng = np.random.default_rng(seed)
    B = 1 if case.cu_seqlens is not None else case.B
    lead = (B, case.T)
    q = rng.normal(size=(*lead, case.Hqk, case.K))
    k = rng.normal(size=(*lead, case.Hqk, case.K))
    if not case.qk_l2norm:
        k /= np.linalg.norm(k, axis=-1, keepdims=True)
    args = dict(query=q, key=k, value=rng.normal(size=(*lead, case.H, case.V)),
                beta=rng.uniform(*case.beta_range, size=(*lead, case.H)))
    if case.beta_range[1] == 2.0:
        args["beta"][..., 0, 0] = 2.0
    low, high = case.gate_range
    if "g" in case.gates:
        args["g"] = rng.uniform(low, high, size=(*lead, case.H))
    if "gk" in case.gates:
        args["gk"] = rng.uniform(low, high, size=(*lead, case.H, case.K))
    rows = B if case.cu_seqlens is None else len(case.cu_seqlens) - 1
    if case.initial_state:
        args["initial_state"] = 0.5 * rng.normal(size=(rows, case.H, case.K, case.V))
    return args


def delta_options(case: DeltaCase) -> dict:
    """`delta_rule`'s non-array keyword arguments for `case`."""
    options = dict(qk_l2norm=case.qk_l2norm, softmax_scale=case.scale)
    if case.cu_seqlens is not None:
        options["cu_seqlens"] = jnp.asarray(case.cu_seqlens, jnp.int32)
    return options


def delta_forward_backward(implementation: str, arrays: dict, options: dict, seed: int = 1):
    """`delta_rule`'s output, final state and the gradients of every array argument for random
    cotangents (traceable: jit it)."""
    (o, state), pullback = jax.vjp(
        lambda arrays: recurrax.delta_rule(**arrays, **options, implementation=implementation), arrays)
    rng = np.random.default_rng(seed)
    do = jnp.asarray(rng.standard_normal(o.shape), o.dtype)
    dstate = jnp.asarray(rng.standard_normal(state.shape), state.dtype)
    return o, state, pullback((do, dstate))[0]


def delta_vjp(implementation: str, arrays: dict, options: dict, seed: int = 1):
    """`delta_forward_backward` as one jitted call."""
    return delta_vjp_step(implementation, options, seed)(arrays)


def delta_vjp_step(implementation: str, options: dict, seed: int = 1) -> Callable:
    """`delta_forward_backward` jitted, as a function of the arrays."""
    return jax.jit(lambda arrays: delta_forward_backward(implementation, arrays, options, seed))


def delta_oracle_results(case: DeltaCase, seed: int = 0):
    """The delta rule's `reference` (output, final state, gradients) on `case`'s inputs in float64 (x64 on)."""
    arrays = {n: jnp.asarray(x, jnp.float64) for n, x in make_delta_inputs(case, seed).items()}
    return delta_vjp("reference", arrays, delta_options(case))


def compare_delta(implementation: str, case: DeltaCase, dtype: str = "float32", seed: int = 0) -> dict[str, float]:
    """Max relative errors of `implementation` on `dtype` inputs vs the delta rule's
    `reference` on the same inputs in float64 (x64 on), per output and gradient (judged as
    `compare` judges them)."""
    arrays = {n: jnp.asarray(x, dtype) for n, x in make_delta_inputs(case, seed).items()}
    results = delta_vjp(implementation, arrays, delta_options(case))
    return relative_errors(results, delta_oracle_results(case, seed))
