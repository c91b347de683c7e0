"""The canonical form of a call: validation, the gate vocabulary, the public constructor.
Its fields and the contract they keep are the public module's note (`recurrax/problem.py`,
shown on the API page `docs/api/problem.md`)."""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import math
import threading
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from .varlen import segments



class Gate(str, enum.Enum):
    """The decay kinds of the canonical form: the one gate vocabulary from the interface inwards.

    The public arguments fold into them: `g` per head and `g_gamma` → `HEAD`; `g` per key
    channel and `gk` → `KEY`; `gv` → `VALUE`. Inside an algorithm, the form one side's decay
    takes is `None` (absent), `HEAD` (a scalar per token and head) or that side's channel
    kind (`KEY` or `VALUE`).
    """

    HEAD = "head"
    KEY = "key"
    VALUE = "value"


class Problem(NamedTuple):
    """The canonical form every algorithm receives (see the module docstring).

    Build one with `Problem.create(query=..., key=..., value=..., ...)`, which validates the
    arguments of `recurrax.recurrent` exactly as `recurrent` does.
    """

    query: Float[Array, "B T Hqk K"]
    key: Float[Array, "B T Hqk K"]
    value: Float[Array, "B T H V"]
    log_decay_head: Float[Array, "B T H"] | None
    log_decay_key: Float[Array, "B T H K"] | None
    log_decay_value: Float[Array, "B T H V"] | None
    initial_state: Float[Array, "R H K V"]
    cu_seqlens: Int[Array, " S_plus_1"] | None

    @classmethod
    def create(
        cls,
        *,
        query: Array,
        key: Array,
        value: Array,
        g: Array | None = None,
        g_gamma: Array | None = None,
        gk: Array | None = None,
        gv: Array | None = None,
        initial_state: Array | None = None,
        cu_seqlens: Array | None = None,
        allow_positive_gates: bool = False,
    ) -> Problem:
        """Validate `recurrax.recurrent`'s array arguments and fold them into a `Problem`.

        **Arguments:** as for `recurrax.recurrent` (a packed 3-D `query` becomes `[1, N, ...]`).
        Raises `ValueError` / `TypeError` naming the argument, as `recurrent` does.
        """
        arrays = (query, key, value, g, g_gamma, gk, gv, initial_state, cu_seqlens)
        return _validated(*arrays, allow_positive_gates)[0]

    @property
    def default_scale(self) -> float:
        """The softmax scale `recurrent` uses when none is given: qk_head_dim ** -0.5."""
        return float(self.query.shape[-1]) ** -0.5

    @property
    def shares_query_key(self) -> bool:
        """Whether query and key have fewer heads than value (each shared by a group of heads)."""
        return self.query.shape[2] < self.value.shape[2]

    def expanded(self) -> Problem:
        """The same problem with shared query/key heads repeated to every value head (in the
        state dtype, as grouped key/value heads are: their gradients sum in float32)."""
        if not self.shares_query_key:
            return self
        groups, state_dtype = self.value.shape[2] // self.query.shape[2], self.initial_state.dtype
        return self._replace(query=_expand_heads(self.query, groups, state_dtype),
                             key=_expand_heads(self.key, groups, state_dtype))

    @property
    def gates(self) -> frozenset[Gate]:
        """The decay kinds present."""
        fields = {Gate.HEAD: self.log_decay_head, Gate.KEY: self.log_decay_key, Gate.VALUE: self.log_decay_value}
        return frozenset(kind for kind, x in fields.items() if x is not None)

    def key_side_decay(self) -> Float[Array, "B T H K"] | Float[Array, "B T H 1"] | None:
        """The key-side log decay a_t = log_decay_head + log_decay_key, without materialising
        absent terms: [B, T, H, K], or [B, T, H, 1] when only the per-head decay is present."""
        head = None if self.log_decay_head is None else self.log_decay_head[..., None]
        key = self.log_decay_key
        if head is None or key is None:
            return head if key is None else key
        return head + key

    def mirrored(self, num_tokens: int | None = None) -> Problem:
        """The same recurrence on the flipped token axis: `reverse=True` as a forward problem.

        Tokens are flipped; packed sequences then come in reverse order, so `cu_seqlens`
        becomes `N − cu_seqlens[::-1]` and the initial states are reversed too. Mirroring twice
        gives the problem back; a packed final state comes back in mirrored sequence order
        (`final[::-1]`). `num_tokens` is the N that `cu_seqlens` counts (default: this
        problem's token count; a shard of a longer sequence passes the whole count).
        """
        flip = lambda x: None if x is None else x[:, ::-1]  # noqa: E731
        packed = self.cu_seqlens is not None
        return Problem(
            query=flip(self.query),
            key=flip(self.key),
            value=flip(self.value),
            log_decay_head=flip(self.log_decay_head),
            log_decay_key=flip(self.log_decay_key),
            log_decay_value=flip(self.log_decay_value),
            initial_state=self.initial_state[::-1] if packed else self.initial_state,
            cu_seqlens=(num_tokens or self.query.shape[1]) - self.cu_seqlens[::-1] if packed else None,
        )


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


def _opaque(gate: Array) -> Array:
    """A concrete gate behind an optimisation barrier, a traced one as it is.

    A concrete array closed over by a jitted function is a constant of the program, and XLA
    evaluates the work derived from a constant at compile time (the cleaned gate, its
    cumulative decays: seconds of constant folding at long sequences). Behind the barrier it
    is an opaque value, computed at run time like a traced gate."""
    return gate if isinstance(gate, jax.core.Tracer) else jax.lax.optimization_barrier(gate)


def _shape_words(words: str, packed: bool) -> str:
    if not packed:
        return words
    inner = words.replace("batch, seq_len", "total_tokens")
    return f"{inner} or [1, {inner[1:]} (packed, with cu_seqlens)"


def _token_array(name: str, x: object, words: str, expected: tuple, packed: bool, query_shape: tuple) -> Array:
    """Check a per-token array against `expected` ([B, T, ...] with None for 'any'), whose
    sizes come from the query's shape (said in the message: a query in the wrong layout shows)."""
    x = _floating(name, x)
    if packed and x.ndim == len(expected) - 1:
        x = x[None]
    if x.ndim != len(expected) or any(e is not None and e != s for e, s in zip(expected, x.shape)):
        source = f" (sizes from query's shape {tuple(query_shape)})"
        _fail(name, f"{_shape_words(words, packed)} = {_describe(expected)}{source}", f"shape {tuple(x.shape)}")
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
    _non_empty("query", query.shape, ("batch row", "token", "head", "channel"))
    return query, packed_3d


def _non_empty(name: str, shape: tuple, words: tuple[str, ...]) -> None:
    """Refuse an empty dimension by name (a batch of 0 rows has nothing to compute, and an
    empty head or channel axis has no state)."""
    for size, word in zip(shape, words):
        if size < 1:
            _fail(name, f"non-empty (at least one {word})", f"shape {tuple(shape)}")


def _cu_seqlens(cu_seqlens: object, num_tokens: int) -> Array:
    if not hasattr(cu_seqlens, "shape") or not hasattr(cu_seqlens, "dtype"):
        _fail("cu_seqlens", "a 1-D integer array", type(cu_seqlens).__name__, TypeError)
    if not jnp.issubdtype(cu_seqlens.dtype, jnp.integer):
        _fail("cu_seqlens", "a 1-D integer array [num_seqs + 1]", f"dtype {cu_seqlens.dtype}", TypeError)
    if cu_seqlens.ndim != 1 or cu_seqlens.shape[0] < 2:
        _fail("cu_seqlens", "a 1-D array [num_seqs + 1] with num_seqs >= 1", f"shape {tuple(cu_seqlens.shape)}")
    return jnp.asarray(cu_seqlens, jnp.int32)


# ----------------------------------------------------------------------------- values


_RUNTIME = threading.local()


@contextlib.contextmanager
def runtime_checks(enabled: bool = True):
    """Check traced gates and `cu_seqlens` at run time, inside `jax.experimental.checkify`.

    Under `jit`, values are not known when `recurrent` is traced, so a positive log decay or
    a malformed `cu_seqlens` cannot be refused then. Calls traced inside this context add
    `checkify.check`s for them; functionalise the caller with `checkify.checkify` and throw:

        with recurrax.runtime_checks():
            error, (o, state) = jax.jit(checkify.checkify(f))(q, k, v, g)
        error.throw()   # ValueError-like: names the argument and the offending value

    Outside the context nothing is added (the default path has no check at all).
    """
    previous = getattr(_RUNTIME, "enabled", False)
    _RUNTIME.enabled = enabled
    try:
        yield
    finally:
        _RUNTIME.enabled = previous


def runtime_checks_enabled() -> bool:
    return getattr(_RUNTIME, "enabled", False)


def _concrete(x: object) -> bool:
    return x is not None and hasattr(x, "dtype") and not isinstance(x, jax.core.Tracer)


def check_values(gates: dict, cu_seqlens: object, num_tokens: int | None, allow_positive_gates: bool) -> None:
    """Refuse positive log decays and malformed `cu_seqlens` among the concrete arguments.

    **Arguments:** `gates`: `{name: array}` of the gate arguments given; `num_tokens`: the
    packed token count `cu_seqlens` must end at (None: not known yet, unchecked);
    `allow_positive_gates`: keep positive log decays (they grow the state) on purpose.
    Traced values are skipped here (see `runtime_checks`).
    """
    if not allow_positive_gates:
        for name, x in gates.items():
            if _concrete(x) and jnp.issubdtype(x.dtype, jnp.floating) and np.size(x):
                _refuse_positive(name, np.asarray(x, np.float64))
    if _concrete(cu_seqlens) and jnp.issubdtype(cu_seqlens.dtype, jnp.integer) and np.ndim(cu_seqlens) == 1:
        values = np.asarray(cu_seqlens)
        if values.size and values[0] != 0:
            raise ValueError(f"cu_seqlens must start at 0, got {values.tolist()}")
        if np.any(np.diff(values) < 0):
            _fail("cu_seqlens", "non-decreasing", f"{values.tolist()}")
        if values.size and num_tokens is not None and values[-1] != num_tokens:
            raise ValueError(f"cu_seqlens must end at the token count {num_tokens}, got {values.tolist()}")


def check_call_values(gates: dict, query: object, cu_seqlens: object, allow_positive_gates: bool) -> None:
    """`check_values` of a call's concrete gates and `cu_seqlens`, which must end at the token
    count of the packed `query` (`[total_tokens, ...]` or `[1, total_tokens, ...]`)."""
    check_values(gates, cu_seqlens, packed_tokens(query, cu_seqlens), allow_positive_gates)


def packed_tokens(query: object, cu_seqlens: object) -> int | None:
    """The token count a concrete `cu_seqlens` must end at (None when it cannot be known)."""
    if cu_seqlens is None or not hasattr(query, "ndim") or query.ndim not in (3, 4):
        return None
    return query.shape[0] if query.ndim == 3 else query.shape[1]


def _refuse_positive(name: str, values: np.ndarray) -> None:
    largest = float(np.max(values))
    if not largest > 0:
        return
    hint = ""
    if float(np.min(values)) >= 0 and largest <= 1:
        hint = f"; its values lie in [0, 1] like decay factors: pass their log (e.g. jnp.log({name}))"
    raise ValueError(
        f"{name} must be log decays (≤ 0), got a largest value of {largest:.6g}{hint}. "
        "Positive log decays grow the state; pass allow_positive_gates=True if you mean it"
    )


def _runtime_checks(gates: dict, cu_seqlens: Array | None, num_tokens: int) -> None:
    """`checkify.check`s of the traced gates and cu_seqlens (only inside `runtime_checks()`)."""
    from jax.experimental import checkify

    for name, x in gates.items():
        if isinstance(x, jax.core.Tracer):
            largest = jnp.max(x)
            checkify.check(largest <= 0, f"{name} must be log decays (≤ 0), got a largest value of {{}}", largest)
    if isinstance(cu_seqlens, jax.core.Tracer):
        checkify.check(cu_seqlens[0] == 0, "cu_seqlens must start at 0, got {}", cu_seqlens[0])
        checkify.check(jnp.all(jnp.diff(cu_seqlens) >= 0), "cu_seqlens must be non-decreasing, got {}", cu_seqlens)
        checkify.check(cu_seqlens[-1] == num_tokens, f"cu_seqlens must end at the token count {num_tokens}, got {{}}",
                       cu_seqlens[-1])


def _scale(softmax_scale: object, qk_head_dim: int) -> float:
    if softmax_scale is None:
        return float(qk_head_dim) ** -0.5
    if isinstance(softmax_scale, jax.core.Tracer):
        _fail("softmax_scale", "a Python number (static configuration)", "a traced value", TypeError)
    if isinstance(softmax_scale, (int, float, np.number)) or np.shape(softmax_scale) == ():
        try:
            scale = float(softmax_scale)
        except (TypeError, ValueError):
            scale = None
        if scale is not None:
            if not (math.isfinite(scale) and scale > 0):
                _fail("softmax_scale", "a finite positive number (or None)", repr(softmax_scale))
            return scale
    _fail("softmax_scale", "a Python number or None", repr(softmax_scale), TypeError)


def _g_gamma(g_gamma: object, num_heads: int, rows: int, rows_word: str) -> Array:
    """`g_gamma` as [1, H] (one decay per head for every row) or [rows, H] (one per row)."""
    g_gamma = _opaque(_floating("g_gamma", g_gamma))
    if g_gamma.shape == (num_heads,):
        return g_gamma[None]
    if g_gamma.ndim == 2 and g_gamma.shape[0] in (1, rows) and g_gamma.shape[1] == num_heads:
        return g_gamma
    accepted = f"[num_heads], [1, num_heads] or [{rows_word}, num_heads] = [{num_heads}], [1, {num_heads}] or [{rows}, {num_heads}]"
    _fail("g_gamma", accepted, f"shape {tuple(g_gamma.shape)}")


def _per_token_rows(x: Float[Array, "R H"], T: int, cu_seqlens: Int[Array, " S_plus_1"] | None) -> Float[Array, "B T H"]:
    """A value per row and head as a value per token: [R, H] → [B, T, H]. Dense rows (R = B,
    or 1) broadcast over their tokens; packed sequences (R = S) are gathered for each token."""
    if cu_seqlens is None or x.shape[0] == 1:
        return jnp.broadcast_to(x[:, None, :], (x.shape[0], T, x.shape[1]))
    return x[segments(cu_seqlens, T).seq_id][None]


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


def _validated(
    query, key, value, g, g_gamma, gk, gv, initial_state, cu_seqlens, allow_positive_gates: bool = False
) -> tuple[Problem, bool]:
    """The canonical problem of the array arguments, and whether the input was packed 3-D."""
    packed = cu_seqlens is not None
    query, packed_3d = _query(query, packed)
    B, T, Hq, K = query.shape
    gates = {name: x for name, x in (("g", g), ("g_gamma", g_gamma), ("gk", gk), ("gv", gv)) if x is not None}
    key = _token_array("key", key, _KEY, (B, T, None, K), packed, query.shape)
    value = _token_array("value", value, _VALUE, (B, T, None, None), packed, query.shape)
    H, value_heads = _head_counts(Hq, key.shape[2], value.shape[2])
    value = _token_array("value", value, _VALUE, (B, T, value_heads, None), packed, query.shape)
    V = value.shape[3]
    _non_empty("value", value.shape, ("batch row", "token", "head", "channel"))
    if key.dtype != query.dtype or value.dtype != query.dtype:
        _fail("key and value", f"of the query's dtype {query.dtype}", f"{key.dtype} and {value.dtype}", TypeError)
    state_dtype = jnp.promote_types(query.dtype, jnp.float32)

    g_head = g_key = None
    if g is not None:
        g = _opaque(_floating("g", g))
        per_head = g.ndim == (2 if packed_3d else 3)
        words = "[batch, seq_len, num_heads] or [batch, seq_len, num_heads, qk_head_dim]"
        expected = (B, T, H) if per_head else (B, T, H, K)
        g = _token_array("g", g, words, expected, packed, query.shape)
        g_head, g_key = (g, None) if per_head else (None, g)
    if gk is not None:
        gk = _opaque(_token_array("gk", gk, "[batch, seq_len, num_heads, qk_head_dim]", (B, T, H, K), packed, query.shape))
    if gv is not None:
        gv = _opaque(_token_array("gv", gv, "[batch, seq_len, num_heads, v_head_dim]", (B, T, H, V), packed, query.shape))
    if packed:
        cu_seqlens = _cu_seqlens(cu_seqlens, T)
        rows, rows_word = cu_seqlens.shape[0] - 1, "num_seqs"
    else:
        rows, rows_word = B, "batch"
    if g_gamma is not None:
        g_gamma = _g_gamma(g_gamma, H, rows, rows_word).astype(state_dtype)
        g_gamma = jnp.broadcast_to(_per_token_rows(g_gamma, T, cu_seqlens), (B, T, H))
    if initial_state is None:
        initial_state = jnp.zeros((rows, H, K, V), state_dtype)
    else:
        initial_state = _initial_state(initial_state, rows, rows_word, H, K, V)

    check_values(gates, cu_seqlens, T if packed else None, allow_positive_gates)
    if runtime_checks_enabled():
        _runtime_checks({} if allow_positive_gates else gates, cu_seqlens, T)

    groups = Hq // key.shape[2]  # grouped key/value heads (1 when query and key are shared)
    as_state = lambda x: None if x is None else x.astype(state_dtype)  # noqa: E731
    problem = Problem(
        query=query,
        key=_expand_heads(key, groups, state_dtype),
        value=_expand_heads(value, groups, state_dtype),
        log_decay_head=_sum(as_state(g_head), g_gamma),
        log_decay_key=_sum(as_state(g_key), as_state(gk)),
        log_decay_value=as_state(gv),
        initial_state=initial_state.astype(state_dtype),
        cu_seqlens=cu_seqlens,
    )
    return problem, packed_3d


def _head_counts(query_heads: int, key_heads: int, value_heads: int) -> tuple[int, int]:
    """(H, the head count value must have) of grouped key/value heads (key and value
    with `num_kv_heads` dividing the query's `num_heads`) or shared query/key heads (query
    and key with `num_heads` dividing the value's)."""
    if key_heads == query_heads and value_heads > query_heads:
        if value_heads % query_heads:
            _fail("value", f"a head count that num_heads={query_heads} divides (query and key shared by groups of "
                  "value heads), or the key's", f"{value_heads} heads")
        return value_heads, value_heads
    if key_heads < 1 or query_heads % key_heads != 0:
        _fail("key", f"a head count dividing num_heads={query_heads} (grouped heads)", f"num_kv_heads={key_heads}")
    return query_heads, key_heads


def _expand_heads(x: Float[Array, "B T Hkv D"], groups: int, state_dtype) -> Float[Array, "B T H D"]:
    """Grouped key/value heads repeated for their query heads. Repeated in the state dtype, so
    that the gradient, the sum over a group of per-head gradients, is accumulated in float32
    and rounded to the input dtype once (rounding each head's share first would lose up to
    log2(groups) bits in half precision)."""
    return x if groups == 1 else jnp.repeat(x.astype(state_dtype), groups, axis=2)


def canonicalize(
    query, key, value, g, g_gamma, gk, gv, softmax_scale, initial_state, reverse, cu_seqlens,
    allow_positive_gates: bool = False,
) -> tuple[Problem, Config, Layout]:
    """Validate `recurrent`'s positional arguments: the canonical `Problem`, the static
    `Config` and the caller's `Layout`."""
    problem, packed_3d = _validated(
        query, key, value, g, g_gamma, gk, gv, initial_state, cu_seqlens, allow_positive_gates
    )
    if not isinstance(reverse, (bool, np.bool_)):
        _fail("reverse", "a Python bool (static configuration)", type(reverse).__name__, TypeError)
    return problem, Config(_scale(softmax_scale, problem.query.shape[-1]), bool(reverse)), Layout(packed_3d)
