"""Pallas TPU chunk kernels: TPU interpret mode vs the float64 reference, and Mosaic lowering.

(a) `tpu_interpret` runs the very kernels a TPU would run in Pallas's TPU interpret
mode on CPU; every output and gradient is compared with the reference in float64, by the
project's scale-relative `max_rel_error` and by the norm-relative ‖x − ref‖ / ‖ref‖.
Compilation dominates (seconds per distinct shape), hence tiny shapes (K, V ∈ {16, 32},
chunk 16, sub-blocks of 8: tiles Mosaic would refuse but interpret mode takes, chosen so
that T ≤ 33 crosses chunk and sub-block boundaries) and XLA's fast compile.
(b) `jax.export(..., platforms=["tpu"])` lowers forward and backward of every declared
configuration (`recurrax.kernels.tpu.SUPPORT`, `TILES`) to Mosaic, which checks the block
rules and the lowering of every primitive (not Mosaic's layout passes: those run in the
TPU compiler only).
"""

import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _cases import DIFF_ARGS, Case, canonical, equations, make_inputs, max_rel_error, split_args

from recurrax import Request
from recurrax.kernels import tpu as tpu_kernels
from recurrax.kernels.tpu import TpuTiles, tpu_interpret, tpu_recurrent
from recurrax.tools.cases import call

FAST_COMPILE = {"xla_backend_optimization_level": 0}
"""Interpret-mode programs are large; XLA's optimisation level 0 halves their compile time."""

F32_TOL = 5e-6
"""float32 inputs, scale-relative: measured ≤ 9e-7 on the small cases and ≤ 1.9e-6 with the
declared tiles (C = 128, T = 150, K = 64) on everything (outputs, final states, all
gradients) but g_gamma's gradient, a sum over B·T(·K) of per-token gate gradients that
cancel to a much smaller total, so its relative error grows with T·K: measured ≤ 5.2e-6
at T ≤ 32, K = 16, and 3.7e-5 at T = 150, K = 64 (chunk 128); held to 1e-4."""
G_GAMMA_F32_TOL = 1e-4

BF16_TOL = 1e-2
"""bfloat16 inputs, scale-relative, outputs, final states and q/k/v/initial-state gradients:
measured 6e-4 to 6.7e-3 (norm-relative 5.6e-4 to 3.8e-3). They are stored in bf16 (unit
roundoff 2⁻⁸ = 3.9e-3: the float64 answer rounded to bf16 is already 1.2e-3 to 3.3e-3
off, norm-relative 1.4e-3 to 1.7e-3) and the MXU operands (decayed q, k, the state, the
[C, C] scores) are rounded to bf16. With float32 MXU operands the outputs sit at that
rounding floor (2.9e-3 / 1.7e-3 on the per-head case, against 4.2e-3 / 2.4e-3)."""
BF16_GATE_TOL = 2e-2
"""Per-token gate gradients in bf16 (dq, dk rounding shows relative to the cancelling sum
q ⊙ dq − k ⊙ dk): measured 2.7e-3 to 1.1e-2 (norm-relative up to 1.3e-2)."""
BF16_G_GAMMA_TOL = 0.15
"""g_gamma's gradient in bf16: that sum further summed over B·T(·K); measured 8.9e-2
(5.8e-3 with float32 MXU operands), as the Triton kernels (5.5e-3 to 8.9e-2)."""

SMALL = dict(B=1, H=2, Hkv=1, K=16, V=16, dtype="float32")
TPU_INTERPRET = functools.partial(tpu_interpret, tiles=TpuTiles(chunk=16, sub=8, block_v=64))


def norm_rel_error(x, y) -> float:
    """‖x − y‖ / ‖y‖ over all elements."""
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    return float(np.linalg.norm(x - y) / max(np.linalg.norm(y), 1e-30)) if y.size else 0.0


def _outputs_and_grads(implementation, kwargs: dict, seed: int = 1):
    """(o, final state, gradients) under random cotangents, one fast-compiled program."""
    diff, rest = split_args(kwargs)
    rng = np.random.default_rng(seed)

    def forward_backward(diff, do, dstate):
        (o, state), pullback = jax.vjp(lambda diff: call(implementation, **diff, **rest), diff)
        (grads,) = pullback((do.astype(o.dtype), dstate.astype(state.dtype)))
        return o, state, grads

    (o_shape, state_shape) = jax.eval_shape(lambda d: call("reference", **d, **rest), diff)
    do = jnp.asarray(rng.standard_normal(o_shape.shape))
    dstate = jnp.asarray(rng.standard_normal(state_shape.shape))
    compiled = jax.jit(forward_backward).lower(diff, do, dstate).compile(compiler_options=FAST_COMPILE)
    return compiled(diff, do, dstate)


def errors(case: Case, implementation=TPU_INTERPRET, seed: int = 0) -> dict[str, tuple[float, float]]:
    """{output, final_state, d<argument>: (max_rel_error, norm_rel_error)} vs float64."""
    kwargs = make_inputs(case, seed)
    exact = {k: (v.astype(jnp.float64) if k in DIFF_ARGS else v) for k, v in kwargs.items()}
    o, state, grads = _outputs_and_grads(implementation, kwargs)
    o_ref, state_ref, grads_ref = _outputs_and_grads("reference", exact)
    assert o.dtype == kwargs["query"].dtype
    found = {"output": (o, o_ref), "final_state": (state, state_ref)}
    for name, grad in grads.items():
        assert grad.dtype == kwargs[name].dtype and grad.shape == kwargs[name].shape, name
        found["d" + name] = (grad, grads_ref[name])
    return {k: (max_rel_error(x, y), norm_rel_error(x, y)) for k, (x, y) in found.items()}


def _assert_within(errs: dict, tol: float, gate_tol: float | None = None, g_gamma_tol: float | None = None):
    """Every max_rel_error within `tol`; per-token gate gradients within `gate_tol`, g_gamma's
    within `g_gamma_tol` (both default to `tol`)."""
    limits = {"dg": gate_tol or tol, "dgk": gate_tol or tol, "dg_gamma": g_gamma_tol or gate_tol or tol}
    bad = {k: v for k, v in errs.items() if not v[0] <= limits.get(k, tol)}
    assert not bad, f"{bad} (tol {tol}, limits {limits})"


# ----------------------------------------------------------------------------- (a) interpret mode

CASES = [
    Case(T=20, **SMALL),  # no decay, T not a multiple of the chunk, grouped heads, initial state
    Case(T=20, gates=("g_head", "g_gamma"), reverse=True, **SMALL),
    Case(T=32, gates=("g_channel",), **SMALL),
    # packed input: empty sequences, a sequence across chunks, boundaries inside a chunk
    Case(**SMALL, gates=("g_head", "gk"), cu_seqlens=(0, 3, 3, 4, 30), packed_3d=True),
    Case(**SMALL, gates=("g_channel",), cu_seqlens=(0, 0, 17, 20), reverse=True),
    # query/key heads shared by groups of value heads (Mamba-2), read through the index maps
    Case(B=2, T=33, Hqk=2, H=4, K=16, V=32, gates=("g_head", "g_gamma"), reverse=True, dtype="float32"),
    Case(T=30, Hqk=1, H=2, K=16, V=16, gates=("g_channel",), cu_seqlens=(0, 3, 3, 17, 30), dtype="float32"),
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_tpu_interpret_matches_reference(case):
    _assert_within(errors(case), F32_TOL, g_gamma_tol=G_GAMMA_F32_TOL)


HEADS_CASES = [
    # four value heads in pairs sharing a query/key head: Hb = 1, 2 (one group a step), 4 (two)
    Case(B=2, T=33, Hqk=2, H=4, K=16, V=32, gates=("g_head", "g_gamma"), reverse=True, dtype="float32"),
    # packed, one query/key head shared by four value heads: Hb = 1, 2 (a group across two steps), 4
    Case(T=30, Hqk=1, H=4, K=16, V=16, gates=("g_channel",), cu_seqlens=(0, 3, 3, 17, 30), dtype="float32"),
    Case(T=20, H=4, Hkv=4, K=16, V=16, dtype="float32"),  # no decay, an initial state
]


@pytest.mark.parametrize("heads", [1, 2, 4])
@pytest.mark.parametrize("case", HEADS_CASES, ids=str)
def test_tpu_interpret_many_heads_per_grid_step(case, heads):
    """Hb heads per grid step ([Hb, C, D] blocks, a static loop over the heads): the same
    bounds as one head a step, grouped query/key heads read through the index maps."""
    implementation = functools.partial(tpu_interpret, tiles=TpuTiles(chunk=16, sub=8, block_v=64, heads=heads))
    _assert_within(errors(case, implementation), F32_TOL, g_gamma_tol=G_GAMMA_F32_TOL)


@pytest.mark.parametrize("group", [1, 2, 8])
def test_tpu_interpret_diagonal_groups(group):
    """The per-key-channel diagonal sub-block (8 rows) in groups of 1 (all block matmuls), 2 and
    8 (all element-wise) rows: the same bounds (the default, 4, runs in every other case)."""
    implementation = functools.partial(tpu_interpret, tiles=TpuTiles(chunk=16, sub=8, block_v=64, group=group))
    case = Case(T=32, gates=("g_channel",), reverse=True, **SMALL)
    _assert_within(errors(case, implementation), F32_TOL)


def _pallas_grids(jaxpr) -> list[tuple]:
    """The grid of every pallas_call in `jaxpr`, nested jaxprs included."""
    return [tuple(e.params["grid_mapping"].grid) for e in equations(jaxpr) if e.primitive.name == "pallas_call"]


@pytest.mark.parametrize(("heads", "steps"), [(None, 1), (2, 2), (1, 4)])
def test_a_grid_step_takes_the_tiles_heads(heads, steps):
    """The grid is (B, H / Hb, value blocks, chunks) in the forward and backward kernels;
    `heads=None` takes all four heads (they fit the scoped VMEM, `_vmem.py`)."""
    case = Case(B=1, T=40, Hqk=2, H=4, K=16, V=32, gates=("g_head",), dtype="float32")
    diff, rest = split_args(make_inputs(case))
    implementation = functools.partial(tpu_interpret, tiles=TpuTiles(chunk=16, sub=8, block_v=64, heads=heads))
    loss = lambda d: sum(jnp.sum(x) for x in call(implementation, **d, **rest))  # noqa: E731
    grids = _pallas_grids(jax.make_jaxpr(jax.grad(loss))(diff).jaxpr)
    assert grids == [(1, steps, 1, 3)] * 2, grids


def _pallas_kernels(jaxpr) -> list[tuple[str, int]]:
    """(name, number of results) of every pallas_call in `jaxpr`, nested jaxprs included."""
    return [(e.params["name"], len(e.outvars)) for e in equations(jaxpr)
            if e.primitive.name == "pallas_call"]


def test_the_backward_reads_the_states_the_differentiated_forward_wrote():
    """Forward and backward run two kernels: the forward, which writes o, h_T and the states
    entering every chunk (the backward's residual), and the backward; no kernel reruns the
    forward for the states. The forward alone (inference) writes o and h_T only."""
    case = Case(B=1, T=40, H=2, Hkv=2, K=16, V=16, gates=("g_head",), dtype="float32")
    diff, rest = split_args(make_inputs(case))
    loss = lambda d: sum(jnp.sum(x) for x in call(tpu_interpret, **d, **rest))  # noqa: E731
    kernels = _pallas_kernels(jax.make_jaxpr(jax.grad(loss))(diff).jaxpr)
    assert kernels == [("recurrax_tpu_chunk_fwd", 3), ("recurrax_tpu_chunk_bwd", 5)], kernels
    assert _pallas_kernels(jax.make_jaxpr(loss)(diff).jaxpr) == [("recurrax_tpu_chunk_fwd", 2)]


def test_heads_that_do_not_tile_the_heads_and_groups_not_powers_of_two_are_refused():
    kwargs = make_inputs(Case(T=20, Hqk=2, H=4, K=16, V=16, dtype="float32"))
    refused = {(3, 4): "heads=3 must divide the 4 value heads", (8, 4): "heads=8 must divide",
               (2, 3): "group=3 must be a power of two"}
    for (heads, group), reason in refused.items():
        tiles = TpuTiles(chunk=16, sub=8, block_v=64, heads=heads, group=group)
        implementation = functools.partial(tpu_interpret, tiles=tiles)
        with pytest.raises(ValueError, match=reason):
            call(implementation, **kwargs)
    shapes = tpu_kernels._tiles.Shapes(B=1, H=12, Tp=256, K=64, V=64, BV=64, C=128, c=16, G=2)  # groups of 6
    assert "multiple or a divisor of the 6" in tpu_kernels._tiles.heads_problems(shapes, 4)[0]
    assert tpu_kernels._tiles.heads_problems(shapes, 3) == tpu_kernels._tiles.heads_problems(shapes, 12) == []


def test_default_heads_are_the_most_that_fit_the_scoped_vmem():
    """`heads=None`: the most heads up to `MOST_HEADS` that tile H and whose blocks fit the
    generation's scoped VMEM, forward and backward judged apart."""
    from recurrax.kernels.tpu import _tiles
    from recurrax.kernels.tpu._vmem import vmem_problem
    from recurrax.problem import Gate

    shapes = _tiles.Shapes(B=4, H=16, Tp=4096, K=64, V=64, BV=64, C=128, c=16, G=16)
    assert _tiles.most_heads(shapes, Gate.KEY, jnp.bfloat16, backward=True) == _tiles.MOST_HEADS == 8
    wide = dataclasses.replace(shapes, K=256, V=256, BV=128, C=512)
    for backward in (False, True):
        heads = _tiles.most_heads(wide, Gate.KEY, jnp.float32, backward)
        assert 1 <= heads < 8 and 16 % heads == 0
        fits = lambda h: vmem_problem(512, 256, 128, jnp.float32, Gate.KEY, backward, None, heads=h) is None  # noqa: E731
        assert fits(heads) and (heads == 1 or not fits(2 * heads)), heads


def _pallas_operand_shapes(jaxpr, results: bool = False) -> list[tuple]:
    """The operand (or result) shapes of every pallas_call in `jaxpr`, nested jaxprs included."""
    return [tuple(v.aval.shape) for e in equations(jaxpr) if e.primitive.name == "pallas_call"
            for v in (e.outvars if results else e.invars)]


def test_no_kernel_array_has_a_minor_dimension_of_one():
    """TPU layouts pad an array's minor dimension to 128 lanes, so a [B, H, Tp, 1] decay column
    or a [.., K, 1] boundary term would take 128 times its bytes in HBM: the kernels read the
    per-head decay token-major [B, Tp, H] and write the boundary terms as rows."""
    case = Case(T=40, B=1, H=2, Hkv=2, K=16, V=32, gates=("g_head",), dtype="float32")
    diff, rest = split_args(make_inputs(case))
    loss = lambda d: sum(jnp.sum(x) for x in call(TPU_INTERPRET, **d, **rest))  # noqa: E731
    jaxpr = jax.make_jaxpr(jax.grad(loss))(diff).jaxpr
    shapes = _pallas_operand_shapes(jaxpr) + _pallas_operand_shapes(jaxpr, results=True)
    assert (1, 48, 2) in shapes  # the decay, token-major
    assert not [shape for shape in shapes if len(shape) > 2 and shape[-1] == 1], shapes


def test_shared_query_key_reaches_the_kernels_unrepeated():
    """Forward and backward kernels take one query/key head shared by four value heads as it
    is, lane-dense token-major [B, Tp, K]: no operand of theirs holds a per-value-head copy of
    q or k ([B, Tp, H · K]) or a transposed one; a step's view of it is lanes [0, K)."""
    case = Case(T=40, Hqk=1, H=4, K=16, V=32, gates=("g_head",), dtype="float32")
    diff, rest = split_args(make_inputs(case))
    loss = lambda d: sum(jnp.sum(x) for x in call(TPU_INTERPRET, **d, **rest))  # noqa: E731
    shapes = _pallas_operand_shapes(jax.make_jaxpr(jax.grad(loss))(diff).jaxpr)
    B, Tp = case.B, 48  # chunk 16
    assert (B, Tp, 16) in shapes and (B, Tp, 4 * 32) in shapes  # q, k one head; v four
    assert not {(B, Tp, 4 * 16), (B, 1, 16, Tp), (B, 4, 16, Tp)} & set(shapes), shapes


def _transposed_shapes(jaxpr) -> list[tuple]:
    """The operand shapes of every `transpose` outside the kernels (in-VMEM transposes are the
    point), nested jaxprs included."""
    return [tuple(e.invars[0].aval.shape) for e in equations(jaxpr, outside=("pallas_call",))
            if e.primitive.name == "transpose"]


@pytest.mark.parametrize(("gate_set", "Hqk"), [("none", None), ("head", None), ("both", None), ("channel", 1)])
def test_no_token_array_is_transposed_around_the_kernels(gate_set, Hqk):
    """The forward and backward kernels read q, k, v, do and the decay lane-dense token-major
    and write o, dq, dk, dv so: the program of value_and_grad through `pallas_tpu` transposes
    no array with a token axis (T = 200, Tp = 256) in XLA — no head-major or kᵀ copy."""
    case = Case(B=2, T=T_EXPORT, H=2, Hkv=1, K=64, V=128, gates=GATE_SETS[gate_set], dtype="bfloat16", Hqk=Hqk)
    diff, rest = split_args(make_inputs(case))

    def loss(diff):
        problem, config, _ = canonical({**rest, **diff})
        o, state = tpu_recurrent(problem, scale=config.scale, reverse=False)
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(state)

    shapes = _transposed_shapes(jax.make_jaxpr(jax.value_and_grad(loss))(diff).jaxpr)
    assert not [shape for shape in shapes if {T_EXPORT, 256} & set(shape)], shapes


SCANS = {"cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp", "reduce_window", "reduce_window_sum"}


GATE_GRADIENT_CASES = [("head", None, 64, 128, None), ("channel", None, 64, 64, None),
                       ("both", None, 128, 256, 1), ("head", 1, 64, 64, None)]


@pytest.mark.parametrize(("gate_set", "Hqk", "K", "V", "heads"), GATE_GRADIENT_CASES, ids=str)
def test_the_backward_forms_the_gate_gradient_in_the_kernel(gate_set, Hqk, K, V, heads):
    """Forward and backward of `pallas_tpu` (per head, per channel, both with two value blocks
    of 128; one query/key head shared by both value heads) run no cumulative sum outside the
    kernels with a per-head decay (the kernels form its chunk-local sums), one with a
    per-channel one (the forward's chunk-local decay, its residual, not recomputed), and
    transpose no array there: the backward kernel forms the gate gradient (q ⊙ dq − k ⊙ dk,
    its reverse sums within the chunk, the boundary term). With one value block and no shared heads,
    dq and dk leave the kernel in the caller's dtype (bf16), else float32 (summed after it); dv
    always in v's."""
    case = Case(B=2, T=T_EXPORT, H=2, Hkv=2, K=K, V=V, gates=GATE_SETS[gate_set], dtype="bfloat16", Hqk=Hqk)
    diff, rest = split_args(make_inputs(case))
    tiles = TpuTiles(heads=heads)

    def forward(diff):
        problem, config, _ = canonical({**rest, **diff})
        return tpu_recurrent(problem, scale=config.scale, reverse=False, tiles=tiles)

    def forward_backward(diff, cotangents):
        return jax.vjp(forward, diff)[1](cotangents)

    cotangents = jax.eval_shape(forward, diff)
    jaxpr = jax.make_jaxpr(forward_backward)(diff, cotangents).jaxpr
    outside = [e for e in equations(jaxpr, outside=("pallas_call",)) if e.primitive.name != "pallas_call"]
    scans = [(e.primitive.name, e.params.get("reverse")) for e in outside if e.primitive.name in SCANS]
    per_channel = "g_channel" in GATE_SETS[gate_set] or "gk" in GATE_SETS[gate_set]
    assert scans == ([("cumsum", False)] if per_channel else []), scans  # a per-channel decay's, once
    assert not [tuple(e.invars[0].aval.shape) for e in outside if e.primitive.name == "transpose"]
    backward = [e for e in equations(jaxpr) if e.primitive.name == "pallas_call" and len(e.outvars) >= 5]
    assert len(backward) == 1, [e.outvars for e in backward]
    dq, dk = (v.aval for v in backward[0].outvars[:2])
    exact = Hqk is None and V <= 128
    assert dq.shape == dk.shape == (1 if V <= 128 else 2, 2, 256, 2 * K), (dq, dk)
    assert dq.dtype == dk.dtype == jnp.dtype(jnp.bfloat16 if exact else jnp.float32), (dq, dk)
    assert backward[0].outvars[2].aval.dtype == jnp.bfloat16  # dv: v's dtype, never a partial sum


@pytest.mark.slow
def test_tpu_interpret_all_key_side_gates_slow():
    case = Case(**{**SMALL, "V": 32}, T=25, gates=("g_head", "g_gamma", "gk"), initial_state=False, scale=0.3)
    _assert_within(errors(case), F32_TOL, g_gamma_tol=G_GAMMA_F32_TOL)


@pytest.mark.parametrize("gates", [("g_head", "g_gamma"), ("g_channel",)], ids=str)
def test_tpu_interpret_bfloat16(gates):
    case = Case(T=20, gates=gates, **{**SMALL, "dtype": "bfloat16"})
    _assert_within(errors(case), BF16_TOL, BF16_GATE_TOL, BF16_G_GAMMA_TOL)


def test_tpu_interpret_extreme_decays_stay_finite():
    """Gates down to −1e4 (docs/design.md §1): every exponent the kernels evaluate is ≤ 0, so all
    results are finite and match. The true gate gradients are ~0 there (e^{−1e4}) and come
    back as sums of O(1) terms that cancel, so they are held to an absolute bound; so is the
    initial state's, which such resets zero in float64 and the kernels leave at e^−20 times O(1)
    terms (`kernels._driver.STRONGEST_DECAY`, below float32's rounding of those terms)."""
    case = Case(T=20, gates=("g_head", "gk"), gate_low=-1e4, **SMALL)
    kwargs = make_inputs(case)
    exact = {k: (v.astype(jnp.float64) if k in DIFF_ARGS else v) for k, v in kwargs.items()}
    got, want = _outputs_and_grads(TPU_INTERPRET, kwargs), _outputs_and_grads("reference", exact)
    (o, state, grads), (o_ref, state_ref, grads_ref) = got, want
    for x in jax.tree.leaves(got):
        assert np.isfinite(np.asarray(x, np.float64)).all()
    assert max_rel_error(o, o_ref) <= F32_TOL and max_rel_error(state, state_ref) <= F32_TOL
    for name in ("query", "key", "value"):
        assert max_rel_error(grads[name], grads_ref[name]) <= F32_TOL, name
    for name in ("g", "gk", "initial_state"):
        assert np.max(np.abs(np.asarray(grads[name], np.float64) - np.asarray(grads_ref[name]))) < 1e-4, name


@pytest.mark.slow
@pytest.mark.parametrize(
    "case",
    [
        Case(B=1, T=150, H=2, Hkv=1, K=64, V=64, gates=("g_channel", "g_gamma"), reverse=True, dtype="float32"),
        Case(B=1, T=150, H=2, Hkv=1, K=64, V=128, gates=("g_head",), dtype="bfloat16"),
    ],
    ids=str,
)
def test_tpu_interpret_declared_tiles_slow(case):
    """The declared tiles (C = 128, c = 16), interpret mode, two chunks."""
    implementation = tpu_interpret  # the declared tiles
    if case.dtype == "float32":
        _assert_within(errors(case, implementation), F32_TOL, g_gamma_tol=G_GAMMA_F32_TOL)
    else:
        _assert_within(errors(case, implementation), BF16_TOL, BF16_GATE_TOL, BF16_G_GAMMA_TOL)


# ----------------------------------------------------------------------------- (b) Mosaic lowering

GATE_SETS = {"none": (), "head": ("g_head", "g_gamma"), "channel": ("g_channel",), "both": ("g_head", "gk")}
DTYPES = ("bfloat16", "float32", "float16")
DIMS = tuple((K, V) for K in tpu_kernels.HEAD_DIMS for V in tpu_kernels.HEAD_DIMS)
T_EXPORT = 200  # two chunks of 128, the second partial
CU_SEQLENS = (0, 50, 50, 200)  # an empty sequence, a boundary inside a chunk


def export_tpu(gate_set: str, dtype: str, K: int, V: int, varlen: bool, reverse: bool, tiles=None, Hqk=None):
    """Lower value_and_grad of a loss through the TPU kernels for platforms=["tpu"]; the
    StableHLO text of the exported module (`Hqk`: query/key heads shared by the 2 value heads)."""
    case = Case(
        B=1 if varlen else 2, T=T_EXPORT, H=2, Hkv=1, K=K, V=V, gates=GATE_SETS[gate_set], dtype=dtype,
        reverse=reverse, cu_seqlens=CU_SEQLENS if varlen else None, Hqk=Hqk,
    )
    kwargs = make_inputs(case)
    diff, rest = split_args(kwargs)
    tiles = tpu_kernels.TILES if tiles is None else tiles

    def loss(diff):
        problem, config, _ = canonical({**rest, **diff})
        o, state = tpu_recurrent(problem, scale=config.scale, reverse=config.reverse, tiles=tiles)
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(state)

    exported = jax.export.export(jax.jit(jax.value_and_grad(loss)), platforms=["tpu"])(diff)
    return exported.mlir_module()


def _assert_lowered(text: str):
    assert text.count("tpu_custom_call") == 2  # forward (writing the chunk states), backward


GATES_X_DTYPES = list(itertools.product(GATE_SETS, DTYPES))


@pytest.mark.parametrize(("gate_set", "dtype"), GATES_X_DTYPES, ids=["-".join(p) for p in GATES_X_DTYPES])
def test_export_gates_and_dtypes(gate_set, dtype):
    _assert_lowered(export_tpu(gate_set, dtype, 128, 128, varlen=False, reverse=False))


@pytest.mark.parametrize("gate_set", ["head", "channel"])
def test_export_shared_query_key(gate_set):
    """One query/key head shared by both value heads (index maps h // 2) lowers to Mosaic."""
    _assert_lowered(export_tpu(gate_set, "bfloat16", 128, 64, varlen=True, reverse=False, Hqk=1))


FAST_DIMS = ((64, 64), (128, 256), (256, 128))


@pytest.mark.parametrize(("K", "V"), FAST_DIMS, ids=[f"K{K}-V{V}" for K, V in FAST_DIMS])
@pytest.mark.parametrize("gate_set", ["head", "channel"])
def test_export_head_dims(gate_set, K, V):
    """Representative head-dim pairs; every pair of the declaration lowers in the slow product below."""
    _assert_lowered(export_tpu(gate_set, "bfloat16", K, V, varlen=False, reverse=False))


@pytest.mark.parametrize(
    ("varlen", "reverse"), [(True, False), (False, True), (True, True)], ids=["varlen", "reverse", "varlen-reverse"]
)
@pytest.mark.parametrize("gate_set", list(GATE_SETS))
def test_export_varlen_and_reverse(gate_set, varlen, reverse):
    _assert_lowered(export_tpu(gate_set, "bfloat16", 64, 128, varlen=varlen, reverse=reverse))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("gate_set", "dtype", "dims", "varlen", "reverse"),
    list(itertools.product(GATE_SETS, DTYPES, DIMS, (False, True), (False, True))),
    ids=str,
)
def test_export_every_declared_configuration(gate_set, dtype, dims, varlen, reverse):
    _assert_lowered(export_tpu(gate_set, dtype, *dims, varlen=varlen, reverse=reverse))


def _vmapped_value_and_grad(implementation, kwargs):
    """vmap over a leading axis of queries of value_and_grad of a scalar loss."""

    def one(query):
        o, state = call(implementation, **{**kwargs, "query": query})
        return jnp.sum(o.astype(jnp.float32) ** 2) + jnp.sum(state)

    return jax.vmap(jax.value_and_grad(one))


def test_export_under_vmap():
    """vmap adds a grid axis in front of (b, h, j, n); the batched kernels still lower."""
    kwargs = make_inputs(Case(B=1, T=T_EXPORT, H=2, Hkv=1, K=128, V=128, gates=("g_channel",), dtype="bfloat16"))
    queries = jnp.stack([kwargs["query"], -kwargs["query"]])
    implementation = tpu_recurrent
    exported = jax.export.export(jax.jit(_vmapped_value_and_grad(implementation, kwargs)), platforms=["tpu"])
    _assert_lowered(exported(queries).mlir_module())


@pytest.mark.slow
def test_tpu_interpret_vmap_slow():
    kwargs = make_inputs(Case(T=20, gates=("g_head",), **SMALL))
    queries = jnp.stack([kwargs["query"], -2 * kwargs["query"]])
    got = _vmapped_value_and_grad(TPU_INTERPRET, kwargs)(queries)
    want = _vmapped_value_and_grad("reference", kwargs)(queries)
    for x, y in zip(got, want):
        assert max_rel_error(x, y) <= F32_TOL


def test_illegal_tiles_are_refused_before_mosaic():
    """One 64-wide head per grid step of two gives [C, 64] blocks of the lane-dense [B, Tp, 128]
    q and k: refused at trace time with the reason, and Mosaic's own block check refuses them
    too (shown by skipping ours). The delta rule's [C, C] transposes in VMEM refuse chunk 64."""
    bad = TpuTiles(heads=1)
    with pytest.raises(ValueError, match="heads=1 of K=64 are 64 lanes"):
        export_tpu("head", "bfloat16", 64, 128, False, False, tiles=bad)
    problems = tpu_kernels.mosaic_problems(
        tpu_kernels._tiles.Shapes(B=1, H=1, Tp=256, K=128, V=128, BV=64, C=64, c=8, delta=True), jnp.bfloat16)
    assert len(problems) == 3, problems  # chunk (lanes), sub (bf16 sublanes), block_v
    from recurrax.kernels.tpu import _tiles

    original = _tiles.check_tiles
    _tiles.check_tiles = lambda *args: None
    try:
        with pytest.raises(Exception, match="divisible by 8 and 128"):
            export_tpu("head", "bfloat16", 64, 128, False, False, tiles=bad)
    finally:
        _tiles.check_tiles = original


def test_chunks_of_64_and_256_lower():
    """The lane-dense blocks take any chunk that is a multiple of 16 rows (bf16); 64 and 256 lower."""
    for chunk in (64, 256):
        _assert_lowered(export_tpu("both", "bfloat16", 64, 64, False, False, tiles=TpuTiles(chunk=chunk)))


def test_declared_support():
    def request(**overrides):
        case = dataclasses.replace(Case(T=8, **{**SMALL, "K": 64, "V": 128}), **overrides)
        problem, _, _ = canonical(make_inputs(case))
        return Request.of(problem)

    assert tpu_kernels.SUPPORT.refusal(request(gates=("g_head", "gk"), dtype="bfloat16")) is None
    assert tpu_kernels.SUPPORT.refusal(request(cu_seqlens=(0, 3, 8))) is None
    assert "gate kinds" in tpu_kernels.SUPPORT.refusal(request(gates=("gv",)))
    assert "qk_head_dim=16" in tpu_kernels.SUPPORT.refusal(request(K=16))


def test_shared_query_key_heads_without_a_lane_dense_step_that_fits_are_refused():
    """64 value heads sharing two 64-wide query/key heads: a step's query/key block must be both
    heads (128 lanes), so all 64 value heads, which overflow the smallest scoped VMEM; dispatch
    hears why (`Request.heads`). Sixteen heads sharing two fit (all 16 in a step)."""
    from recurrax.kernels.tpu import _tiles
    from recurrax.problem import Gate

    refused = _tiles.tiling_problems(64, 2, 64, 64, Gate.HEAD, jnp.bfloat16)
    assert refused and "no heads per grid step give lane-dense blocks" in refused[0], refused
    assert _tiles.tiling_problems(16, 2, 64, 64, Gate.HEAD, jnp.bfloat16) == []
    assert _tiles.tiling_problems(16, 16, 64, 64, Gate.KEY, jnp.bfloat16) == []
    case = dataclasses.replace(Case(T=8, **{**SMALL, "K": 64, "V": 64}), H=64, Hkv=64, Hqk=2, gates=("g_head",),
                               dtype="bfloat16")
    problem, _, _ = canonical(make_inputs(case))
    assert "lane-dense" in tpu_kernels.SUPPORT.refusal(Request.of(problem))


@pytest.mark.slow  # 40-70 s on a loaded 2-core CPU: two interpret-mode compiles
def test_pallas_tpu_interpret_is_a_public_name_of_recurrent():
    """`implementation="pallas_tpu_interpret"` runs these kernels (declared tiles) in TPU
    interpret mode on any backend (a CPU here): the same output and state as the driver's
    entry point, near the float64 reference."""
    kwargs = make_inputs(Case(T=20, gates=("g_channel",), **SMALL))
    by_name = call("pallas_tpu_interpret", **kwargs)
    for got, want in zip(by_name, call(tpu_interpret, **kwargs)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    exact = {k: (v.astype(jnp.float64) if k in DIFF_ARGS else v) for k, v in kwargs.items()}
    for got, want in zip(by_name, call("reference", **exact)):
        assert max_rel_error(got, want) <= F32_TOL
