"""The canonical form of a `delta_rule` call: `recurrent`'s validation plus the write strength β.

The array arguments go through `recurrax.problem`'s own checks (shapes, dtypes, gate signs,
`cu_seqlens`, the packed layout), so a mistake reads the same as it does for `recurrent`;
what the delta rule adds is checked here: `beta` (its shape, and values in [0, 2]), query
and key with the same heads (no grouped key/value heads), and `qk_l2norm`, folded into the
query and key at the interface. What leaves this module is a `DeltaProblem`:

| field            | shape           | dtype                    | meaning                                  |
|------------------|-----------------|--------------------------|------------------------------------------|
| query            | [B, T, Hqk, K]  | input dtype              | Hqk divides H: value head h reads h // (H / Hqk) |
| key              | [B, T, Hqk, K]  | input dtype              | (l2-normalised when `qk_l2norm`)         |
| value            | [B, T, H, V]    | input dtype              |                                          |
| beta             | [B, T, H]       | state dtype              | write strength β_t ∈ [0, 2]              |
| log_decay_head   | [B, T, H]       | state dtype, or None     | per-head `g`                             |
| log_decay_key    | [B, T, H, K]    | state dtype, or None     | per-key-channel `gk` (and a per-channel `g`) |
| initial_state    | [R, H, K, V]    | state dtype              | R = B, or S sequences when packed        |
| cu_seqlens       | [S + 1]         | int32, or None           | packed input: then B == 1                |

The state dtype is float32, or float64 for float64 inputs. Non-finite inputs are guarded as
`recurrent`'s are (`_finite`): their effect is causal, a NaN β included.

Stability: with β‖k‖² ≤ 2 for every token (unit keys, `qk_l2norm`, and β ∈ [0, 2]) the update
I − β k kᵀ is non-expansive; above it the state can grow without bound. `check_update` warns
for concrete arguments, `runtime_checks()` checks traced ones.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from .._core.problem import (
    Gate,
    Layout,
    _concrete,
    _fail,
    _opaque,
    _scale,
    _token_array,
    _validated,
    runtime_checks_enabled,
)

BETA_RANGE = (0.0, 2.0)
"""β's closed range: with a unit key, I − β k kᵀ is then a contraction (eigenvalue 1 − β)."""

L2NORM_EPS = 1e-6
"""qk_l2norm: x · rsqrt(Σ x² + ε) per head, in float32."""


class DeltaProblem(NamedTuple):
    """The canonical form every delta-rule algorithm receives.

    **Arguments:**
    - `query`, `key`: `[B, T, Hqk, K]` in the input dtype (l2-normalised when `qk_l2norm`).
    - `value`: `[B, T, H, V]`, Hqk dividing H (value head h reads query/key head h // (H / Hqk)).
    - `beta`: `[B, T, H]` write strengths in [0, 2], in the state dtype.
    - `log_decay_head`: `[B, T, H]` or None; `log_decay_key`: `[B, T, H, K]` or None.
    - `initial_state`: `[R, H, K, V]` in the state dtype (float32, float64 for float64 inputs);
      R = B, or the number of packed sequences.
    - `cu_seqlens`: `[S + 1]` int32 when packed (then B = 1), or None.
    """

    query: Float[Array, "B T Hqk K"]
    key: Float[Array, "B T Hqk K"]
    value: Float[Array, "B T H V"]
    beta: Float[Array, "B T H"]
    log_decay_head: Float[Array, "B T H"] | None
    log_decay_key: Float[Array, "B T H K"] | None
    initial_state: Float[Array, "R H K V"]
    cu_seqlens: Int[Array, " S_plus_1"] | None

    @property
    def state_dtype(self):
        return self.initial_state.dtype

    @property
    def gates(self) -> frozenset[Gate]:
        """The decay kinds present (what the registry's `Support` judges)."""
        fields = {Gate.HEAD: self.log_decay_head, Gate.KEY: self.log_decay_key}
        return frozenset(kind for kind, x in fields.items() if x is not None)

    def key_side_decay(self) -> Float[Array, "B T H K"] | Float[Array, "B T H"] | None:
        """The log decay a_t: [B, T, H] when only per-head, [B, T, H, K] with a per-channel term
        (the per-head one then broadcast over K), None when there is none."""
        head, key = self.log_decay_head, self.log_decay_key
        if key is None:
            return head
        return key if head is None else key + head[..., None]

    def expanded_query_key(self) -> tuple[Array, Array]:
        """Query and key in the state dtype, repeated to every value head: [B, T, H, K] each."""
        groups = self.value.shape[2] // self.query.shape[2]
        return tuple(jnp.repeat(x.astype(self.state_dtype), groups, axis=2) for x in (self.query, self.key))


def l2_normalised(x: Array) -> Array:
    """x · rsqrt(Σ x² + ε) over the last axis, computed in float32 (float64 stays), returned in
    x's dtype."""
    wide = x.astype(jnp.promote_types(x.dtype, jnp.float32))
    return (wide * jax.lax.rsqrt(jnp.sum(wide * wide, axis=-1, keepdims=True) + L2NORM_EPS)).astype(x.dtype)


def check_beta(beta: object) -> None:
    """Refuse a concrete `beta` with a value outside [0, 2] (traced ones: `runtime_checks`).

    A NaN is not out of range: like a NaN in any input it is a non-finite value, whose effect
    stays causal (`_finite`); the range is judged on the other values."""
    if not (_concrete(beta) and jnp.issubdtype(beta.dtype, jnp.floating) and np.size(beta)):
        return
    values = np.asarray(beta, np.float64)
    if np.isnan(values).all():
        return
    low, high = float(np.nanmin(values)), float(np.nanmax(values))
    if low < BETA_RANGE[0] or high > BETA_RANGE[1]:
        raise ValueError(f"beta must lie in [0, 2] (the write strength), got values in [{low:.6g}, {high:.6g}]")


def _runtime_check_beta(beta: Array) -> None:
    from jax.experimental import checkify

    if isinstance(beta, jax.core.Tracer):
        low, high = jnp.nanmin(beta), jnp.nanmax(beta)
        ok = ~(low < BETA_RANGE[0]) & ~(high > BETA_RANGE[1])  # all NaN: nothing out of range
        checkify.check(ok, "beta must lie in [0, 2], got values in [{}, {}]", low, high)


CONTRACTION_BOUND = 2.0
"""β‖k‖² above this makes the update expansive: I − β k kᵀ has the eigenvalue 1 − β‖k‖² < −1
along k, and a state with a component along k grows (`check_update`)."""


class ExpansiveUpdateWarning(RuntimeWarning):
    """The keys and β of a `delta_rule` call make the state update expansive (β‖k‖² > 2)."""


def largest_write(key: Array, beta: Array) -> Array:
    """max over tokens and heads of β‖k‖², query/key heads shared by groups of value heads
    (key [..., Hqk, K] and beta [..., H] with the same leading axes); NaNs ignored."""
    squared = jnp.sum(jnp.square(key.astype(beta.dtype)), axis=-1)  # [..., Hqk]
    groups = beta.shape[-1] // squared.shape[-1]
    return jnp.nanmax(beta.reshape(*beta.shape[:-1], squared.shape[-1], groups) * squared[..., None])


def _expansive_message(largest) -> str:
    return (f"beta·‖key‖² reaches {largest:.6g} > 2: the delta rule's update I − β k kᵀ is then expansive "
            "and the state can grow without bound. Normalise the keys (qk_l2norm=True, or scale them to "
            "norm ≤ 1 as the models do) or keep β‖k‖² ≤ 2")


def check_update(key: object, beta: object, qk_l2norm: bool) -> None:
    """Warn (`ExpansiveUpdateWarning`) when concrete keys and β make the update expansive,
    β‖k‖² > 2 for some token; one reduction on the device and one number read back. With
    `qk_l2norm` the keys have norm ≤ 1 and β ≤ 2: nothing to check. Traced values are checked
    under `recurrax.runtime_checks()`, as an error."""
    if qk_l2norm or not (_concrete(key) and _concrete(beta)) or not (np.size(key) and np.size(beta)):
        return
    with jax.ensure_compile_time_eval():  # concrete arrays met while tracing a caller: eager
        largest = float(largest_write(jnp.asarray(key), jnp.asarray(beta)))
    if largest > CONTRACTION_BOUND:
        import warnings

        warnings.warn(_expansive_message(largest), ExpansiveUpdateWarning, stacklevel=3)


def _runtime_check_update(key: Array, beta: Array) -> None:
    from jax.experimental import checkify

    if isinstance(key, jax.core.Tracer) or isinstance(beta, jax.core.Tracer):
        largest = largest_write(key, beta)
        checkify.check(~(largest > CONTRACTION_BOUND),
                       "beta·‖key‖² reaches {} > 2: the delta rule's update is expansive (use qk_l2norm=True or "
                       "keys of norm ≤ 1)", largest)


def _same_heads(query: object, key: object) -> None:
    """Query and key with one head count (checked first: `recurrent`'s validation would read
    fewer key heads as grouped key/value heads)."""
    shapes = [getattr(x, "shape", ()) for x in (query, key)]
    if min(map(len, shapes)) >= 3 and shapes[1][-2] != shapes[0][-2]:
        _fail("key", f"of the query's head count {query.shape[-2]} (the delta rule shares query and key heads)",
              f"{key.shape[-2]} heads")


def canonicalize_delta(
    query, key, value, beta, g, gk, softmax_scale, initial_state, cu_seqlens, qk_l2norm,
    allow_positive_gates: bool = False,
) -> tuple[DeltaProblem, float, Layout]:
    """Validate `delta_rule`'s arguments: the canonical `DeltaProblem`, the scale and the layout."""
    _same_heads(query, key)
    problem, packed_3d = _validated(query, key, value, g, None, gk, None, initial_state, cu_seqlens,
                                    allow_positive_gates)
    B, T, _, K = problem.query.shape
    H = problem.value.shape[2]
    packed = cu_seqlens is not None
    beta = _token_array("beta", beta, "[batch, seq_len, num_heads]", (B, T, H), packed, problem.query.shape)
    check_beta(beta)
    if runtime_checks_enabled():
        _runtime_check_beta(beta)
        if not qk_l2norm:
            _runtime_check_update(problem.key, _opaque(beta))
    if not isinstance(qk_l2norm, (bool, np.bool_)):
        _fail("qk_l2norm", "a Python bool (static configuration)", type(qk_l2norm).__name__, TypeError)
    q, k = problem.query, problem.key
    if qk_l2norm:
        q, k = l2_normalised(q), l2_normalised(k)
    delta = DeltaProblem(
        query=q,
        key=k,
        value=problem.value,
        beta=_opaque(beta).astype(problem.initial_state.dtype),
        log_decay_head=problem.log_decay_head,
        log_decay_key=problem.log_decay_key,
        initial_state=problem.initial_state,
        cu_seqlens=problem.cu_seqlens,
    )
    return delta, _scale(softmax_scale, K), Layout(packed_3d)
