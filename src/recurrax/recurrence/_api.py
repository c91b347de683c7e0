"""The public entry point: validate once, dispatch to a registered implementation."""

from __future__ import annotations

from .._core.arguments import ConstantGates, CuSeqlens, Gates, KeyGates, Keys, Precision, Queries, Results
from .._core.arguments import States, ValueGates, Values
from .._core.eager import cached_when_eager
from .._core.matmul_precision import resolve
from .._core.problem import canonicalize, check_call_values
from .._core.registry import Request, kernel_registry


def recurrent(
    query: Queries, key: Keys, value: Values, g: Gates = None, g_gamma: ConstantGates = None, gk: KeyGates = None,
    gv: ValueGates = None, softmax_scale: float | None = None, initial_state: States = None, reverse: bool = False,
    cu_seqlens: CuSeqlens = None, *,
    implementation: str | None = None, precision: Precision = None, allow_positive_gates: bool = False,
) -> Results:
    """Gated linear attention as a recurrence, in linear time.

        h_t = diag(exp(a_t)) · h_{t-1} · diag(exp(b_t)) + k_t v_tᵀ
        o_t = softmax_scale · q_tᵀ h_t

    with key-side log decay `a_t = g_t + g_gamma + gk_t` and value-side `b_t = gv_t`.

    **Arguments:**
    - `query`: `[batch, seq_len, num_heads, qk_head_dim]`, or packed `[total_tokens, ...]` /
      `[1, total_tokens, ...]` with `cu_seqlens`.
    - `key`, `value`: the same layout with `num_kv_heads` dividing `num_heads` (query head h
      reads key/value head `h // (num_heads // num_kv_heads)`); `value`'s last axis may differ.
      Or query and key *shared*: both with `num_qk_heads` heads dividing `value`'s
      `num_heads` (Mamba-2's layout: value head h reads query/key head
      `h // (num_heads // num_qk_heads)`); gates, state and output then have value's heads.
      Shared heads are never copied by `chunk` with per-head decays.
    - `g`: log decay per head `[batch, seq_len, num_heads]` or per key channel
      `[batch, seq_len, num_heads, qk_head_dim]`.
    - `g_gamma`: constant log decay per head `[num_heads]` (or `[1, num_heads]`), or one row
      per batch row `[batch, num_heads]` / per packed sequence `[num_seqs, num_heads]`.
    - `gk`: per-key-channel log decay; `gv`: per-value-channel log decay `[..., v_head_dim]`.
    - `softmax_scale`: a Python number; defaults to `qk_head_dim ** -0.5`.
    - `initial_state`: `[batch, num_heads, qk_head_dim, v_head_dim]`, or `[num_seqs, ...]` when
      packed.
    - `reverse`: run from the last token to the first.
    - `cu_seqlens`: `[num_seqs + 1]` integer boundaries of packed sequences (may be traced).
    - `implementation`: a registered name (`"reference"`, `"scan"`, `"chunk"`, ...) or `None`
      for the best one that supports the call on this backend
      (`kernel_registry.select(...)` says which one and why).
    - `precision`: the matmul precision of the XLA algorithms (`chunk`, `scan`, `reference`):
      `None` computes float32 inputs to float32 accuracy on every backend (`"highest"`; XLA's
      default on a TPU is one bfloat16 pass) and 16-bit inputs at the backend's default; or a
      `jax.lax.Precision` / `jax.default_matmul_precision` name (`"default"` for the one-pass
      product). Kernels fix their own (float32 operands at full precision).
    - `allow_positive_gates`: keep positive log decays (they grow the state). By default a
      concrete gate with a positive value raises `ValueError`; traced ones are checked under
      `recurrax.runtime_checks()`.

    Called eagerly, the validated call runs as one compiled program cached per shape and
    static option (`_core/eager.py`); under `jit`, `grad` or `vmap` it is traced as usual.

    **Returns:** `(output, final_state)`: `output` shaped like `query` with `v_head_dim` last, in
    the query's dtype; `final_state` `[rows, num_heads, qk_head_dim, v_head_dim]` in float32
    (float64 for float64 inputs).
    """
    arrays = (query, key, value, g, g_gamma, gk, gv, softmax_scale, initial_state, reverse, cu_seqlens)
    output = _recurrent(*arrays, implementation=implementation, precision=precision,
                        allow_positive_gates=allow_positive_gates)
    check_gate_values(query, g, g_gamma, gk, gv, cu_seqlens, allow_positive_gates)
    return output


@cached_when_eager(static_argnames=("softmax_scale", "reverse", "implementation", "precision", "allow_positive_gates"))
def _recurrent(
    query, key, value, g, g_gamma, gk, gv, softmax_scale, initial_state, reverse, cu_seqlens, *,
    implementation, precision, allow_positive_gates,
):
    problem, config, layout = canonicalize(
        query, key, value, g, g_gamma, gk, gv, softmax_scale, initial_state, reverse, cu_seqlens, allow_positive_gates
    )
    impl = kernel_registry.get(implementation, Request.of(problem))
    precision = resolve(precision, problem.query.dtype)
    output, final_state = impl.run(problem, scale=config.scale, precision=precision, reverse=config.reverse)
    return layout.restore(output), final_state


def check_gate_values(query, g, g_gamma, gk, gv, cu_seqlens, allow_positive_gates: bool) -> None:
    """The checks of a call's concrete gate and `cu_seqlens` values, after it ran (eager
    calls; traced ones under `recurrax.runtime_checks()`)."""
    gates = {"g": g, "g_gamma": g_gamma, "gk": gk, "gv": gv}
    check_call_values(gates, query, cu_seqlens, allow_positive_gates)
