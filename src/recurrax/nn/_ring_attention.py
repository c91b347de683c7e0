"""Ring attention: causal softmax attention with the token axis split over a mesh axis, each
device holding only its own T / P keys and values.

| symbol  | meaning                                                                 |
|---------|-------------------------------------------------------------------------|
| B, T    | batch rows, tokens per row (packed sequences: B = 1)                    |
| P, i    | devices on the sequence mesh axis, this device's index                  |
| t       | tokens per device, T / P                                                |
| H, Hkv  | query heads, key/value heads (G = H / Hkv query heads share one)        |
| D       | head dim                                                                |
| c       | the score scale (default D^{−1/2})                                      |
| p, s    | a token's position and sequence id (its packed sequence; 0 when dense)  |
| w       | sliding window (None: unbounded)                                        |
| n       | tokens per tile (the largest divisor of t up to `TILE`)                 |
| Q_i     | device i's queries; K_j, V_j the keys and values of block j             |

Each device i keeps its queries and, for P steps, holds one block of keys and values,
passing it to device i + 1 (`ppermute`) between steps: at step r it holds block j = i − r
(mod P), with the blocks' positions and sequence ids. A key j is visible from a query q when

    s_j = s_q,   p_j ≤ p_q,   p_j > p_q − w,

and with `a_qj = c·q·k_j` the device keeps, in float32, the online-softmax state of each query

    m ← max(m, max_j a_qj),   ℓ ← ℓ·e^{m_old − m} + Σ_j e^{a_qj − m},
    u ← u·e^{m_old − m} + Σ_j e^{a_qj − m} v_j,         o = u / ℓ,   L = m + log ℓ.

Within a step the block meets the device's queries a tile of n ≤ `TILE` keys against a tile
of n queries at a time (scores `[B, n, H, n]`); a pair of tiles with no visible pair (keys all
in the future of the queries, outside every window, or of other sequences) is skipped
(`lax.cond`): causally, device i computes about i + 1/2 of the P blocks. The backward (a custom VJP) passes the blocks around the ring again, each with
its float32 gradient accumulators dK_j, dV_j; with `P_qj = e^{a_qj − L_q}` (0 where not
visible) and `δ_q = do_q · o_q`:

    dV_j += Σ_q P_qj do_q,   dS_qj = P_qj (do_q · v_j − δ_q),
    dQ_q += c Σ_j dS_qj k_j,   dK_j += c Σ_q dS_qj q,

and one last `ppermute` brings every block's accumulators home. Grouped heads sum dK, dV over
their G query heads. Memory per device: O(t) keys, values and accumulators and one tile's
scores `[B, n, H, n]`; nothing is gathered, and the backward keeps only q, k, v, o and L.
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as Spec
from jaxtyping import Array, Float, Int

from ..kernels._driver import vary_over, varying_axes
from ._sharding import mesh_axis


TILE = 512
"""Queries and keys per score tile (a block of T / P tokens is split into tiles of up to this)."""


class Ring(NamedTuple):
    """The static choices of one ring: the mesh, its axes and the attention's window and scale."""

    mesh: object
    sequence: str
    batch: str | None
    heads: str | None
    window: int | None
    scale: float
    tile: int


def ring_attention(
    q: Float[Array, "B T H D"],
    k: Float[Array, "B T Hkv D"],
    v: Float[Array, "B T Hkv D"],
    positions: Int[Array, "B T"],
    seq_ids: Int[Array, "B T"] | None = None,
    *,
    sequence: str,
    window: int | None = None,
    scale: float | None = None,
    tile: int = TILE,
) -> Float[Array, "B T H D"]:
    """Causal (and windowed) softmax attention of every token to the visible keys of its row
    and sequence, with the tokens split over the mesh axis `sequence` of the current mesh
    (`recurrax.nn.use_mesh`) and the keys and values passed around it (see the module docstring).

    **Arguments:**
    - `q`, `k`, `v`: queries `[B, T, H, D]`, keys and values `[B, T, Hkv, D]` (Hkv divides H).
    - `positions`: each token's position `[B, T]`; `seq_ids`: each token's packed sequence
      `[B, T]` (None: one sequence per row).
    - `sequence`: the mesh axis of the tokens (its size divides T); batch rows and heads go
      over the mesh axes of `batch` and `heads`/`kv_heads` where those divide them.
    - `window`: keys more than `window − 1` positions back are not seen (None: all);
      `scale`: the score scale (None: D^{−1/2}).
    - `tile`: the most queries and keys one score tile `[B, tile, H, tile]` spans (the largest
      divisor of T / P up to it is used).

    **Returns:** `o [B, T, H, D]` in q's dtype (computed in float32), equal to one device's.
    """
    mesh = jax.sharding.get_abstract_mesh()
    (B, T, H, D), Hkv = q.shape, k.shape[2]
    if T % mesh.shape[sequence]:
        raise ValueError(f"ring attention needs the mesh axis {sequence!r} to divide T={T}")
    batch = mesh_axis("batch", B) if seq_ids is None else None
    batch = None if batch == sequence else batch
    head = mesh_axis("heads", H)
    head = head if head not in (sequence, batch) and head == mesh_axis("kv_heads", Hkv) else None
    ring = Ring(mesh, sequence, batch, head, window, D**-0.5 if scale is None else float(scale), tile)
    seq_ids = jnp.zeros((B, T), jnp.int32) if seq_ids is None else seq_ids
    return _ring(ring, q, k, v, positions.astype(jnp.int32), seq_ids.astype(jnp.int32))


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring(ring: Ring, q, k, v, positions, seq_ids):
    return _forward(ring, q, k, v, positions, seq_ids)[0]


def _specs(ring: Ring):
    """The shard_map specs of heads-shaped arrays `[B, T, H, ·]`, token arrays `[B, T]` and the
    log-sum-exp `[B, T, H]`."""
    return (Spec(ring.batch, ring.sequence, ring.heads, None), Spec(ring.batch, ring.sequence),
            Spec(ring.batch, ring.sequence, ring.heads))


def _forward(ring: Ring, q, k, v, positions, seq_ids):
    """`(o, L)`: the output and each query's log-sum-exp `[B, T, H]` (float32)."""
    heads, tokens, lse_spec = _specs(ring)
    body = partial(_forward_shard, ring)
    split = jax.shard_map(body, mesh=ring.mesh, in_specs=(heads, heads, heads, tokens, tokens),
                          out_specs=(heads, lse_spec), check_vma=True)
    return split(q, k, v, positions, seq_ids)


def _forward_vjp(ring: Ring, q, k, v, positions, seq_ids):
    o, lse = _forward(ring, q, k, v, positions, seq_ids)
    return o, (q, k, v, positions, seq_ids, o, lse)


def _backward_vjp(ring: Ring, residuals, do):
    q, k, v, positions, seq_ids, o, lse = residuals
    heads, tokens, lse_spec = _specs(ring)
    body = partial(_backward_shard, ring)
    split = jax.shard_map(body, mesh=ring.mesh,
                          in_specs=(heads, heads, heads, tokens, tokens, heads, lse_spec, heads),
                          out_specs=(heads, heads, heads), check_vma=True)
    dq, dk, dv = split(q, k, v, positions, seq_ids, o, lse, do)
    return dq, dk, dv, None, None


_ring.defvjp(_forward_vjp, _backward_vjp)


def _rotate(ring: Ring, block):
    """`block` (a tuple of arrays) passed from every device i to i + 1 (mod P)."""
    P = ring.mesh.shape[ring.sequence]
    return jax.lax.ppermute(block, ring.sequence, [(p, (p + 1) % P) for p in range(P)])


def _around(ring: Ring, step, carry, block):
    """`step(carry, block) → (carry, block)` on each of the P blocks, passing the block on
    between steps; returns the last `(carry, block)` (the block one step short of home)."""

    def body(state, _):
        carry, block = step(*state)
        return (carry, _rotate(ring, block)), None

    state, _ = jax.lax.scan(body, (carry, block), None, length=ring.mesh.shape[ring.sequence] - 1)
    return step(*state)


def _visible(ring: Ring, q_pos, q_seq, k_pos, k_seq):
    """`[b, tq, tk]`: which keys of a tile each query sees (causal, windowed, same sequence)."""
    q_pos, q_seq, k_pos, k_seq = q_pos[:, :, None], q_seq[:, :, None], k_pos[:, None, :], k_seq[:, None, :]
    visible = (k_pos <= q_pos) & (k_seq == q_seq)
    if ring.window is not None:
        visible &= k_pos > q_pos - ring.window
    return visible


def _grouped(q, num_kv_heads: int):
    """q `[b, t, H, D]` as float32 `[b, t, Hkv, G, D]`."""
    b, t, H, D = q.shape
    return q.reshape(b, t, num_kv_heads, H // num_kv_heads, D).astype(jnp.float32)


def _scores(ring: Ring, qg, k, visible):
    """`c·q·k` `[b, tq, Hkv, G, tk]`, −inf where not visible."""
    scores = jnp.einsum("btkgd,bskd->btkgs", qg, k.astype(jnp.float32)) * ring.scale
    return jnp.where(visible[:, :, None, None], scores, -jnp.inf)


def _tiles(x, size: int):
    """`[b, t, ...]` as `[t / size, b, size, ...]` (tiles of `size` tokens first)."""
    b, t = x.shape[:2]
    return jnp.moveaxis(x.reshape(b, t // size, size, *x.shape[2:]), 1, 0)


def _untiled(x):
    """`[n, b, size, ...]` back to `[b, n·size, ...]`."""
    x = jnp.moveaxis(x, 0, 1)
    return x.reshape(x.shape[0], -1, *x.shape[3:])


def _tile_size(ring: Ring, t: int) -> int:
    """Tokens per tile: the largest divisor of t up to `ring.tile`."""
    return next(size for size in range(min(ring.tile, t), 0, -1) if t % size == 0)


def _forward_shard(ring: Ring, q, k, v, positions, seq_ids):
    """One device's queries against every block: `(o [b, t, H, D], L [b, t, H])`, a tile of
    keys against a tile of queries at a time."""
    b, t, H, D = q.shape
    Hkv = k.shape[2]
    size = _tile_size(ring, t)
    queries = tuple(_tiles(x, size) for x in (_grouped(q, Hkv), positions, seq_ids))
    shape = (t // size, b, size, Hkv, H // Hkv)
    axes = varying_axes(q, k, v, positions, seq_ids)
    start = vary_over(axes, jnp.zeros((*shape, D), jnp.float32), jnp.full(shape, -jnp.inf, jnp.float32),
                      jnp.zeros(shape, jnp.float32))

    def attend(state, qg, k, v, visible):
        acc, top, total = state
        scores = _scores(ring, qg, k, visible)
        new_top = jnp.maximum(top, jnp.max(scores, axis=-1))
        safe = jnp.where(jnp.isfinite(new_top), new_top, 0.0)
        weights = jnp.exp(scores - safe[..., None])
        rescale = jnp.exp(top - safe)
        acc = acc * rescale[..., None] + jnp.einsum("btkgs,bskd->btkgd", weights, v.astype(jnp.float32))
        return acc, new_top, total * rescale + jnp.sum(weights, axis=-1)

    def key_tile(state, keys):
        k, v, k_pos, k_seq = keys

        def query_tile(_, tile):
            (qg, q_pos, q_seq), state = tile
            visible = _visible(ring, q_pos, q_seq, k_pos, k_seq)
            return None, jax.lax.cond(jnp.any(visible), attend, lambda state, *_: state, state, qg, k, v, visible)

        return jax.lax.scan(query_tile, None, (queries, state))[1], None

    def step(state, block):
        return jax.lax.scan(key_tile, state, tuple(_tiles(x, size) for x in block))[0], block

    acc, top, total = (_untiled(x) for x in _around(ring, step, start, (k, v, positions, seq_ids))[0])
    o = (acc / total[..., None]).reshape(b, t, H, D).astype(q.dtype)
    return o, (top + jnp.log(total)).reshape(b, t, H)


def _backward_shard(ring: Ring, q, k, v, positions, seq_ids, o, lse, do):
    """One device's `(dq, dk, dv)`: its queries against every block, a tile of keys against a
    tile of queries at a time, each block's dK and dV travelling with it and home at the end."""
    b, t, H, D = q.shape
    Hkv = k.shape[2]
    size = _tile_size(ring, t)
    qg, dog = _grouped(q, Hkv), _grouped(do, Hkv)
    lse = lse.reshape(b, t, Hkv, H // Hkv)
    delta = jnp.sum(dog * _grouped(o, Hkv), axis=-1)  # [b, t, Hkv, G]
    queries = tuple(_tiles(x, size) for x in (qg, dog, lse, delta, positions, seq_ids))
    axes = varying_axes(q, k, v, positions, seq_ids, o, lse, do)
    zeros_kv = jnp.zeros(k.shape, jnp.float32)
    dq, dk, dv = vary_over(axes, _tiles(jnp.zeros(qg.shape, jnp.float32), size), zeros_kv, zeros_kv)

    def gradients(dq, dk, dv, qg, do, lse, delta, k, v, visible):
        weights = jnp.exp(_scores(ring, qg, k, visible) - lse[..., None])  # P, 0 where not visible
        dv = dv + jnp.einsum("btkgs,btkgd->bskd", weights, do)
        dp = jnp.einsum("btkgd,bskd->btkgs", do, v.astype(jnp.float32))
        ds = weights * (dp - delta[..., None]) * ring.scale
        dq = dq + jnp.einsum("btkgs,bskd->btkgd", ds, k.astype(jnp.float32))
        return dq, dk + jnp.einsum("btkgs,btkgd->bskd", ds, qg), dv

    def key_tile(dq, keys):
        k, v, k_pos, k_seq, dk, dv = keys

        def query_tile(dk_dv, tile):
            (qg, do, lse, delta, q_pos, q_seq), dq = tile
            visible = _visible(ring, q_pos, q_seq, k_pos, k_seq)
            dq, *dk_dv = jax.lax.cond(jnp.any(visible), gradients, lambda dq, dk, dv, *_: (dq, dk, dv),
                                      dq, *dk_dv, qg, do, lse, delta, k, v, visible)
            return tuple(dk_dv), dq

        (dk, dv), dq = jax.lax.scan(query_tile, (dk, dv), (queries, dq))
        return dq, (dk, dv)

    def step(dq, block):
        k, v, k_pos, k_seq, dk, dv = block
        dq, (dk, dv) = jax.lax.scan(key_tile, dq, tuple(_tiles(x, size) for x in block))
        return dq, (k, v, k_pos, k_seq, _untiled(dk), _untiled(dv))

    dq, (*_, dk, dv) = _around(ring, step, dq, (k, v, positions, seq_ids, dk, dv))
    dk, dv = _rotate(ring, (dk, dv))  # each block's accumulators, one step from home
    return _untiled(dq).reshape(q.shape).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)
