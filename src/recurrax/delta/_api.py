"""The public entry points `delta_rule` and `delta_rule_step`: validate once, dispatch by name."""

from __future__ import annotations

import jax
from jaxtyping import Array, Float

from .._core.arguments import CuSeqlens, HeadGates, HeadValues, KeyGates, PerHead, Precision, Results
from .._core.arguments import SharedQueries, States
from .._core.eager import cached_when_eager
from .._core.matmul_precision import matmul_precision, resolve
from .._core.problem import _fail, check_call_values
from .._core.registry import Request
from ._implementations import kernel_registry
from ._problem import canonicalize_delta, check_beta, check_update
from ._step import delta_token_one_pass

_STATIC = ("softmax_scale", "qk_l2norm", "implementation", "precision", "allow_positive_gates")


def delta_rule(
    query: SharedQueries, key: SharedQueries, value: HeadValues, beta: PerHead, g: HeadGates = None,
    gk: KeyGates = None, softmax_scale: float | None = None, initial_state: States = None, cu_seqlens: CuSeqlens = None,
    qk_l2norm: bool = False, *,
    implementation: str | None = None, precision: Precision = None, allow_positive_gates: bool = False,
) -> Results:
    """The (gated) delta rule, in linear time. For every value head, with state S ∈ R^{K×V}:

        a_t = g_t + gk_t                                  (log decays; absent terms are 0)
        S'  = diag(exp(a_t)) · S_{t-1}
        S_t = S' + k_t (β_t (v_t − S'ᵀ k_t))ᵀ
        o_t = softmax_scale · S_tᵀ q_t

    DeltaNet (no gate), Gated DeltaNet (per-head `g`), Kimi Delta Attention (per-channel `gk`).

    **Arguments:**
    - `query`, `key`: `[batch, seq_len, num_qk_heads, qk_head_dim]`, or packed
      `[total_tokens, ...]` / `[1, total_tokens, ...]` with `cu_seqlens`.
    - `value`: `[batch, seq_len, num_heads, v_head_dim]`, `num_qk_heads` dividing `num_heads`
      (value head h reads query/key head `h // (num_heads // num_qk_heads)`).
    - `beta`: the write strength `[batch, seq_len, num_heads]`, in [0, 2]. The update is
      stable while β‖k‖² ≤ 2 (I − β k kᵀ then has no eigenvalue below −1): keys of norm ≤ 1,
      as `qk_l2norm=True` makes them. Beyond it the state can grow without bound (256 tokens of
      Gaussian keys without `qk_l2norm` gave outputs near 5e17): concrete keys and
      β that reach it raise `recurrax.delta.ExpansiveUpdateWarning` (turn it into an error
      with `warnings.simplefilter("error", ExpansiveUpdateWarning)`); traced ones are checked
      under `recurrax.runtime_checks()`.
    - `g`: log decay per head `[batch, seq_len, num_heads]` (a per-channel `g`
      `[..., qk_head_dim]` is taken as `gk`).
    - `gk`: log decay per key channel `[batch, seq_len, num_heads, qk_head_dim]`.
    - `softmax_scale`: a Python number; defaults to `qk_head_dim ** -0.5`.
    - `initial_state`: `[batch, num_heads, qk_head_dim, v_head_dim]`, or `[num_seqs, ...]` when
      packed.
    - `cu_seqlens`: `[num_seqs + 1]` integer boundaries of packed sequences (may be traced).
    - `qk_l2norm`: normalise query and key per head first, `x · rsqrt(Σ x² + 1e-6)` in float32.
    - `implementation`: a name registered in `recurrax.delta.kernel_registry`: `"chunk"`
      (chunkwise, a triangular solve per chunk), `"scan"` (the token loop in blocks, storing
      one state per block), `"reference"` (the plain token loop, the oracle), `"pallas_tpu"` (a
      Pallas TPU forward kernel, TPU v5e/v6e) or `"pallas_tpu_interpret"` (that kernel in TPU
      interpret mode, any backend); `None` takes the best one for the call (`recurrax.delta.kernel_registry.select(...)` says which and why).
    - `precision`: the matmul precision of the XLA algorithms, as for `recurrax.recurrent`:
      `None` computes float32 inputs to float32 accuracy on every backend and 16-bit inputs
      at the backend's default; `"default"` asks for the one-pass product.
    - `allow_positive_gates`: keep positive log decays. By default a concrete gate with a
      positive value, or a concrete `beta` outside [0, 2], raises `ValueError`; traced ones
      are checked under `recurrax.runtime_checks()`.

    Gradients for every input: `chunk` through a custom VJP that recomputes each chunk in
    its backward (one stored state per chunk), `pallas_tpu` through its backward kernel (one
    state per chunk recomputed by the forward kernel), `scan` and `reference` through JAX's
    autodiff.
    Non-finite inputs are causal, as for `recurrent`: a NaN or infinity in the query, key,
    value, β or gate of token t, or in the output cotangent, makes NaN exactly the outputs and
    gradients the token loop's own autodiff makes non-finite, per token and head (never the
    outputs of earlier tokens, other rows or other packed sequences), in every implementation;
    the rule is tabled in `recurrax/_core/finite_delta.py`. A log decay of −inf is a hard reset,
    finite (as −1e4).

    **Returns:** `(output, final_state)`: `output` shaped like `value` (per value head), in the
    query's dtype; `final_state` `[rows, num_heads, qk_head_dim, v_head_dim]` in float32
    (float64 for float64 inputs).
    """
    arrays = (query, key, value, beta, g, gk, softmax_scale, initial_state, cu_seqlens, qk_l2norm)
    output = _delta_rule(*arrays, implementation=implementation, precision=precision,
                         allow_positive_gates=allow_positive_gates)
    check_argument_values(query, key, beta, g, gk, cu_seqlens, qk_l2norm, allow_positive_gates)
    return output


@cached_when_eager(static_argnames=_STATIC)
def _delta_rule(
    query, key, value, beta, g, gk, softmax_scale, initial_state, cu_seqlens, qk_l2norm, *,
    implementation, precision, allow_positive_gates,
):
    if implementation is not None and not isinstance(implementation, str):
        _fail("implementation", f"one of {kernel_registry.names()} or None", repr(implementation))
    problem, scale, layout = canonicalize_delta(
        query, key, value, beta, g, gk, softmax_scale, initial_state, cu_seqlens, qk_l2norm, allow_positive_gates
    )
    impl = kernel_registry.get(implementation, Request.of(problem))
    output, final_state = impl.run(problem, scale=scale, precision=resolve(precision, problem.query.dtype))
    return layout.restore(output), final_state


def check_argument_values(query, key, beta, g, gk, cu_seqlens, qk_l2norm: bool, allow_positive_gates: bool) -> None:
    """The checks of a call's concrete values, after it ran (eager calls; traced ones under
    `recurrax.runtime_checks()`): gate signs and `cu_seqlens`, β in [0, 2], β‖k‖² ≤ 2."""
    check_call_values({"g": g, "gk": gk}, query, cu_seqlens, allow_positive_gates)
    check_beta(beta)
    check_update(key, beta, qk_l2norm)


def delta_rule_step(
    query: Float[Array, "batch num_qk_heads qk_head_dim"],
    key: Float[Array, "batch num_qk_heads qk_head_dim"],
    value: Float[Array, "batch num_heads v_head_dim"],
    beta: Float[Array, "batch num_heads"],
    state: Float[Array, "batch num_heads qk_head_dim v_head_dim"] | None,
    g: Float[Array, "batch num_heads"] | None = None,
    gk: Float[Array, "batch num_heads qk_head_dim"] | None = None,
    softmax_scale: float | None = None,
    qk_l2norm: bool = False,
    *,
    allow_positive_gates: bool = False,
) -> tuple[Float[Array, "batch num_heads v_head_dim"], Float[Array, "batch num_heads qk_head_dim v_head_dim"]]:
    """Advance the delta-rule state of `batch` sequences by their next token(s) (decoding).

    One-token form (3-D `query`): exactly one token of `delta_rule(..., initial_state=state)`;
    the arguments are those of `delta_rule` without the `seq_len` axis (validated by the same
    code, with an axis of 1 added), `state` the state after the previous tokens (None: zeros).
    Several-token form (4-D `query`, `[batch, seq_len, ...]` arguments): identical to
    `delta_rule(query, key, value, beta, g, gk, softmax_scale, initial_state=state,
    qk_l2norm=qk_l2norm)`, so prefill and decoding are one call.

    **Returns:** `(output [batch, (seq_len,) num_heads, v_head_dim], new_state)`, the output
    in the query's dtype, the state in float32 (float64 for float64 inputs).
    """
    if getattr(query, "ndim", None) == 4:
        return delta_rule(query, key, value, beta, g, gk, softmax_scale, state, None, qk_l2norm,
                          allow_positive_gates=allow_positive_gates)
    arrays = (query, key, value, beta, g, gk)
    for name, x in zip(("query", "key", "value", "beta", "g", "gk"), arrays):
        if x is not None and getattr(x, "ndim", None) is not None and x.ndim < 2:
            _fail(name, "an array with a batch and a head axis (one token per sequence)", f"shape {x.shape}")
    output = _delta_rule_step(*arrays, state, softmax_scale, qk_l2norm, allow_positive_gates=allow_positive_gates)
    check_argument_values(query, key, beta, g, gk, None, qk_l2norm, allow_positive_gates)
    return output


@cached_when_eager(static_argnames=("softmax_scale", "qk_l2norm", "allow_positive_gates"))
def _delta_rule_step(query, key, value, beta, g, gk, state, softmax_scale, qk_l2norm, *, allow_positive_gates):
    one_token = lambda x: None if x is None else x[:, None]  # noqa: E731
    arrays = (one_token(x) for x in (query, key, value, beta, g, gk))
    problem, scale, _ = canonicalize_delta(*arrays, softmax_scale, state, None, qk_l2norm, allow_positive_gates)
    q, k = problem.expanded_query_key()
    a = problem.key_side_decay()
    if a is not None:
        a = a[:, 0] if a.ndim == 4 else a[:, 0, :, None]
    step = lambda s, q, k, v, b, a: delta_token_one_pass(s, q, k, v, b, a, scale)  # noqa: E731
    value = problem.value.astype(problem.state_dtype)
    with matmul_precision(resolve(None, problem.query.dtype)):
        output, new_state = jax.vmap(step)(problem.initial_state, q[:, 0], k[:, 0], value[:, 0], problem.beta[:, 0], a)
    return output.astype(problem.query.dtype), new_state
