"""Backward Mosaic GPU kernel of the chunk algorithm: dq, dk, dv, d(initial state), boundary.

| symbol  | meaning                                                                    |
|---------|----------------------------------------------------------------------------|
| C       | chunk length, 64 (the wgmma M)                                             |
| S       | [K, BV] float32 state entering chunk n (recomputed by the forward kernel)  |
| S⁺      | the state leaving chunk n: S of chunk n + 1, or h_T after the last chunk   |
| dS      | [K, BV] float32 gradient of S⁺, carried in registers from the last chunk   |
| A_i, A_L| chunk-local cumulative log decay (per head), and A of the chunk's last token |
| D       | [C, C] D_ij = e^{A_i − A_j} for j ≤ i, else 0                                |

One program (one warpgroup, grid (B, H, V / BV)) walks the chunks from last to first,
starting from dS = dh_T. Differentiating the forward's chunk equations (`_forward`):

    dP   = scale · (do vᵀ) ⊙ D                  Pᵀ = scale · (k qᵀ) ⊙ Dᵀ       [C, C]
    dq   = scale · e^{A} ⊙_rows (do Sᵀ)  +  dP k                              [C, K]
    dk   = e^{A_L − A} ⊙_rows (v dSᵀ)    +  dPᵀ q                             [C, K]
    dv   = e^{A_L − A} ⊙_rows (k dS)     +  Pᵀ do                             [C, BV]
    dS  ←  e^{A_L} dS  +  qᵀ (scale · e^{A} ⊙_rows do)                         [K, BV]

and after the first chunk dS is d(initial state). With a per-key-channel decay the decay
moves inside the K sums (`key_chunk_step`, `_channel`): dP loses its D factor, and the
e^{A_i − A_j} of dq, dk and P are applied by anchored products plus an exact diagonal. The transposed score matrices are
formed directly by wgmma (v doᵀ, k qᵀ with transposed SMEM views) and masked with Dᵀ,
never transposed in registers. Every exponent is a sum of non-positive gates (masked
to −inf before `exp` above the diagonal). dq and dk contract over V, so each value
block writes its partial sum ([nV, B, Tp, H, K] float32) and the caller adds them up.

The gate gradient is not formed here: the driver derives it from dq and dk, plus the
per-chunk "boundary" term Σ_V S⁺ ⊙ dS (`recurrax.kernels._driver.gate_gradient`). S⁺ of
chunk n is S of chunk n + 1, which the previous step of this reverse loop loaded, so it is
carried in registers rather than read twice.

Inputs of chunk n − 1 (q, k, v, do, A tiles, and the float32 state S) are fetched by TMA
while chunk n computes, in a second SMEM slot when shared memory allows (see
`smem_bytes`); outputs leave through SMEM staging tiles by TMA stores.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from ._layout import (DECAY_COPIES, check_shapes, decay_bytes, decay_operands, decay_scratch, fetch_decay,
                      kernel_params, padded_meta, slots_that_fit)
from .._driver import output_type
from . import _channel as channel
from ._tiles import BLOCK_V, CHUNK, COLS, F32, ROWS, WGMMA, along_cols, along_rows, causal_decay, iota, matmul, swizzled


def _scratch(K: int, dtype, slots: int, gate: str, meta_cols: int, copies: int) -> dict:
    C, BV = CHUNK, BLOCK_V
    decay = decay_scratch(gate, slots, K, dtype)
    if gate != "key":  # (per key channel S_lo holds S, then dS)
        decay.update(dS_lo=swizzled((K, BV), dtype), do_dec=swizzled((C, BV), dtype))  # scale · e^{A} ⊙ do
    if not _stage_in_state_slot(gate, slots):  # h_T, then dh_T in; dh0 out
        decay["state_stage"] = plgpu.SMEM((K, BV), F32)
    return dict(
        q_s=swizzled((slots, C, K), dtype),
        k_s=swizzled((slots, C, K), dtype),
        v_s=swizzled((slots, C, BV), dtype),
        do_s=swizzled((slots, C, BV), dtype),
        S_s=plgpu.SMEM((slots, K, BV), F32),  # recomputed states, float32
        S_lo=swizzled((K, BV), dtype),  # S in the input dtype (wgmma operand)
        scores=swizzled((C, C), dtype),  # dP, then dPᵀ, then Pᵀ
        dqk_stage=plgpu.SMEM((C, K), F32),
        dv_stage=plgpu.SMEM((C, BV), F32),
        bound_stage=plgpu.SMEM((K,), F32),
        meta_s=plgpu.SMEM((3, meta_cols), jnp.int32),
        in_bar=plgpu.Barrier(num_arrivals=copies, num_barriers=slots),
        state_bar=plgpu.Barrier(),
        meta_bar=plgpu.Barrier(),
        **decay,
    )


def _stage_in_state_slot(gate: str, slots: int) -> bool:
    """Per-channel decay with one slot (K = 128): the final states and dh0 pass through the
    state slot S_s[0] instead of a staging tile of their own, which would not fit in SMEM.
    S_s[0] is free then: its chunk's state is in registers before either use."""
    return gate == "key" and slots == 1


def smem_bytes(K: int, dtype, slots: int, gate: str = "head") -> int:
    """Shared memory the backward kernel allocates (without the 16-column meta table)."""
    C, BV, isz = CHUNK, BLOCK_V, jnp.dtype(dtype).itemsize
    per_slot = 2 * C * K * isz + 2 * C * BV * isz + K * BV * 4
    work = K * BV * isz if gate == "key" else 2 * K * BV * isz + C * BV * isz  # S_lo (, dS_lo, do_dec)
    stage = 0 if _stage_in_state_slot(gate, slots) else K * BV * 4
    fixed = work + C * C * isz + C * K * 4 + C * BV * 4 + K * 4 + stage
    return slots * per_slot + fixed + decay_bytes(gate, slots, K, dtype)


def _backward_body(*refs, gate: str, scale: float, varlen: bool, shape, slots: int, **scratch):
    B, Tp, H, K, V, N = shape
    C, BV = CHUNK, BLOCK_V
    refs = list(refs)
    q_ref, k_ref, v_ref = refs.pop(0), refs.pop(0), refs.pop(0)
    a_ref = refs.pop(0) if gate != "none" else None
    meta_ref = refs.pop(0) if varlen else None
    do_ref, states_ref, hT_ref, dhT_ref, dq_ref, dk_ref, dv_ref, dh0_ref, *rest = refs
    boundary_ref = rest[0] if rest else None
    sc = dict(scratch)
    shared_stage = _stage_in_state_slot(gate, slots)
    if shared_stage:
        sc["state_stage"] = sc["S_s"].at[0]
    dtype = sc["q_s"].dtype
    b, h, j = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("j")
    cols = pl.ds(j * BV, BV)

    def fetch(n, slot):
        """TMA of chunk n's tiles and entering state into `slot` (one barrier counts every copy)."""
        rows, bar = pl.ds(n * C, C), sc["in_bar"].at[slot]
        if shared_stage:
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # a dh0 store may still read S_s[0]
        plgpu.commit_smem()  # register reads of `slot` (chunk n + 2) come before the TMA writes
        plgpu.copy_gmem_to_smem(q_ref.at[b, rows, h], sc["q_s"].at[slot], bar)
        plgpu.copy_gmem_to_smem(k_ref.at[b, rows, h], sc["k_s"].at[slot], bar)
        plgpu.copy_gmem_to_smem(v_ref.at[b, rows, h, cols], sc["v_s"].at[slot], bar)
        plgpu.copy_gmem_to_smem(do_ref.at[b, rows, h, cols], sc["do_s"].at[slot], bar)
        plgpu.copy_gmem_to_smem(states_ref.at[b, h, n, :, cols], sc["S_s"].at[slot], bar)
        fetch_decay(a_ref, sc, gate, b, h, rows, slot, bar)

    def load_final(row):
        """(h_T, dh_T) of state row `row`, through the one staging tile, into registers."""
        stage = sc["state_stage"]
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # a TMA store may still read the stage
        finals = []
        for ref in (hT_ref, dhT_ref):
            plgpu.commit_smem()  # earlier register reads of the stage come before the TMA write
            plgpu.copy_gmem_to_smem(ref.at[row, h, :, cols], stage, sc["state_bar"])
            plgpu.barrier_wait(sc["state_bar"])
            finals.append(plgpu.load(stage, layout=WGMMA))
        return finals

    def store_tile(stage, value, dst):
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the stage's previous TMA store has read it
        stage[...] = value
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(stage, dst)

    def store_boundary(n, S_after, dS):
        """Σ_V S⁺ ⊙ dS, the gate gradient's carry at the chunk's end."""
        if boundary_ref is not None:
            boundary = plgpu.layout_cast(jnp.sum(S_after * dS, axis=1), ROWS)  # [K]
            store_tile(sc["bound_stage"], boundary, boundary_ref.at[j, b, h, n])

    def key_chunk_step(n, slot, dS, S_after):
        """Per-key-channel decay: gradients of chunk n (stored) and (dS entering chunk n, S),
        with the decays inside the K sums (`_channel`):
        dq = scale · e^{A} ⊙ (do Sᵀ) + Σ_j dP_ij k_j ⊙ e^{A_i − A_j},
        dk = e^{A_L − A} ⊙ (v dSᵀ) + Σ_i dP_ij q_i ⊙ e^{A_i − A_j},
        dv = (k ⊙ e^{A_L − A}) dS + scale · Pᵀ do,  dS ← e^{A_L} ⊙_rows dS + scale · (q ⊙ e^{A})ᵀ do."""
        rows = pl.ds(n * C, C)
        q_s, k_s, v_s, do_s = (sc[name].at[slot] for name in ("q_s", "k_s", "v_s", "do_s"))
        lo, scores, lhs, rhs = sc["S_lo"], sc["scores"], sc["lhs"], sc["rhs"]
        S = plgpu.load(sc["S_s"].at[slot], layout=WGMMA)  # [K, BV]
        store_boundary(n, S_after, dS)
        A = channel.gmem_load(a_ref.at[b, rows, h], WGMMA)  # [C, K]
        a_last_rows = channel.gmem_load(a_ref.at[b, n * C + C - 1, h], ROWS)  # [K] along dS's rows
        to_end = jnp.exp(along_cols(plgpu.load(sc["a_s"].at[slot, C - 1], layout=COLS), (C, K)) - A)
        q, k = (plgpu.load(x, layout=WGMMA).astype(F32) for x in (q_s, k_s))
        within = channel.Rows(sc["a_s"].at[slot], q_ref.at[b, rows, h], k_ref.at[b, rows, h], lhs, rhs)
        token, column = iota((C, C), 0), iota((C, C), 1)

        lo[...] = S.astype(dtype)
        dP = jnp.where(column <= token, scale * matmul(do_s, v_s.T, (C, C)), 0.0)
        scores[...] = dP.astype(dtype)
        plgpu.commit_smem()
        dq = channel.dq_within(dP, scores, k, A, within) + scale * jnp.exp(A) * matmul(do_s, lo.T, (C, K))
        store_tile(sc["dqk_stage"], dq, dq_ref.at[j, b, rows, h])

        lo[...] = dS.astype(dtype)
        dPt = jnp.where(token <= column, scale * matmul(v_s, do_s.T, (C, C)), 0.0)
        scores[...] = dPt.astype(dtype)
        plgpu.commit_smem()
        dk = channel.dk_within(dPt, scores, q, A, within) + to_end * matmul(v_s, lo.T, (C, K))
        store_tile(sc["dqk_stage"], dk, dk_ref.at[j, b, rows, h])

        scores[...] = (scale * channel.scores(q, k, A, within)).astype(dtype)
        rhs[...] = (k * to_end).astype(dtype)
        plgpu.commit_smem()
        dv = matmul(scores.T, do_s, (C, BV), init=matmul(rhs, lo, (C, BV)))
        store_tile(sc["dv_stage"], dv, dv_ref.at[b, rows, h, cols])

        lhs[...] = (q * jnp.exp(A)).astype(dtype)
        plgpu.commit_smem()
        decayed = dS * along_rows(jnp.exp(a_last_rows), (K, BV))
        return decayed + scale * matmul(lhs.T, do_s, (K, BV)), S

    def chunk_step(n, slot, dS, S_after):
        """Gradients of chunk n (stored); returns (dS entering chunk n, S entering chunk n)."""
        if gate == "key":
            return key_chunk_step(n, slot, dS, S_after)
        rows = pl.ds(n * C, C)
        q_s, k_s, v_s, do_s = (sc[name].at[slot] for name in ("q_s", "k_s", "v_s", "do_s"))
        S = plgpu.load(sc["S_s"].at[slot], layout=WGMMA)  # [K, BV]
        store_boundary(n, S_after, dS)
        if a_ref is None:
            a_rows = a_cols = None
            from_start = to_end = None
        else:
            a_rows = plgpu.load(sc["a_s"].at[slot], layout=ROWS)
            a_cols = plgpu.load(sc["a_cols_s"].at[slot], layout=COLS)
            a_last = sc["a_s"][slot, C - 1]
            from_start, to_end = jnp.exp(a_rows), jnp.exp(a_last - a_rows)  # e^{A_i}, e^{A_L − A_j}

        def rows_times(vec, x):
            return x if vec is None else x * along_rows(vec, x.shape)

        sc["S_lo"][...] = S.astype(dtype)
        sc["dS_lo"][...] = dS.astype(dtype)
        do = plgpu.load(do_s, layout=WGMMA).astype(F32)
        sc["do_dec"][...] = (scale * rows_times(from_start, do)).astype(dtype)

        def masked_scores(lhs, rhs_t, transposed):
            """scale · (lhs rhsᵀ) ⊙ D (or Dᵀ) -> the `scores` SMEM tile, as a wgmma operand."""
            product = matmul(lhs, rhs_t.T, (C, C))
            decay = causal_decay(a_rows, a_cols, C, transposed=transposed)
            sc["scores"][...] = (scale * product * decay).astype(dtype)
            plgpu.commit_smem()
            return sc["scores"]

        plgpu.commit_smem()
        inter = scale * rows_times(from_start, matmul(do_s, sc["S_lo"].T, (C, K)))
        dq = matmul(masked_scores(do_s, v_s, False), k_s, (C, K), init=inter)  # + dP k
        store_tile(sc["dqk_stage"], dq, dq_ref.at[j, b, rows, h])
        inter = rows_times(to_end, matmul(v_s, sc["dS_lo"].T, (C, K)))
        dk = matmul(masked_scores(v_s, do_s, True), q_s, (C, K), init=inter)  # + dPᵀ q
        store_tile(sc["dqk_stage"], dk, dk_ref.at[j, b, rows, h])
        inter = rows_times(to_end, matmul(k_s, sc["dS_lo"], (C, BV)))
        dv = matmul(masked_scores(k_s, q_s, True), do_s, (C, BV), init=inter)  # + Pᵀ do
        store_tile(sc["dv_stage"], dv, dv_ref.at[b, rows, h, cols])
        decayed = dS if a_ref is None else dS * jnp.exp(a_last)
        return matmul(q_s.T, sc["do_dec"], (K, BV), init=decayed), S

    def step(i, carry):
        n = N - 1 - i
        slot = lax.rem(i, slots)
        if slots == 1:
            fetch(n, 0)
        plgpu.barrier_wait(sc["in_bar"].at[slot])
        if slots == 2:

            @pl.when(n > 0)
            def _():
                fetch(n - 1, 1 - slot)

        return chunk_step(n, slot, *carry)

    def packed_step(i, carry):
        """A sequence's last chunk starts from its final state and its cotangent; its first
        chunk writes the gradient of its initial state."""
        n = N - 1 - i
        seq, first, last = sc["meta_s"][0, n], sc["meta_s"][1, n], sc["meta_s"][2, n]

        dS, S_after = carry
        S_after, dS = lax.cond(last > 0, lambda: load_final(seq), lambda: [S_after, dS])
        dS_entering, S = step(i, (dS, S_after))

        @pl.when(first > 0)
        def _():
            store_tile(sc["state_stage"], dS_entering, dh0_ref.at[seq, h, :, cols])

        return dS_entering, S

    if slots == 2:
        fetch(N - 1, 0)
    if varlen:
        plgpu.copy_gmem_to_smem(meta_ref, sc["meta_s"], sc["meta_bar"])
        plgpu.barrier_wait(sc["meta_bar"])
        zeros = plgpu.layout_cast(jnp.zeros((K, BV), F32), WGMMA)
        lax.fori_loop(0, N, packed_step, (zeros, zeros))
    else:
        S_final, dS_final = load_final(b)
        dS, _ = lax.fori_loop(0, N, step, (dS_final, S_final))
        store_tile(sc["state_stage"], dS, dh0_ref.at[b, h, :, cols])
    plgpu.wait_smem_to_gmem(0)


@functools.partial(jax.jit, static_argnames=("static",))
def chunk_backward(q, k, v, a, do, states, h_T, dh_T, meta=None, *, static):
    """Run the backward kernel (the driver's `ChunkKernels.backward` contract, `kernels/_driver.py`).

    **Arguments:**
    - `q`, `k`, `v`, `a`, `meta`: as for `chunk_forward`; `do` [B, Tp, H, V] in q's dtype.
    - `states`: [B, H, N, K, V] float32, the state entering every chunk.
    - `h_T`, `dh_T`: [R, H, K, V] float32, the final states and their cotangents.

    **Returns:** `(dq, dk, dv, dh0, boundary)`: dq and dk [B, Tp, H, K] float32 (summed over
    value blocks), dv [B, Tp, H, V] float32, dh0 [R, H, K, V] float32 (packed: written only
    for sequences that own a chunk), and (with a decay, else None) boundary [B, H, N, K]
    float32, Σ_V S⁺ ⊙ dS for the state leaving each chunk.
    """
    B, Tp, H, K = q.shape
    V, R = v.shape[-1], h_T.shape[0]
    gate = check_shapes(q, v, a, static)
    nV, N = V // BLOCK_V, Tp // CHUNK
    meta = None if meta is None else padded_meta(meta)
    slots = slots_that_fit(lambda s: smem_bytes(K, q.dtype, s, gate), f"backward at K={K}, gate {gate}")
    out_type = [
        output_type((nV, B, Tp, H, K), F32, q),
        output_type((nV, B, Tp, H, K), F32, q),
        output_type((B, Tp, H, V), F32, q),
        output_type((R, H, K, V), F32, q),
    ]
    if gate != "none":
        out_type.append(output_type((nV, B, H, N, K), F32, q))
    args = [q, k, v] + decay_operands(a, gate) + ([meta] if meta is not None else []) + [do, states, h_T, dh_T]
    body = functools.partial(
        _backward_body, gate=gate, scale=static.scale, varlen=meta is not None, shape=(B, Tp, H, K, V, N), slots=slots
    )
    kernel = plgpu.kernel(
        body, out_type=out_type,
        scratch_types=_scratch(K, q.dtype, slots, gate, 16 if meta is None else meta.shape[1],
                               5 + DECAY_COPIES[gate]),
        grid=(B, H, nV), grid_names=("b", "h", "j"), kernel_name="recurrax_mgpu_chunk_bwd", **kernel_params(static),
    )
    dq, dk, dv, dh0, *boundary = kernel(*args)
    return dq.sum(0), dk.sum(0), dv, dh0, (boundary[0].sum(0) if boundary else None)
