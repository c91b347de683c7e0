"""Validation: every malformed argument fails at trace time with an error naming it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import recurrax

B, T, H, HKV, K, V = 2, 5, 4, 2, 8, 6


def good(**overrides):
    args = dict(
        query=jnp.ones((B, T, H, K)),
        key=jnp.ones((B, T, HKV, K)),
        value=jnp.ones((B, T, HKV, V)),
    )
    args.update(overrides)
    return args


def packed(**overrides):
    args = dict(
        query=jnp.ones((7, H, K)),
        key=jnp.ones((7, HKV, K)),
        value=jnp.ones((7, HKV, V)),
        cu_seqlens=jnp.array([0, 3, 7]),
    )
    args.update(overrides)
    return args


BAD = [
    ("query", ValueError, good(query=jnp.ones((B, T, K)))),
    ("query", ValueError, good(query=jnp.ones((B, 0, H, K)), key=jnp.ones((B, 0, HKV, K)), value=jnp.ones((B, 0, HKV, V)))),
    ("query", TypeError, good(query=jnp.ones((B, T, H, K), jnp.int32))),
    ("query", TypeError, good(query=[[1.0]])),
    ("key", ValueError, good(key=jnp.ones((B, T, HKV, K + 1)))),
    ("key", ValueError, good(key=jnp.ones((B, T + 1, HKV, K)))),
    ("key", ValueError, good(key=jnp.ones((B, T, 3, K)), value=jnp.ones((B, T, 3, V)))),
    ("value", ValueError, good(value=jnp.ones((B, T, HKV + 1, V)))),
    ("value", ValueError, good(value=jnp.ones((B + 1, T, HKV, V)))),
    ("key", TypeError, good(key=jnp.ones((B, T, HKV, K), jnp.float16))),
    ("g", ValueError, good(g=jnp.zeros((B, T, H, K + 1)))),
    ("g", ValueError, good(g=jnp.zeros((B, T)))),
    ("g", TypeError, good(g=jnp.zeros((B, T, H), jnp.int32))),
    ("g_gamma", ValueError, good(g_gamma=jnp.zeros((H + 1,)))),
    ("g_gamma", ValueError, good(g_gamma=jnp.zeros((B, H)))),
    ("gk", ValueError, good(gk=jnp.zeros((B, T, H)))),
    ("gk", ValueError, good(gk=jnp.zeros((B, T, HKV, K)))),
    ("gv", ValueError, good(gv=jnp.zeros((B, T, H, K)))),
    ("initial_state", ValueError, good(initial_state=jnp.zeros((B, H, K, K)))),
    ("initial_state", ValueError, good(initial_state=jnp.zeros((H, K, V)))),
    ("initial_state", ValueError, packed(initial_state=jnp.zeros((1, H, K, V)))),
    ("initial_state", TypeError, good(initial_state=jnp.zeros((B, H, K, V), jnp.int32))),
    ("softmax_scale", TypeError, good(softmax_scale="big")),
    ("reverse", TypeError, good(reverse=jnp.array(True))),
    ("cu_seqlens", TypeError, packed(cu_seqlens=jnp.array([0.0, 3.0, 7.0]))),
    ("cu_seqlens", ValueError, packed(cu_seqlens=jnp.array([[0, 3, 7]]))),
    ("cu_seqlens", ValueError, packed(cu_seqlens=jnp.array([0]))),
    ("cu_seqlens", ValueError, packed(cu_seqlens=jnp.array([1, 3, 7]))),
    ("cu_seqlens", ValueError, packed(cu_seqlens=jnp.array([0, 5, 3, 7]))),
    ("cu_seqlens", ValueError, packed(cu_seqlens=jnp.array([0, 3, 6]))),
    ("cu_seqlens", ValueError, good(cu_seqlens=jnp.array([0, 2, 5]))),
    ("cu_seqlens", TypeError, packed(cu_seqlens=[0, 3, 7])),
    ("implementation", ValueError, good(implementation="no-such-algorithm")),
]


@pytest.mark.parametrize("name, error, args", BAD, ids=[f"{i}-{b[0]}" for i, b in enumerate(BAD)])
def test_bad_argument_names_itself(name, error, args):
    with pytest.raises(error) as info:
        recurrax.recurrent(**args)
    message = str(info.value)
    assert name in message, message
    assert "got" in message or "must be one of" in message, message


def test_errors_come_at_trace_time_under_jit():
    f = jax.jit(lambda q, k, v: recurrax.recurrent(q, k, v)[0])
    with pytest.raises(ValueError, match="key"):
        f.lower(jnp.ones((B, T, H, K)), jnp.ones((B, T, HKV, K + 1)), jnp.ones((B, T, HKV, V)))


def test_traced_softmax_scale_is_refused():
    f = jax.jit(lambda s: recurrax.recurrent(**good(softmax_scale=s))[0])
    with pytest.raises(TypeError, match="softmax_scale"):
        f(0.5)


def test_shape_message_says_the_shape_in_words():
    with pytest.raises(ValueError, match=r"\[batch, seq_len, num_kv_heads, qk_head_dim\]"):
        recurrax.recurrent(**good(key=jnp.ones((B, T, HKV, K + 1))))


def test_good_calls_pass_with_every_layout():
    o, state = recurrax.recurrent(**good(g=jnp.zeros((B, T, H)), gv=jnp.zeros((B, T, H, V))))
    assert o.shape == (B, T, H, V) and state.shape == (B, H, K, V)
    o, state = recurrax.recurrent(**packed(g=jnp.zeros((7, H, K))))
    assert o.shape == (7, H, V) and state.shape == (2, H, K, V)
    args4 = {k: (v[None] if k != "cu_seqlens" else v) for k, v in packed().items()}
    o, state = recurrax.recurrent(**args4, initial_state=np.zeros((2, H, K, V)))
    assert o.shape == (1, 7, H, V) and state.shape == (2, H, K, V)
