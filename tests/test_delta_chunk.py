"""The delta rule's `chunk` backward (a custom VJP recomputing each chunk from its entry state):
the hand-derived adjoint of one chunk against JAX's autodiff of its forward, every input's
gradient against the float64 reference's autodiff (dense and packed, every gate form, β up to
2, strong decays and hard resets), and XLA's temporaries growing with T/C, not T."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_delta import Case, _rel_error, _run, _values_and_grads, assert_within_floor, make_inputs

import recurrax
from recurrax.delta import chunk_delta, reference_delta
from recurrax.delta._chunk import _chunk_decay, chunk_step, chunk_terms
from recurrax.delta._chunk_adjoint import chunk_backward

# ----------------------------------------------------------------------------- one chunk


@pytest.mark.parametrize("gate, leaf", [("none", 1), ("head", 1), ("channel", 1), ("channel", 4)])
def test_chunk_adjoint_equals_autodiff_of_the_chunk(gate, leaf):
    """float64, one chunk of 16 tokens: `chunk_backward` is JAX's vjp of terms-then-step."""
    rng = np.random.default_rng(3)
    lead, C, K, V = (2, 3), 16, 5, 4
    q, k = rng.normal(size=(*lead, C, K)), rng.normal(size=(*lead, C, K)) / np.sqrt(K)
    v, beta = rng.normal(size=(*lead, C, V)), rng.uniform(0, 2, size=(*lead, C))
    log_decay = {"none": None, "head": -rng.uniform(0, 1, size=(*lead, C)),
                 "channel": -rng.uniform(0, 1, size=(*lead, C, K))}[gate]
    x = tuple(None if a is None else jnp.asarray(a) for a in (q, k, v, beta, log_decay))
    state = jnp.asarray(rng.normal(size=(*lead, K, V)))
    d_out, d_exit = jnp.asarray(rng.normal(size=(*lead, C, V))), jnp.asarray(rng.normal(size=(*lead, K, V)))

    def forward(x, state):
        return chunk_step(state, chunk_terms(*x, leaf), 0.7)

    @jax.jit
    def both(x, state, d_out, d_exit):
        _, pullback = jax.vjp(forward, x, state)
        decay = _chunk_decay(x[4], gate == "head", leaf, C)
        return pullback((d_out, d_exit)), chunk_backward(x, state, d_out, d_exit, decay, 0.7)

    (d_x_auto, d_state_auto), (d_x, d_state) = both(x, state, d_out, d_exit)
    names = ("q", "k", "v", "beta", "log_decay", "state")
    for name, got, want in zip(names, (*d_x, d_state), (*d_x_auto, d_state_auto)):
        if want is None:
            assert got is None, name
            continue
        np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-10, err_msg=name)


# ----------------------------------------------------------------------------- the whole call

CHUNK_8 = functools.partial(chunk_delta, chunk_size=8, leaf_size=1)  # T = 37: five chunks, the last padded
PACKED = (0, 9, 9, 30, 37)  # an empty sequence, sequences not aligned to chunks


def _with_resets(args: dict, case: Case, fraction: float = 0.15) -> dict:
    """Some gate entries set to −∞ (hard resets)."""
    rng = np.random.default_rng(7)
    args = dict(args)
    for name in ("g", "gk"):
        if name in args:
            args[name] = np.where(rng.uniform(size=args[name].shape) < fraction, -np.inf, args[name])
    return args


def chunk_errors(case: Case, resets: bool = False, algorithm=CHUNK_8) -> dict[str, tuple[float, float]]:
    """Per output and gradient: (chunk's float32 error, the float32 reference's), both relative
    to the float64 reference's largest magnitude; every chunk value must be finite."""
    args64 = make_inputs(case)
    if resets:
        args64 = _with_resets(args64, case)
    args32 = {n: np.asarray(x, np.float32) for n, x in args64.items()}
    o64, final64 = _run(reference_delta, args64, case)
    rng = np.random.default_rng(1)
    cotangents = (rng.normal(size=o64.shape), rng.normal(size=final64.shape))
    exact = _values_and_grads(reference_delta, args64, case, cotangents)
    floor = _values_and_grads(reference_delta, args32, case, cotangents)
    chunk = _values_and_grads(algorithm, args32, case, cotangents)
    for name, value in chunk.items():
        assert np.all(np.isfinite(np.asarray(value))), name
    return {n: (_rel_error(chunk[n], exact[n]), _rel_error(floor[n], exact[n])) for n in exact}


GRADIENT_CASES = [
    pytest.param(Case(gates=(), T=37), marks=pytest.mark.slow),
    Case(gates=("g",), T=37, beta_range=(0.0, 2.0)),
    Case(gates=("gk",), T=37, cu_seqlens=PACKED, qk_l2norm=True),
    Case(gates=("g", "gk"), T=37, cu_seqlens=PACKED, Hqk=1, beta_range=(0.0, 2.0)),
    pytest.param(Case(gates=("g",), T=37, cu_seqlens=PACKED, initial_state=False), marks=pytest.mark.slow),
    pytest.param(Case(gates=("gk",), T=37, beta_range=(1.0, 2.0), K=6, V=5), marks=pytest.mark.slow),
    pytest.param(Case(gates=(), T=37, cu_seqlens=PACKED), marks=pytest.mark.slow),
]


@pytest.mark.parametrize("case", GRADIENT_CASES, ids=str)
def test_every_gradient_matches_the_float64_reference(case):
    assert_within_floor(chunk_errors(case))


STRONG_CASES = [
    Case(gates=("g",), T=37, gate_range=(-1e4, 0.0)),
    Case(gates=("gk",), T=37, cu_seqlens=PACKED, gate_range=(-1e4, 0.0)),
    pytest.param(Case(gates=("g", "gk"), T=37, gate_range=(-1e4, 0.0)), marks=pytest.mark.slow),
]


@pytest.mark.parametrize("case", STRONG_CASES, ids=str)
def test_strong_decays_and_hard_resets(case):
    """Gates down to −1e4 per token with −∞ entries among them: finite, and every gradient
    (zero for a reset gate in the reference) within the float32 reference's floor."""
    assert_within_floor(chunk_errors(case, resets=True))


def test_empty_sequence_passes_its_final_cotangent_to_its_initial_state():
    """A sequence with no token: d initial_state is exactly d final_state (float64)."""
    case = Case(gates=("g",), T=12, cu_seqlens=(0, 5, 5, 12))
    args = make_inputs(case)
    rng = np.random.default_rng(2)
    cotangents = (rng.normal(size=(1, 12, case.H, case.V)), rng.normal(size=(3, case.H, case.K, case.V)))
    grads = _values_and_grads(CHUNK_8, args, case, cotangents)
    np.testing.assert_array_equal(grads["d_initial_state"][1], cotangents[1][1])


# ----------------------------------------------------------------------------- memory


def _temp_bytes(T: int, gate: str, K: int, V: int, C: int) -> int:
    """XLA's temporaries of jit(grad) in every input at [1, T, 1 head, K, V] (compiled, not run)."""
    spec = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)  # noqa: E731
    gates = {"g": spec(1, T, 1), "gk": spec(1, T, 1, K)}[gate]
    args = (spec(1, T, 1, K), spec(1, T, 1, K), spec(1, T, 1, V), spec(1, T, 1), gates)

    def loss(q, k, v, beta, gate_values):
        problem, scale, _ = recurrax.delta.canonicalize_delta(
            q, k, v, beta, gate_values if gate == "g" else None, gate_values if gate == "gk" else None,
            None, None, None, True)
        o, final = chunk_delta(problem, scale=scale, chunk_size=C)
        return jnp.sum(o * o) + jnp.sum(final)

    compiled = jax.jit(jax.grad(loss, argnums=tuple(range(5)))).lower(*args).compile()
    return compiled.memory_analysis().temp_size_in_bytes


TOKEN_ARRAYS = 8
"""Token-sized temporaries [T, max(K, V)] the backward may add (copies of q, k, v, β and the
gate, their gradients, the output and its cotangent): a bound from the shapes, not a measurement.
(Autodiff through every chunk's terms at once, before the custom VJP, grew by 22 and 37 token
arrays' worth with g and gk at these shapes; now 8 with either, mostly the states per chunk.)"""


@pytest.mark.parametrize("gate", ["g", "gk"])
def test_backward_temporaries_grow_with_chunks_not_tokens(gate):
    """Doubling T adds at most TOKEN_ARRAYS token-sized arrays [T, K] and two states per chunk
    (the exit states and their copy), far below one state per token (V = 64 token arrays)."""
    K = V = 64
    C = 16
    T = 512
    growth = (_temp_bytes(2 * T, gate, K, V, C) - _temp_bytes(T, gate, K, V, C)) / T
    token_array, state_per_chunk = 4 * max(K, V), 4 * K * V / C
    assert growth <= TOKEN_ARRAYS * token_array + 2 * state_per_chunk, (growth, token_array, state_per_chunk)
