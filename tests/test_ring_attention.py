"""Ring attention (`recurrax.nn._ring_attention`) on the 8 simulated CPU devices of
conftest.py, against one device's masked softmax attention written here in float64.

Each case compares the output and the gradients of a fixed random projection of it with
respect to q, k and v, within `floor_tolerance` of the rounding floor: the same reference
computed in float32 against float64. A compiled-program check shows the ring's memory: no
all-gather, and fewer temporary bytes than attention over all-gathered keys and values.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _cases import by_tier, floor_tolerance
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as Spec

import recurrax.nn as rnn
from recurrax.nn._ring_attention import ring_attention

H, HKV, D = 4, 2, 8
"""Query heads, key/value heads (two queries share each), head dim."""


def device_mesh(data: int, sequence: int):
    devices = np.array(jax.devices()[: data * sequence]).reshape(data, 1, sequence)
    return jax.sharding.Mesh(devices, ("data", "tensor", "sequence"), axis_types=(AxisType.Auto,) * 3)


def reference(q, k, v, positions, seq_ids, window):
    """Dense masked softmax attention on one device (grouped heads repeated), in q's dtype."""
    G = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, G, axis=2), jnp.repeat(v, G, axis=2)
    scores = jnp.einsum("bthd,bshd->bhts", q, k) * q.shape[-1] ** -0.5
    q_pos, k_pos = positions[:, None, :, None], positions[:, None, None, :]
    visible = (k_pos <= q_pos) & (seq_ids[:, None, :, None] == seq_ids[:, None, None, :])
    if window is not None:
        visible &= k_pos > q_pos - window
    weights = jax.nn.softmax(jnp.where(visible, scores, -jnp.inf), axis=-1)
    return jnp.einsum("bhts,bshd->bthd", weights, v)


def output_and_gradients(attention, q, k, v, projection):
    """`(o, (dq, dk, dv))` of `Σ o · projection`."""
    o, pull = jax.vjp(attention, q, k, v)
    return o, pull(projection.astype(o.dtype))


@partial(jax.jit, static_argnums=6)
def reference_and_gradients(q, k, v, projection, positions, seq_ids, window):
    return output_and_gradients(partial(reference, positions=positions, seq_ids=seq_ids, window=window), q, k, v,
                                projection)


def relative_error(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def inputs(B: int, T: int, cu_seqlens=None):
    """Random q, k, v, their projection, and each token's position and sequence id."""
    kq, kk, kv, kp = jax.random.split(jax.random.key(3), 4)
    q = jax.random.normal(kq, (B, T, H, D), jnp.float32)
    k = jax.random.normal(kk, (B, T, HKV, D), jnp.float32)
    v = jax.random.normal(kv, (B, T, HKV, D), jnp.float32)
    projection = jax.random.normal(kp, (B, T, H, D), jnp.float32)
    if cu_seqlens is None:
        return q, k, v, projection, jnp.broadcast_to(jnp.arange(T), (B, T)), None
    seq_ids = jnp.searchsorted(jnp.asarray(cu_seqlens[1:]), jnp.arange(T), side="right")[None]
    positions = jnp.arange(T)[None] - jnp.asarray(cu_seqlens)[seq_ids]
    return q, k, v, projection, positions, seq_ids


CASES = {
    # name: (data, sequence devices, B, T, packed sequence boundaries, window, tile)
    "causal-gqa": (1, 8, 2, 32, None, None, 2),
    "rows-over-data": (2, 4, 2, 32, None, None, 512),
    "window": (1, 8, 1, 32, None, 6, 4),
    "packed": (1, 8, 1, 32, (0, 3, 3, 17, 30, 32), None, 4),
    "packed-window": (1, 8, 1, 32, (0, 11, 29, 32), 5, 2),
}
FAST = {"rows-over-data", "packed-window"}
"""The default tier's cases: grouped heads, rows over `data`, packed sequences and a window."""


@pytest.mark.parametrize("name", by_tier(CASES, FAST))
def test_ring_equals_one_device(name):
    """Forward and q, k, v gradients; packed sequences cross shard boundaries (4 tokens per
    device, in tiles of 2 or 4), windows reach into earlier shards."""
    data, sequence, B, T, cu_seqlens, window, tile = CASES[name]
    q, k, v, projection, positions, seq_ids = inputs(B, T, cu_seqlens)
    ids = jnp.zeros((B, T), jnp.int32) if seq_ids is None else seq_ids
    want = reference_and_gradients(*(jnp.astype(x, jnp.float64) for x in (q, k, v)), projection, positions, ids,
                                   window)
    single = reference_and_gradients(q, k, v, projection, positions, ids, window)
    mesh = device_mesh(data, sequence)
    with rnn.use_mesh(mesh, rnn.logical_rules("data", "sequence")):
        ring = partial(ring_attention, positions=positions, seq_ids=seq_ids, sequence="sequence", window=window,
                       tile=tile)
        got = jax.jit(output_and_gradients, static_argnums=0)(ring, q, k, v, projection)
    for label, g, w, s in zip(("o", "dq", "dk", "dv"), (got[0], *got[1]), (want[0], *want[1]),
                              (single[0], *single[1])):
        assert g.dtype == jnp.float32
        floor = relative_error(s, w)
        assert relative_error(g, w) <= floor_tolerance(floor), (label, relative_error(g, w), floor)


def test_memory_holds_no_gathered_keys():
    """Forward and backward compiled for 8 devices at T = 4096 (tiles of 128): the ring's
    program has no all-gather and its temporaries are under an eighth of one device's scores
    `[H, T/P, T]` in attention over all-gathered keys and values (which holds them)."""
    B, T = 1, 4096
    mesh = device_mesh(1, 8)
    tokens = NamedSharding(mesh, Spec(None, "sequence", None, None))
    q = jax.ShapeDtypeStruct((B, T, H, D), jnp.float32, sharding=tokens)
    k = jax.ShapeDtypeStruct((B, T, HKV, D), jnp.float32, sharding=tokens)
    positions = jnp.broadcast_to(jnp.arange(T), (B, T))
    ids = jnp.zeros((B, T), jnp.int32)

    def gathered(q, k, v):  # the former path: every device's keys and values on every device
        k, v = (jax.lax.with_sharding_constraint(x, Spec(None, None, None, None)) for x in (k, v))
        return jax.lax.with_sharding_constraint(reference(q, k, v, positions, ids, None), tokens.spec)

    def loss(attention, q, k, v):
        return jnp.sum(jax.grad(lambda q, k, v: jnp.sum(jnp.sin(attention(q, k, v))), (0, 1, 2))(q, k, v)[0])

    with rnn.use_mesh(mesh, rnn.SEQUENCE_PARALLEL):
        ring = partial(ring_attention, positions=positions, sequence="sequence", tile=128)
        compiled = {name: jax.jit(partial(loss, f)).lower(q, k, k).compile()
                    for name, f in (("ring", ring), ("gathered", gathered))}
    assert "all-gather" not in compiled["ring"].as_text() and "collective-permute" in compiled["ring"].as_text()
    temp = {name: c.memory_analysis().temp_size_in_bytes for name, c in compiled.items()}
    scores = B * H * (T // 8) * T * 4  # one device's [H, T/P, T] float32 scores when gathered
    assert temp["gathered"] >= scores > 8 * temp["ring"], temp
