"""Validation and normalisation of `recurrent`'s arguments into one canonical form.

Everything a user can get wrong is caught here, at trace time, with a `ValueError` or
`TypeError` naming the argument, the expected shape in words and what came. What leaves
this module is a `Problem` that every algorithm takes as it is:

| field            | shape           | dtype                    | meaning                                  |
|------------------|-----------------|--------------------------|------------------------------------------|
| query            | [B, T, H, K]    | input dtype              |                                          |
| key              | [B, T, H, K]    | input dtype              | grouped heads already expanded to H      |
| value            | [B, T, H, V]    | input dtype              | grouped heads already expanded to H      |
| log_decay_head   | [B, T, H]       | state dtype, or None     | per-head g plus g_gamma                  |
| log_decay_key    | [B, T, H, K]    | state dtype, or None     | per-channel g plus gk                    |
| log_decay_value  | [B, T, H, V]    | state dtype, or None     | gv                                       |
| initial_state    | [R, H, K, V]    | state dtype              | R = B, or S sequences when packed        |
| cu_seqlens       | [S + 1]         | int32, or None           | packed input: then B == 1                |

The key-side log decay of token t is `log_decay_head[t, h] + log_decay_key[t, h, :]`
(absent terms are zero and never materialised); the value-side one is
`log_decay_value[t, h, :]`. The state dtype is float32, or float64 for float64 inputs.
Gradients with respect to the user's arguments (head grouping, gate sums, dtype casts,
g_gamma's broadcast) come from JAX's autodiff of this normalisation.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from .registry import Request, current_backend


class Problem(NamedTuple):
    """The canonical form every algorithm receives (see the module docstring)."""

    query: Float[Array, "B T H K"]
    key: Float[Array, "B T H K"]
    value: Float[Array, "B T H V"]
    log_decay_head: Float[Array, "B T H"] | None
    log_decay_key: Float[Array, "B T H K"] | None
    log_decay_value: Float[Array, "B T H V"] | None
    initial_state: Float[Array, "R H K V"]
    cu_seqlens: Int[Array, " S_plus_1"] | None


@dataclasses.dataclass(frozen=True)
class Config:
    """Static configuration of a call."""

    scale: float
    reverse: bool


@dataclasses.dataclass(frozen=True)
class Layout:
    """How the caller laid out the token axis, to shape the output the same way."""

    packed_3d: bool

    def restore(self, output: Array) -> Array:
        return output[0] if self.packed_3d else output


_QUERY = "[batch, seq_len, num_heads, qk_head_dim]"
_KEY = "[batch, seq_len, num_kv_heads, qk_head_dim]"
_VALUE = "[batch, seq_len, num_kv_heads, v_head_dim]"


def _fail(name: str, expected: str, got: object, error: type[Exception] = ValueError):
    raise error(f"{name} must be {expected}, got {got}")


def _floating(name: str, x: object) -> Array:
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        _fail(name, "a JAX or NumPy array", type(x).__name__, TypeError)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        _fail(name, "a floating-point array", f"dtype {x.dtype}", TypeError)
    return jnp.asarray(x)


def _shape_words(words: str, packed: bool) -> str:
    if not packed:
        return words
    inner = words.replace("batch, seq_len", "total_tokens")
    return f"{inner} or [1, {inner[1:]} (packed, with cu_seqlens)"


def _token_array(name: str, x: object, words: str, expected: tuple, packed: bool) -> Array:
    """Check a per-token array against `expected` ([B, T, ...] with None for 'any')."""
    x = _floating(name, x)
    if packed and x.ndim == len(expected) - 1:
        x = x[None]
    if x.ndim != len(expected) or any(e is not None and e != s for e, s in zip(expected, x.shape)):
        _fail(name, f"{_shape_words(words, packed)} = {_describe(expected)}", f"shape {tuple(x.shape)}")
    return x


def _describe(expected: tuple) -> str:
    return "[" + ", ".join("?" if e is None else str(e) for e in expected) + "]"


def _query(query: object, packed: bool) -> tuple[Array, bool]:
    query = _floating("query", query)
    packed_3d = packed and query.ndim == 3
    if packed_3d:
        query = query[None]
    if query.ndim != 4:
        hint = "" if packed else " (3-D packed input needs cu_seqlens)"
        _fail("query", _shape_words(_QUERY, packed) + hint, f"shape {tuple(query.shape)}")
    if packed and query.shape[0] != 1:
        _fail("query", "batch size 1 when cu_seqlens is given", f"shape {tuple(query.shape)}")
    if query.shape[1] < 1:
        _fail("query", "at least one token", f"shape {tuple(query.shape)}")
    return query, packed_3d


def _cu_seqlens(cu_seqlens: object, num_tokens: int) -> Array:
    if not hasattr(cu_seqlens, "shape") or not hasattr(cu_seqlens, "dtype"):
        _fail("cu_seqlens", "a 1-D integer array", type(cu_seqlens).__name__, TypeError)
    if not jnp.issubdtype(cu_seqlens.dtype, jnp.integer):
        _fail("cu_seqlens", "a 1-D integer array [num_seqs + 1]", f"dtype {cu_seqlens.dtype}", TypeError)
    if cu_seqlens.ndim != 1 or cu_seqlens.shape[0] < 2:
        _fail("cu_seqlens", "a 1-D array [num_seqs + 1] with num_seqs >= 1", f"shape {tuple(cu_seqlens.shape)}")
    if not isinstance(cu_seqlens, jax.core.Tracer):
        values = np.asarray(cu_seqlens)
        if values[0] != 0:
            _fail("cu_seqlens", "starting at 0", f"{values.tolist()}")
        if np.any(np.diff(values) < 0):
            _fail("cu_seqlens", "non-decreasing", f"{values.tolist()}")
        if values[-1] != num_tokens:
            _fail("cu_seqlens", f"ending at the token count {num_tokens}", f"{values.tolist()}")
    return jnp.asarray(cu_seqlens, jnp.int32)


def _scale(softmax_scale: object, qk_head_dim: int) -> float:
    if softmax_scale is None:
        return float(qk_head_dim) ** -0.5
    if isinstance(softmax_scale, jax.core.Tracer):
        _fail("softmax_scale", "a Python number (static configuration)", "a traced value", TypeError)
    if isinstance(softmax_scale, (int, float, np.number)) or np.shape(softmax_scale) == ():
        try:
            return float(softmax_scale)
        except (TypeError, ValueError):
            pass
    _fail("softmax_scale", "a Python number or None", repr(softmax_scale), TypeError)


def _g_gamma(g_gamma: object, num_heads: int) -> Array:
    g_gamma = _floating("g_gamma", g_gamma)
    if g_gamma.shape != (num_heads,):
        _fail("g_gamma", f"[num_heads] = [{num_heads}]", f"shape {tuple(g_gamma.shape)}")
    return g_gamma


def _initial_state(initial_state: object, rows: int, rows_word: str, H: int, K: int, V: int) -> Array:
    initial_state = _floating("initial_state", initial_state)
    expected = (rows, H, K, V)
    if initial_state.shape != expected:
        words = f"[{rows_word}, num_heads, qk_head_dim, v_head_dim] = {_describe(expected)}"
        _fail("initial_state", words, f"shape {tuple(initial_state.shape)}")
    return initial_state


def _sum(*terms: Array | None) -> Array | None:
    present = [t for t in terms if t is not None]
    return None if not present else sum(present[1:], present[0])


def canonicalize(
    query, key, value, g, g_gamma, gk, gv, softmax_scale, initial_state, reverse, cu_seqlens
) -> tuple[Problem, Config, Layout]:
    """Validate the public arguments and fold them into the canonical `Problem`."""
    packed = cu_seqlens is not None
    query, packed_3d = _query(query, packed)
    B, T, H, K = query.shape
    key = _token_array("key", key, _KEY, (B, T, None, K), packed)
    Hkv = key.shape[2]
    if Hkv < 1 or H % Hkv != 0:
        _fail("key", f"a head count dividing num_heads={H} (grouped heads)", f"num_kv_heads={Hkv}")
    value = _token_array("value", value, _VALUE, (B, T, Hkv, None), packed)
    V = value.shape[3]
    if key.dtype != query.dtype or value.dtype != query.dtype:
        _fail("key and value", f"of the query's dtype {query.dtype}", f"{key.dtype} and {value.dtype}", TypeError)
    if not isinstance(reverse, (bool, np.bool_)):
        _fail("reverse", "a Python bool (static configuration)", type(reverse).__name__, TypeError)
    state_dtype = jnp.promote_types(query.dtype, jnp.float32)

    g_head = g_key = None
    if g is not None:
        g = _floating("g", g)
        per_head = g.ndim == (2 if packed_3d else 3)
        words = "[batch, seq_len, num_heads] or [batch, seq_len, num_heads, qk_head_dim]"
        expected = (B, T, H) if per_head else (B, T, H, K)
        g = _token_array("g", g, words, expected, packed)
        g_head, g_key = (g, None) if per_head else (None, g)
    if gk is not None:
        gk = _token_array("gk", gk, "[batch, seq_len, num_heads, qk_head_dim]", (B, T, H, K), packed)
    if gv is not None:
        gv = _token_array("gv", gv, "[batch, seq_len, num_heads, v_head_dim]", (B, T, H, V), packed)
    if g_gamma is not None:
        g_gamma = jnp.broadcast_to(_g_gamma(g_gamma, H).astype(state_dtype), (B, T, H))

    if packed:
        cu_seqlens = _cu_seqlens(cu_seqlens, T)
        rows, rows_word = cu_seqlens.shape[0] - 1, "num_seqs"
    else:
        rows, rows_word = B, "batch"
    if initial_state is None:
        initial_state = jnp.zeros((rows, H, K, V), state_dtype)
    else:
        initial_state = _initial_state(initial_state, rows, rows_word, H, K, V)

    groups = H // Hkv
    as_state = lambda x: None if x is None else x.astype(state_dtype)  # noqa: E731
    problem = Problem(
        query=query,
        key=jnp.repeat(key, groups, axis=2) if groups > 1 else key,
        value=jnp.repeat(value, groups, axis=2) if groups > 1 else value,
        log_decay_head=_sum(as_state(g_head), g_gamma),
        log_decay_key=_sum(as_state(g_key), as_state(gk)),
        log_decay_value=as_state(gv),
        initial_state=initial_state.astype(state_dtype),
        cu_seqlens=cu_seqlens,
    )
    return problem, Config(_scale(softmax_scale, K), bool(reverse)), Layout(packed_3d)


def request_of(problem: Problem) -> Request:
    """The static facts of a canonical problem that dispatch decides on."""
    _, T, _, K = problem.query.shape
    gates = {
        "head": problem.log_decay_head,
        "key": problem.log_decay_key,
        "value": problem.log_decay_value,
    }
    return Request(
        dtype=jnp.dtype(problem.query.dtype).name,
        gates=frozenset(kind for kind, x in gates.items() if x is not None),
        varlen=problem.cu_seqlens is not None,
        backend=current_backend(),
        qk_head_dim=K,
        v_head_dim=problem.value.shape[-1],
        seq_len=T,
    )
