"""Backward Mosaic GPU kernel of the chunk algorithm: dq, dk, dv, d(initial state), boundary.

| symbol  | meaning                                                                    |
|---------|----------------------------------------------------------------------------|
| C       | chunk length, 64 (the wgmma M)                                             |
| S       | [K, BV] float32 state entering chunk n (recomputed by the forward kernel)  |
| S⁺      | the state leaving chunk n: S of chunk n + 1, or h_T after the last chunk   |
| dS      | [K, BV] float32 gradient of S⁺, carried from the last chunk in SMEM (the state stage) |
| A_i, A_L| chunk-local cumulative log decay (per head), and A of the chunk's last token |
| D       | [C, C] D_ij = e^{A_i − A_j} for j ≤ i, else 0                                |

One program (one warpgroup, grid (B, H, V / BV)) walks the chunks from last to first,
starting from dS = dh_T. Differentiating the forward's chunk equations (`_recurrent_forward`):

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
per-chunk "boundary" term Σ_V S⁺ ⊙ dS (`recurrax.kernels._recurrent_driver.gate_gradient`). S⁺ of
chunk n is S of chunk n + 1 and dS the gradient that chunk n + 1's step returns, so the step
of chunk n + 1 writes chunk n's term at its end, from S still in its SMEM slot (no register
carry); a sequence's last chunk takes h_T ⊙ dh_T.

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

from ._layout import (DECAY_COPIES, check_shapes, chunk_inputs, decay_bytes, decay_operands, decay_scratch,
                      fetch_decay, kernel_params, padded_meta, slots_that_fit)
from .._driver import output_type
from . import _channel as channel
from ._tiles import (BLOCK_V, CHUNK, COLS, F32, ROWS, WGMMA, along_rows, causal_decay, iota, matmul,
                     matmuls, swizzled)


def _scratch(K: int, dtype, slots: int, gate: str, meta_cols: int, copies: int) -> dict:
    C, BV = CHUNK, BLOCK_V
    decay = decay_scratch(gate, slots, K, dtype)
    if gate != "key":  # (per key channel S_lo holds S, then dS)
        # dec: scale · e^{A} ⊙ do, then e^{A_L − A} ⊙ v
        decay.update(dS_lo=swizzled((K, BV), dtype), dec=swizzled((C, BV), dtype))
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
    work = K * BV * isz if gate == "key" else 2 * K * BV * isz + C * BV * isz  # S_lo (, dS_lo, dec)
    stage = 0 if _stage_in_state_slot(gate, slots) else K * BV * 4
    fixed = work + C * C * isz + C * K * 4 + C * BV * 4 + K * 4 + stage
    return slots * per_slot + fixed + decay_bytes(gate, slots, K, dtype)


def _backward_body(*refs, gate: str, scale: float, varlen: bool, shape, slots: int, **scratch):
    B, Tp, H, K, V, N = shape
    C, BV = CHUNK, BLOCK_V
    refs = list(refs)
    q_ref, k_ref, v_ref, a_ref, meta_ref = chunk_inputs(refs, gate, varlen)
    do_ref, states_ref, hT_ref, dhT_ref, dq_ref, dk_ref, dv_ref, dh0_ref, *rest = refs
    boundary_ref = rest[0] if rest else None
    sc = dict(scratch)
    shared_stage = _stage_in_state_slot(gate, slots)
    if shared_stage:
        sc["state_stage"] = sc["S_s"].at[0]
    dtype = sc["q_s"].dtype
    b, h, j = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("j")

    def read_dS(dS):
        """dS, [K, BV] float32: the loop's carry, or (None) the state staging tile's content."""
        return plgpu.load(sc["state_stage"], layout=WGMMA) if dS is None else dS

    def write_dS(dS):
        """The next carry: dS itself, or None after writing it to the staging tile, which
        (unless it is the state slot, `_stage_in_state_slot`) carries dS from chunk to chunk
        in SMEM rather than in 32–64 registers a thread. dh_T arrives there; dh0 leaves from
        there (after a dh0 store, the next chunk in the loop is a last one, whose `load_final`
        waits for that store before writing the stage)."""
        if shared_stage:
            return dS
        sc["state_stage"][...] = dS
        return None
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

    def load_final(row, refs):
        """The [K, BV] tiles of state row `row` of `refs` (h_T, dh_T), through the one staging
        tile, into registers."""
        stage = sc["state_stage"]
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # a TMA store may still read the stage
        finals = []
        for ref in refs:
            plgpu.commit_smem()  # earlier register reads of the stage come before the TMA write
            plgpu.copy_gmem_to_smem(ref.at[row, h, :, cols], stage, sc["state_bar"])
            plgpu.barrier_wait(sc["state_bar"])
            finals.append(plgpu.load(stage, layout=WGMMA))
        return finals

    def store_tile(stage, value, dst, untiled=False):
        """`value` to `dst` by TMA through `stage`; `untiled`: a plain register store, for a
        stage also read in another register layout (tiled ones would not lower)."""
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the stage's previous TMA store has read it
        if untiled:
            plgpu.store(stage, value, optimized=False)
        else:
            stage[...] = value
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(stage, dst)

    def store_boundary(n, S_after, dS):
        """Σ_V S⁺ ⊙ dS, the gate gradient's carry at the chunk's end."""
        if boundary_ref is not None:
            boundary = plgpu.layout_cast(jnp.sum(S_after * dS, axis=1), ROWS)  # [K]
            store_tile(sc["bound_stage"], boundary, boundary_ref.at[j, b, h, n])

    def key_chunk_step(n, slot, dS):
        """Per-key-channel decay: gradients of chunk n (stored) and dS entering chunk n,
        with the decays inside the K sums (`_channel`):
        dq = scale · e^{A} ⊙ (do Sᵀ) + Σ_j dP_ij k_j ⊙ e^{A_i − A_j},
        dk = e^{A_L − A} ⊙ (v dSᵀ) + Σ_i dP_ij q_i ⊙ e^{A_i − A_j},
        dv = (k ⊙ e^{A_L − A}) dS + scale · Pᵀ do,  dS ← e^{A_L} ⊙_rows dS + scale · (q ⊙ e^{A})ᵀ do.
        dq and dk are made one panel of key channels at a time, dv and dS' each take one
        wgmma accumulator (scale in the left operands)."""
        rows = pl.ds(n * C, C)
        q_s, k_s, v_s, do_s = (sc[name].at[slot] for name in ("q_s", "k_s", "v_s", "do_s"))
        lo, scores, lhs, rhs, stage = sc["S_lo"], sc["scores"], sc["lhs"], sc["rhs"], sc["dqk_stage"]
        columns_s = sc["dv_stage"]  # [C, C] float32 (BV = C): score columns for `_channel`, then dv
        within = channel.Rows(sc["a_s"].at[slot], q_ref.at[b, rows, h], k_ref.at[b, rows, h],
                              q_s, k_s, lhs, rhs)
        token, column = iota((C, C), 0), iota((C, C), 1)

        def store_panels(make, dst):
            """The [C, K] float32 tile made by `make(p)` per panel, to `dst` by TMA."""
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the stage's previous TMA store has read it
            for p in channel.panels(K):
                stage[:, channel.panel_cols(p)] = make(p)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(stage, dst)

        def masked_scores(lhs, rhs_t, transposed):
            """scale · (lhs rhsᵀ) masked to j ≤ i (or i ≤ j), [C, C] float32."""
            keep = token <= column if transposed else column <= token
            return jnp.where(keep, scale * matmul(lhs, rhs_t.T, (C, C)), 0.0)

        def score_operands(operand, transpose):
            """`scores` ← `operand` (the wgmma operand, input dtype); `columns_s` ← `transpose`
            (float32: its row j is column j of `operand`, read by `_channel`)."""
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # (dv's stage: its last store has read it)
            scores[...] = operand.astype(dtype)
            plgpu.store(columns_s, transpose, optimized=False)  # (read by rows: untiled)
            plgpu.commit_smem()

        lo[...] = plgpu.load(sc["S_s"].at[slot], layout=WGMMA).astype(dtype)
        score_operands(masked_scores(do_s, v_s, False), masked_scores(v_s, do_s, True))  # dP, dPᵀ

        def dq(p):  # (the inter-chunk product after the intra-chunk sums: not live through their loops)
            intra = channel.dq_within(scores, columns_s, within, p)
            inter = matmul(do_s, lo.at[channel.panel_cols(p)].T, (C, channel.PANEL))  # do Sᵀ on panel p
            return intra + scale * jnp.exp(within.A(p)) * inter

        store_panels(dq, dq_ref.at[j, b, rows, h])

        lo[...] = read_dS(dS).astype(dtype)
        score_operands(masked_scores(v_s, do_s, True), masked_scores(do_s, v_s, False))  # dPᵀ, dP

        def dk(p):
            intra = channel.dk_within(scores, columns_s, within, p)
            inter = matmul(v_s, lo.at[channel.panel_cols(p)].T, (C, channel.PANEL))  # v dSᵀ on panel p
            return intra + within.to_end(p) * inter

        store_panels(dk, dk_ref.at[j, b, rows, h])

        scores[...] = (scale * channel.scores(within)).astype(dtype)  # Pᵀ's operand (read transposed)
        for p in channel.panels(K):
            rhs[:, channel.panel_cols(p)] = (within.tile(k_s, p) * within.to_end(p)).astype(dtype)
        plgpu.commit_smem()
        store_tile(columns_s, matmuls([(scores.T, do_s), (rhs, lo)], (C, BV)), dv_ref.at[b, rows, h, cols], untiled=True)

        for p in channel.panels(K):
            lhs[:, channel.panel_cols(p)] = (scale * within.tile(q_s, p) * jnp.exp(within.A(p))).astype(dtype)
        plgpu.commit_smem()
        a_last_rows = channel.gmem_load(a_ref.at[b, n * C + C - 1, h], ROWS)  # [K] along dS's rows
        decayed = read_dS(dS) * along_rows(jnp.exp(a_last_rows), (K, BV))
        return write_dS(matmul(lhs.T, do_s, (K, BV), init=decayed))

    def chunk_step(n, slot, dS):
        """Gradients of chunk n (stored); returns dS entering chunk n.

        Row scalings of a product's rows are applied to its left operand (`dec`: scale ·
        e^{A} ⊙ do, then e^{A_L − A} ⊙ v), so dq and dk each take one wgmma accumulator
        for both of their products (fewer live register tiles)."""
        if gate == "key":
            return key_chunk_step(n, slot, dS)
        rows = pl.ds(n * C, C)
        q_s, k_s, v_s, do_s = (sc[name].at[slot] for name in ("q_s", "k_s", "v_s", "do_s"))
        S_lo, dS_lo, dec = sc["S_lo"], sc["dS_lo"], sc["dec"]
        if a_ref is None:
            a_rows = a_cols = from_start = to_end = None
        else:
            a_rows = plgpu.load(sc["a_s"].at[slot], layout=ROWS)
            a_cols = plgpu.load(sc["a_cols_s"].at[slot], layout=COLS)
            from_start, to_end = jnp.exp(a_rows), jnp.exp(sc["a_s"][slot, C - 1] - a_rows)  # e^{A_i}, e^{A_L − A_j}

        def rows_times(vec, x):
            return x if vec is None else x * along_rows(vec, x.shape)

        def masked_scores(lhs, rhs_t, transposed):
            """scale · (lhs rhsᵀ) ⊙ D (or Dᵀ) -> the `scores` SMEM tile, as a wgmma operand."""
            product = matmul(lhs, rhs_t.T, (C, C))
            sc["scores"][...] = causal_decay(scale * product, a_rows, a_cols, transposed=transposed).astype(dtype)
            plgpu.commit_smem()
            return sc["scores"]

        S_lo[...] = plgpu.load(sc["S_s"].at[slot], layout=WGMMA).astype(dtype)
        dS_lo[...] = read_dS(dS).astype(dtype)
        dec[...] = (scale * rows_times(from_start, plgpu.load(do_s, layout=WGMMA).astype(F32))).astype(dtype)
        plgpu.commit_smem()
        dq = matmuls([(dec, S_lo.T), (masked_scores(do_s, v_s, False), k_s)], (C, K))  # + dP k
        store_tile(sc["dqk_stage"], dq, dq_ref.at[j, b, rows, h])
        dS_out = matmul(q_s.T, dec, (K, BV))  # dS is read after the product: not live beside its accumulator
        decayed = read_dS(dS) if a_ref is None else read_dS(dS) * jnp.exp(sc["a_s"][slot, C - 1])
        dS = write_dS(dS_out + decayed)  # the old dS lives on in dS_lo
        if to_end is None:
            v_dec = v_s
        else:
            dec[...] = rows_times(to_end, plgpu.load(v_s, layout=WGMMA).astype(F32)).astype(dtype)
            plgpu.commit_smem()
            v_dec = dec
        dk = matmuls([(v_dec, dS_lo.T), (masked_scores(v_s, do_s, True), q_s)], (C, K))  # + dPᵀ q
        store_tile(sc["dqk_stage"], dk, dk_ref.at[j, b, rows, h])
        inter = rows_times(to_end, matmul(k_s, dS_lo, (C, BV)))
        dv = matmul(masked_scores(k_s, q_s, True), do_s, (C, BV), init=inter)  # + Pᵀ do
        store_tile(sc["dv_stage"], dv, dv_ref.at[b, rows, h, cols])
        return dS

    def step(i, dS, boundary_before):
        """Chunk n = N − 1 − i; with a decay and where `boundary_before`, also chunk n − 1's
        boundary Σ_V S ⊙ dS (S entering chunk n is the state leaving n − 1, still in its slot)."""
        n = N - 1 - i
        slot = lax.rem(i, slots)
        if slots == 1:
            fetch(n, 0)
        plgpu.barrier_wait(sc["in_bar"].at[slot])
        if slots == 2:

            @pl.when(n > 0)
            def _():
                fetch(n - 1, 1 - slot)

        dS = chunk_step(n, slot, dS)

        if boundary_ref is not None:

            @pl.when(boundary_before)
            def _():
                store_boundary(n - 1, plgpu.load(sc["S_s"].at[slot], layout=WGMMA), read_dS(dS))

        return dS

    def entering_final(row, n):
        """dh_T of state row `row` as the carry (`write_dS`; and chunk n's boundary Σ_V h_T ⊙ dh_T)."""
        if boundary_ref is None:
            dh_T = load_final(row, [dhT_ref])[0]
        else:
            h_T, dh_T = load_final(row, [hT_ref, dhT_ref])
            store_boundary(n, h_T, dh_T)
        return dh_T if shared_stage else None  # (else dh_T is in the staging tile already)

    def packed_step(i, dS):
        """A sequence's last chunk starts from its final state's cotangent; its first chunk
        writes the gradient of its initial state."""
        n = N - 1 - i
        seq, first, last = sc["meta_s"][0, n], sc["meta_s"][1, n], sc["meta_s"][2, n]
        if shared_stage:
            dS = lax.cond(last > 0, lambda: entering_final(seq, n), lambda: dS)
        else:
            pl.when(last > 0)(lambda: entering_final(seq, n))
        after_last = sc["meta_s"][2, jnp.maximum(n - 1, 0)] > 0  # chunk n − 1 ends a sequence
        dS_entering = step(i, dS, (n > 0) & jnp.logical_not(after_last))
        pl.when(first > 0)(lambda: store_dh0(dS_entering, dh0_ref.at[seq, h, :, cols]))
        return dS_entering

    def store_dh0(dS, dst):
        if dS is None:  # already in the staging tile
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(sc["state_stage"], dst)
        else:
            store_tile(sc["state_stage"], dS, dst)

    if slots == 2:
        fetch(N - 1, 0)
    if varlen:
        plgpu.copy_gmem_to_smem(meta_ref, sc["meta_s"], sc["meta_bar"])
        plgpu.barrier_wait(sc["meta_bar"])
        zeros = plgpu.layout_cast(jnp.zeros((K, BV), F32), WGMMA)
        # unused trailing chunks (owned by the last sequence, neither first nor last) start from dS = 0
        pl.when(sc["meta_s"][2, N - 1] == 0)(lambda: store_boundary(N - 1, zeros, zeros))
        lax.fori_loop(0, N, packed_step, zeros if shared_stage else write_dS(zeros))
    else:
        dS = entering_final(b, N - 1)
        dS = lax.fori_loop(0, N, lambda i, dS: step(i, dS, i < N - 1), dS)
        store_dh0(dS, dh0_ref.at[b, h, :, cols])
    plgpu.wait_smem_to_gmem(0)


@functools.partial(jax.jit, static_argnames=("static",))
def chunk_backward(q, k, v, a, do, states, h_T, dh_T, meta=None, *, static):
    """Run the backward kernel (the driver's `PallasBackend.backward` contract, `kernels/_recurrent_driver.py`).

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
