"""Forward Mosaic GPU kernel of the chunk algorithm: outputs, final state, chunk states.

| symbol  | meaning                                                                    |
|---------|----------------------------------------------------------------------------|
| C       | chunk length, 64 (the wgmma M); token i of chunk n is global token n·C + i  |
| S       | [K, BV] float32 state entering chunk n, carried in SMEM (`state_s`)     |
| A_i     | chunk-local inclusive cumulative log decay (per head: a scalar per token)  |
| A_L     | A of the chunk's last token                                                |
| D       | [C, C] D_ij = e^{A_i − A_j} for j ≤ i, else 0                                |

One program (one warpgroup, grid (B, H, V / BV)) walks the N chunks in order. Per chunk:

    o   = scale · [ e^{A} ⊙_rows (q S)  +  ((q kᵀ) ⊙ D) v ]        [C, BV]
    S'  = e^{A_L} S  +  kᵀ (e^{A_L − A} ⊙_rows v)                   [K, BV]

(for no decay A ≡ 0). A per-key-channel decay (A_i a [K] row) cannot factor out of q kᵀ:
`key_chunk_step` computes o = scale · [(q ⊙ e^{A}) S + P v] and S' = e^{A_L} ⊙_rows S +
(k ⊙ e^{A_L − A})ᵀ v, with P from anchored products and an exact diagonal (`_channel`).
Every exponent is a sum of non-positive gates: A_i, A_i − A_j (j ≤ i,
masked to −inf before `exp` elsewhere) and A_L − A_j, so nothing overflows however strong
the decay. The four products are wgmma's: q kᵀ (q tile, kᵀ a transposed SMEM view),
q S (S rounded to the input dtype and written to SMEM), P v and kᵀ v_dec (kᵀ a
transposed SMEM left operand, M = K). P and v_dec are computed in registers and written
to SMEM before their wgmma: Mosaic GPU interpret mode (JAX 0.12) takes only SMEM operands,
so the kernels never use wgmma's register left operand (a cost of being testable on CPU).

Inputs of chunk n + 1 are fetched by TMA into the second of two SMEM slots while chunk n
computes (when both slots fit in shared memory, `smem_bytes`; else one slot, loaded then
used); outputs leave through SMEM staging tiles by TMA stores.

Packed input (`meta`, [3, N] int32 per chunk: sequence, is-first, is-last, the
chunk-aligned layout) resets S from the sequence's initial state on its first chunk and
writes its final state after its last chunk.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from .._driver import output_type
from . import _channel as channel
from ._tiles import (BLOCK_V, CHUNK, COLS, F32, ROWS, WGMMA, along_rows, causal_decay, matmul, matmuls,
                     swizzled)
from ._layout import (DECAY_COPIES, check_shapes, chunk_inputs, decay_bytes, decay_operands, decay_scratch,
                      fetch_decay, kernel_params, padded_meta, slots_that_fit)


def smem_bytes(K: int, dtype, slots: int, gate: str = "head") -> int:
    """Shared memory the forward kernel allocates (without the 16-column meta table)."""
    C, BV, isz = CHUNK, BLOCK_V, jnp.dtype(dtype).itemsize
    per_slot = 2 * C * K * isz + C * BV * isz
    v_dec = 0 if gate == "key" else C * BV * isz  # e^{A_L − A} ⊙ v
    fixed = K * BV * isz + v_dec + C * BV * isz + C * C * isz + K * BV * 4
    return slots * per_slot + fixed + decay_bytes(gate, slots, K, dtype)


def _scratch(K: int, dtype, slots: int, gate: str, meta_cols: int, copies: int) -> dict:
    C, BV = CHUNK, BLOCK_V
    decay = decay_scratch(gate, slots, K, dtype)
    if gate != "key":
        decay["v_dec_s"] = swizzled((C, BV), dtype)  # e^{A_L − A} ⊙ v
    return dict(
        q_s=swizzled((slots, C, K), dtype),
        k_s=swizzled((slots, C, K), dtype),
        v_s=swizzled((slots, C, BV), dtype),
        S_lo=swizzled((K, BV), dtype),  # S in the input dtype (wgmma operand)
        P_s=swizzled((C, C), dtype),  # the decayed scores
        o_stage=swizzled((C, BV), dtype),
        state_s=plgpu.SMEM((K, BV), F32),  # state in/out staging
        meta_s=plgpu.SMEM((3, meta_cols), jnp.int32),
        in_bar=plgpu.Barrier(num_arrivals=copies, num_barriers=slots),
        state_bar=plgpu.Barrier(),
        meta_bar=plgpu.Barrier(),
        **decay,
    )


def _forward_body(*refs, gate: str, scale: float, varlen: bool, emit_output: bool, emit_states: bool, shape, slots,
                  **scratch):
    B, Tp, H, K, V, N = shape
    C, BV = CHUNK, BLOCK_V
    refs = list(refs)
    q_ref, k_ref, v_ref, a_ref, meta_ref = chunk_inputs(refs, gate, varlen)
    h0_ref = refs.pop(0)
    o_ref = refs.pop(0) if emit_output else None
    hT_ref = refs.pop(0)
    states_ref = refs.pop(0) if emit_states else None
    assert not refs, refs
    sc = scratch
    q_s, k_s, v_s, S_lo, P_s, o_stage, state_s, meta_s = (
        sc[name] for name in ("q_s", "k_s", "v_s", "S_lo", "P_s", "o_stage", "state_s", "meta_s"))
    in_bar, state_bar, meta_bar = sc["in_bar"], sc["state_bar"], sc["meta_bar"]
    dtype = q_s.dtype
    b, h, j = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("j")
    cols = pl.ds(j * BV, BV)

    def fetch(n, slot):
        """TMA of chunk n's tiles into `slot` (one barrier counts every copy)."""
        rows, bar = pl.ds(n * C, C), in_bar.at[slot]
        plgpu.commit_smem()  # register reads of `slot` (chunk n − 2) come before the TMA writes
        if emit_output:
            plgpu.copy_gmem_to_smem(q_ref.at[b, rows, h], q_s.at[slot], bar)
        plgpu.copy_gmem_to_smem(k_ref.at[b, rows, h], k_s.at[slot], bar)
        plgpu.copy_gmem_to_smem(v_ref.at[b, rows, h, cols], v_s.at[slot], bar)
        fetch_decay(a_ref, sc, gate, b, h, rows, slot, bar)

    def load_state(row):
        """S := h0 of state row `row` (TMA into `state_s`, where S lives: see `write_state`)."""
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # a TMA store may still read state_s
        plgpu.commit_smem()  # and register reads of it come before the TMA write
        plgpu.copy_gmem_to_smem(h0_ref.at[row, h, :, cols], state_s, state_bar)
        plgpu.barrier_wait(state_bar)

    def read_state():
        return plgpu.load(state_s, layout=WGMMA)

    def write_state(S):
        """S is carried from chunk to chunk in `state_s` (float32 SMEM), not in 32–64
        registers a thread through the whole chunk step."""
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # a TMA store of S may still read it
        state_s[...] = S

    def store_state(dst):
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(state_s, dst)

    def store_output(o, rows):
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous chunk's o left o_stage
        o_stage[...] = o.astype(o_stage.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_stage, o_ref.at[b, rows, h, cols])

    def key_chunk_step(n, slot):
        """Per-key-channel decay: outputs of chunk n (stored) and the state leaving it:
        o = scale · [(q ⊙ e^{A}) S + P v], S' = e^{A_L} ⊙_rows S + (k ⊙ e^{A_L − A})ᵀ v.
        scale goes into both left operands, so o takes one wgmma accumulator; [C, K] tiles
        are made one panel at a time (`_channel`)."""
        rows = pl.ds(n * C, C)
        lhs, rhs = sc["lhs"], sc["rhs"]
        within = channel.Rows(sc["a_s"].at[slot], q_ref.at[b, rows, h], k_ref.at[b, rows, h],
                              q_s.at[slot], k_s.at[slot], lhs, rhs)
        if emit_output:
            P_s[...] = (scale * channel.scores(within)).astype(dtype)
            S_lo[...] = read_state().astype(dtype)
            for p in channel.panels(K):
                q = within.tile(q_s.at[slot], p)
                lhs[:, channel.panel_cols(p)] = (scale * q * jnp.exp(within.A(p))).astype(dtype)
            plgpu.commit_smem()
            store_output(matmuls([(lhs, S_lo), (P_s, v_s.at[slot])], (C, BV)), rows)
        for p in channel.panels(K):
            rhs[:, channel.panel_cols(p)] = (within.tile(k_s.at[slot], p) * within.to_end(p)).astype(dtype)
        plgpu.commit_smem()
        a_last_rows = channel.gmem_load(a_ref.at[b, n * C + C - 1, h], ROWS)  # [K] along S's rows
        decayed = read_state() * along_rows(jnp.exp(a_last_rows), (K, BV))
        write_state(matmul(rhs.T, v_s.at[slot], (K, BV), init=decayed))

    def chunk_step(n, slot):
        """Outputs of chunk n (stored) and the state leaving it (in `state_s`)."""
        if emit_states:
            store_state(states_ref.at[b, h, n, :, cols])
        if gate == "key":
            return key_chunk_step(n, slot)
        rows = pl.ds(n * C, C)
        a_s, a_cols_s, v_dec_s = sc.get("a_s"), sc.get("a_cols_s"), sc["v_dec_s"]
        if a_ref is None:
            a_rows = a_last = None
        else:
            a_rows, a_last = plgpu.load(a_s.at[slot], layout=ROWS), a_s[slot, C - 1]
        S_lo[...] = read_state().astype(dtype)
        v = plgpu.load(v_s.at[slot], layout=WGMMA).astype(F32)  # [C, BV]
        v_dec = v if a_ref is None else v * along_rows(jnp.exp(a_last - a_rows), (C, BV))
        v_dec_s[...] = v_dec.astype(dtype)
        plgpu.commit_smem()  # register writes -> visible to wgmma
        if emit_output:
            a_cols = None if a_ref is None else plgpu.load(a_cols_s.at[slot], layout=COLS)
            scores = matmul(q_s.at[slot], k_s.at[slot].T, (C, C))  # q kᵀ
            P_s[...] = causal_decay(scores, a_rows, a_cols).astype(dtype)
            plgpu.commit_smem()
            inter = matmul(q_s.at[slot], S_lo, (C, BV))  # q S
            if a_ref is not None:
                inter = inter * along_rows(jnp.exp(a_rows), (C, BV))
            store_output(scale * matmul(P_s, v_s.at[slot], (C, BV), init=inter), rows)
        decayed = read_state() if a_ref is None else read_state() * jnp.exp(a_last)
        write_state(matmul(k_s.at[slot].T, v_dec_s, (K, BV), init=decayed))  # S' = e^{A_L} S + kᵀ v_dec

    def dense_step(n, carry):
        slot = lax.rem(n, slots)
        if slots == 1:
            fetch(n, 0)
        plgpu.barrier_wait(in_bar.at[slot])
        if slots == 2:

            @pl.when(n + 1 < N)
            def _():
                fetch(n + 1, 1 - slot)

        chunk_step(n, slot)
        return carry

    def packed_step(n, carry):
        seq, first, last = meta_s[0, n], meta_s[1, n], meta_s[2, n]
        pl.when(first > 0)(lambda: load_state(seq))
        dense_step(n, carry)
        pl.when(last > 0)(lambda: store_state(hT_ref.at[seq, h, :, cols]))
        return carry

    if slots == 2:
        fetch(0, 0)
    if varlen:
        plgpu.copy_gmem_to_smem(meta_ref, meta_s, meta_bar)
        plgpu.barrier_wait(meta_bar)
        lax.fori_loop(0, N, packed_step, ())  # (every sequence's first chunk loads its h0)
    else:
        load_state(b)
        lax.fori_loop(0, N, dense_step, ())
        store_state(hT_ref.at[b, h, :, cols])
    plgpu.wait_smem_to_gmem(0)


@functools.partial(jax.jit, static_argnames=("static", "emit_output", "emit_states"))
def chunk_forward(q, k, v, a, h0, meta=None, *, static, emit_output: bool = True, emit_states: bool = False):
    """Run the forward kernel (the driver's `PallasBackend.forward` contract, `kernels/_recurrent_driver.py`).

    **Arguments:**
    - `q`, `k`: [B, Tp, H, K]; `v`: [B, Tp, H, V]; bf16/f16; Tp a multiple of C = 64.
    - `a`: chunk-local cumulative log decay, float32 [B, Tp, H] (per head), or None.
    - `h0`: [R, H, K, V] float32 initial states: R = B, or S sequences when packed.
    - `meta`: None, or for packed input (B = 1) int32 [3, N]: per chunk its sequence,
      whether it is that sequence's first chunk, and its last.
    - `static`: `KernelConfig` (scale, gate form, interpret); `emit_output`, `emit_states`.

    **Returns:** a list: `o` [B, Tp, H, V] (q's dtype) if `emit_output`, `h_T` [R, H, K, V]
    float32 (packed: written only for sequences that own a chunk), and `states`
    [B, H, N, K, V] float32 (state entering each chunk) if `emit_states`.
    """
    B, Tp, H, K = q.shape
    V, R = v.shape[-1], h0.shape[0]
    gate = check_shapes(q, v, a, static)
    N = Tp // CHUNK
    dtype = q.dtype
    out_type = []
    if emit_output:
        out_type.append(output_type((B, Tp, H, V), dtype, q))
    out_type.append(output_type((R, H, K, V), F32, q))
    if emit_states:
        out_type.append(output_type((B, H, N, K, V), F32, q))
    meta = None if meta is None else padded_meta(meta)
    BV = BLOCK_V
    slots = slots_that_fit(lambda s: smem_bytes(K, dtype, s, gate), f"forward at K={K}, gate {gate}")
    copies = 2 + emit_output + DECAY_COPIES[gate]
    scratch = _scratch(K, dtype, slots, gate, 16 if meta is None else meta.shape[1], copies)
    body = functools.partial(
        _forward_body, gate=gate, scale=static.scale, varlen=meta is not None,
        emit_output=emit_output, emit_states=emit_states, shape=(B, Tp, H, K, V, N), slots=slots,
    )
    args = [q, k, v] + decay_operands(a, gate) + ([meta] if meta is not None else []) + [h0]
    kernel = plgpu.kernel(
        body, out_type=out_type, scratch_types=scratch, grid=(B, H, V // BV), grid_names=("b", "h", "j"),
        kernel_name="recurrax_mgpu_chunk_fwd" if emit_output else "recurrax_mgpu_chunk_states",
        **kernel_params(static),
    )
    return list(kernel(*args))
