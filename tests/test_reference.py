"""The oracle itself: against a hand-written float64 NumPy loop, and finite differences."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _cases import GATE_COMBOS, Case, make_inputs, max_rel_error, split_args

import recurrax


def numpy_recurrent(query, key, value, g=None, g_gamma=None, gk=None, gv=None,
                    softmax_scale=None, initial_state=None, reverse=False, cu_seqlens=None):
    """`docs/design.md` §1 written out with loops over sequences, heads and tokens (float64)."""
    arrays = [query, key, value, g, gk, gv]
    packed_3d = cu_seqlens is not None and np.ndim(query) == 3
    query, key, value, g, gk, gv = [
        None if x is None else (np.asarray(x, np.float64)[None] if packed_3d else np.asarray(x, np.float64))
        for x in arrays
    ]
    B, T, H, K = query.shape
    Hkv, V = key.shape[2], value.shape[3]
    scale = K**-0.5 if softmax_scale is None else softmax_scale
    spans = ([(b, 0, T) for b in range(B)] if cu_seqlens is None
             else [(0, int(s), int(e)) for s, e in zip(cu_seqlens[:-1], cu_seqlens[1:])])
    out = np.zeros((B, T, H, V))
    finals = np.zeros((len(spans), H, K, V))
    for row, (b, start, end) in enumerate(spans):
        for h in range(H):
            kv = h // (H // Hkv)
            state = np.zeros((K, V)) if initial_state is None else np.asarray(initial_state, np.float64)[row, h].copy()
            order = range(end - 1, start - 1, -1) if reverse else range(start, end)
            for t in order:
                a = np.zeros(K)
                if g is not None:
                    a += g[b, t, h] if g.ndim == 4 else g[b, t, h]
                if g_gamma is not None:
                    a += float(g_gamma[h])
                if gk is not None:
                    a += gk[b, t, h]
                bv = np.zeros(V) if gv is None else gv[b, t, h]
                state = np.exp(a)[:, None] * state * np.exp(bv)[None, :] + np.outer(key[b, t, kv], value[b, t, kv])
                out[b, t, h] = scale * query[b, t, h] @ state
            finals[row, h] = state
    return (out[0] if packed_3d else out), finals


CASES = [Case(gates=gates) for gates in GATE_COMBOS] + [
    Case(gates=("g_head", "gk", "gv"), reverse=True),
    Case(gates=("g_channel",), initial_state=False, Hkv=4, K=5, V=7, scale=0.3),
    Case(gates=("g_head", "gv"), cu_seqlens=(0, 3, 3, 4, 11), packed_3d=True),
    Case(gates=("gk", "g_gamma"), cu_seqlens=(0, 0, 5, 6, 9), reverse=True),
    Case(gates=("g_channel",), T=1, B=3),
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_reference_matches_numpy_loop(case):
    kwargs = make_inputs(case)
    o, state = recurrax.recurrent(**kwargs, implementation="reference")
    o_np, state_np = numpy_recurrent(**{k: (np.asarray(v) if hasattr(v, "shape") else v) for k, v in kwargs.items()})
    assert o.shape == o_np.shape and state.shape == state_np.shape
    assert max_rel_error(o, o_np) < 1e-12
    assert max_rel_error(state, state_np) < 1e-12


@pytest.mark.parametrize(
    "case",
    [
        Case(B=1, T=4, H=2, Hkv=1, K=3, V=2, gates=("g_head", "gk", "gv", "g_gamma")),
        Case(T=4, H=2, Hkv=1, K=3, V=2, gates=("g_channel", "gv"), cu_seqlens=(0, 1, 1, 4), reverse=True),
    ],
    ids=str,
)
def test_reference_gradients_match_finite_differences(case):
    kwargs = make_inputs(case)
    diff, rest = split_args(kwargs)
    rng = np.random.default_rng(3)
    o, state = recurrax.recurrent(**kwargs, implementation="reference")
    w_o, w_s = rng.standard_normal(o.shape), rng.standard_normal(state.shape)

    def loss(diff):
        o, state = recurrax.recurrent(**diff, **rest, implementation="reference")
        return jnp.sum(o * w_o) + jnp.sum(state * w_s)

    loss = jax.jit(loss)
    grads = jax.grad(loss)(diff)
    eps = 1e-6
    for name, x in diff.items():
        flat = np.asarray(x).ravel()
        numeric = np.zeros_like(flat)
        for i in range(flat.size):
            for sign in (1, -1):
                bumped = flat.copy()
                bumped[i] += sign * eps
                numeric[i] += sign * float(loss({**diff, name: jnp.asarray(bumped.reshape(x.shape))}))
        numeric /= 2 * eps
        assert max_rel_error(np.asarray(grads[name]).ravel(), numeric) < 1e-6, name
