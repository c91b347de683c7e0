"""Mosaic GPU chunk kernels (Hopper) on CPU: Mosaic GPU interpret mode with race detection.

The kernels in `recurrax.kernels.mosaic_gpu` run through the Pallas driver
(`mosaic_gpu_interpret`) and are compared, output,
final state and every gradient, with the float64 reference. Interpret mode simulates the
GPU's memories, TMA and barriers; with `detect_races=True` (and `on_race="raise"`) a
happens-before race between a TMA copy and a register load/store fails the kernel call.
JAX 0.12 does not model wgmma's own SMEM reads in that detector (a TODO in its
`gpu_callbacks.wgmma`), so races against wgmma operands are not covered.

Shapes are the kernels' real tiles (chunk 64, head dims 64/128, BV = 64) with 1–3 chunks;
each case costs 8–21 s on a 2-core CPU (three kernels: forward, state recomputation,
backward; tracing and the interpreter's per-op callbacks dominate).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _cases import Case, make_inputs, max_rel_error, run_vjp

plgpu = pytest.importorskip("jax.experimental.pallas.mosaic_gpu")
if not hasattr(plgpu, "InterpretGPUParams"):
    pytest.skip(f"JAX {jax.__version__} has no Mosaic GPU interpret mode (InterpretGPUParams)", allow_module_level=True)

from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks  # noqa: E402

from recurrax.kernels.mosaic_gpu import SUPPORT, mosaic_gpu_interpret, mosaic_gpu_recurrent  # noqa: E402
from recurrax.tools.cases import canonical  # noqa: E402

MOSAIC = mosaic_gpu_interpret

BF16_TOL = 1e-2
"""Max-relative error allowed (the project's `max_rel_error`: max |x − ref| / max |ref|) for
bf16 inputs. The kernels round wgmma operands (q, k, v, do, the decayed values, P, dP, the
state and its gradient) to bf16 as tensor-core kernels do; measured 0.7e-3 to 6.5e-3.

g_gamma's gradient is a sum over B·T of per-token gate gradients that cancel to a much
smaller total: measured relative to that total it is 0.14 here (the Triton kernels with
the same bf16 rounding: 0.25 on the same case), so it is held instead to GAMMA_TOL relative
to Σ_{b,t} |dg_{b,t,h}| (the size of the terms summed), the `dg_gamma/terms` column:
measured 1.6e-2 (the per-token dg itself: 3.5e-3 max-relative, 1.2e-2 norm-relative)."""
GAMMA_TOL = 3e-2


def errors(case: Case, seed: int = 0) -> dict[str, tuple[float, float]]:
    """{name: (max-relative, norm-relative ‖x − ref‖ / ‖ref‖)} of the Mosaic GPU kernels vs
    the float64 reference, for the output, the final state and every gradient."""
    kwargs = make_inputs(case, seed)
    o, state, grads = run_vjp(MOSAIC, kwargs)
    if gpu_callbacks._races is not None:
        assert not gpu_callbacks.get_races().races_found
    exact = {k: (v.astype(jnp.float64) if hasattr(v, "dtype") and v.dtype == kwargs["query"].dtype else v)
             for k, v in kwargs.items()}
    o_ref, state_ref, grads_ref = run_vjp("reference", exact)
    pairs = {"output": (o, o_ref), "final_state": (state, state_ref)}
    pairs.update({"d" + name: (grad, grads_ref[name]) for name, grad in grads.items()})
    out = {}
    for name, (x, y) in pairs.items():
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        assert np.isfinite(x).all(), name
        out[name] = (max_rel_error(x, y), float(np.linalg.norm(x - y) / max(np.linalg.norm(y), 1e-30)))
    if "g_gamma" in grads and "g" in grads:
        terms = np.sum(np.abs(np.asarray(grads_ref["g"], np.float64)), axis=tuple(range(grads_ref["g"].ndim - 1)))
        error = np.abs(np.asarray(grads["g_gamma"], np.float64) - np.asarray(grads_ref["g_gamma"]))
        out["dg_gamma/terms"] = (float(np.max(error / terms)), float(np.linalg.norm(error) / np.linalg.norm(terms)))
    return out


def check(case: Case):
    errs = errors(case)
    tol = {"dg_gamma": np.inf, "dg_gamma/terms": GAMMA_TOL}
    bad = {k: v for k, v in errs.items() if v[0] > tol.get(k, BF16_TOL)}
    assert not bad, f"{case}: {bad}\nall: {errs}"


BF16 = dict(B=1, H=2, Hkv=1, K=64, V=64, dtype="bfloat16")

CASES = [
    Case(T=100, **BF16),  # no decay, grouped heads, T padded to 2 chunks, initial state
    Case(T=128, gates=("g_head", "g_gamma"), reverse=True, **BF16),
    Case(**BF16, gates=("g_head",), cu_seqlens=(0, 50, 50, 150)),  # packed: an empty sequence, a boundary in a chunk
    Case(T=100, gates=("gk",), **BF16),  # per key channel: anchored sub-blocks and the exact diagonal
    Case(**BF16, gates=("g_channel",), cu_seqlens=(0, 50, 50, 150), reverse=True),
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_matches_float64_reference(case):
    check(case)


@pytest.mark.slow
@pytest.mark.parametrize(
    "case",
    [
        Case(**{**BF16, "K": 128}, T=130, gates=("g_head",)),
        Case(**{**BF16, "V": 128, "dtype": "float16"}, T=128, gates=("g_head",), initial_state=False),
        Case(**{**BF16, "K": 128, "V": 128}, T=64, gates=("g_gamma",), cu_seqlens=(0, 20, 64), reverse=True),
        # per channel at K = 128: one SMEM slot, the final states staged through the state slot
        Case(**{**BF16, "K": 128}, gates=("g_head", "gk"), cu_seqlens=(0, 50, 50, 150), reverse=True),
        Case(**{**BF16, "K": 128, "dtype": "float16"}, T=130, gates=("gk",)),
    ],
    ids=str,
)
def test_head_dims_slow(case):
    check(case)


def test_race_detector_is_on():
    """A kernel that reads SMEM while a TMA copy into it may still be in flight is reported."""
    from recurrax.kernels.mosaic_gpu._tiles import interpret_params

    def racy(x_ref, o_ref, x_s, bar):
        plgpu.copy_gmem_to_smem(x_ref, x_s, bar)
        o_ref[...] = x_s[...]  # no barrier_wait: races with the copy
        plgpu.barrier_wait(bar)

    kernel = plgpu.kernel(
        racy, out_type=jax.ShapeDtypeStruct((8, 128), jnp.float32),
        scratch_types=[plgpu.SMEM((8, 128), jnp.float32), plgpu.Barrier()], interpret=interpret_params(),
    )
    with pytest.raises(Exception, match="RACE"):
        jax.block_until_ready(kernel(jnp.ones((8, 128), jnp.float32)))
    from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import reset_gpu_interpret_mode_state

    reset_gpu_interpret_mode_state()


@pytest.mark.parametrize(
    "case",
    [
        Case(T=128, gates=("g_head",), **BF16),
        Case(**{**BF16, "K": 128, "V": 128}, gates=("g_gamma",), cu_seqlens=(0, 20, 150)),
        Case(**{**BF16, "K": 256}, T=64),
        Case(**{**BF16, "K": 128}, T=128, gates=("gk",), cu_seqlens=(0, 20, 150)),
    ],
    ids=["head-K64", "packed-K128", "none-K256-forward-only", "key-packed-K128"],
)
def test_lowers_for_hopper(case):
    """The compiled (non-interpret) kernels lower to Mosaic GPU for `cuda` on a CPU host:
    register layouts, wgmma operand transforms and TMA tiles are checked; no GPU needed.
    K = 256 lowers the forward only: its backward needs more than 227 KiB of SMEM."""
    kwargs = make_inputs(case)
    names = [n for n in ("query", "key", "value", "g", "g_gamma", "initial_state") if n in kwargs]
    compiled = mosaic_gpu_recurrent

    def loss(*args):
        problem, config, _ = canonical({**kwargs, **dict(zip(names, args))})
        o, state = compiled(problem, scale=config.scale, reverse=False)
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(state)

    args = [kwargs[n] for n in names]
    forward_only = case.K > 128
    fn = loss if forward_only else jax.grad(loss, argnums=tuple(range(len(args))))
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("mosaic_gpu") >= (1 if forward_only else 3), "forward, state recomputation, backward"


def test_support_is_fail_closed():
    """Value-side decay, float32/float64, other head dims: refused with a reason, so dispatch
    falls back to the Triton kernels or XLA chunk; per-key-channel decay is accepted."""
    import dataclasses

    from recurrax import Request

    def refusal(**changes):
        case = dataclasses.replace(Case(T=8, **BF16), **changes)
        problem, _, _ = canonical(make_inputs(case))
        return SUPPORT.refusal(dataclasses.replace(Request.of(problem), backend="gpu"))

    assert "gate kinds ['value']" in refusal(gates=("gv",))
    assert "compute capability" in refusal(gates=("gk",))  # accepted up to the device check
    assert "dtype float32" in refusal(dtype="float32")
    assert "qk_head_dim=32" in refusal(K=32)
    assert "v_head_dim=96" in refusal(V=96)
    assert "compute capability" in refusal(gates=("g_head",))  # this host has no Hopper GPU


def test_hard_reset_gives_the_minus_1e4_result():
    """A gate of −inf (log 0) at one token runs as −1e4 (`recurrax._core.finite`, applied by the
    kernel driver): output, final state and every gradient equal the −1e4 run, and are finite."""
    kwargs = make_inputs(Case(T=64, **{**BF16, "H": 1}, gates=("g_channel",)))
    runs = {}
    for value in (-np.inf, -1e4):
        g = np.array(kwargs["g"])
        g[0, 9, 0, :5] = value  # token 9, five key channels
        runs[value] = run_vjp(MOSAIC, {**kwargs, "g": g})
    for reset, floor in zip(jax.tree.leaves(runs[-np.inf]), jax.tree.leaves(runs[-1e4])):
        assert np.isfinite(np.asarray(reset, np.float64)).all()
        np.testing.assert_array_equal(np.asarray(reset), np.asarray(floor))


@pytest.mark.parametrize("array", ["value", "g"])
def test_non_finite_input_stays_causal(array):
    """A NaN at token 9 of row 0 leaves the outputs of tokens 0–8 and everything of row 1 (its
    output, final state and gradients) exactly as in the clean run (`recurrax._core.finite`)."""
    kwargs = make_inputs(Case(T=64, **{**BF16, "B": 2, "H": 1}, gates=("g_channel",)))
    clean = run_vjp(MOSAIC, kwargs)
    bad = np.array(kwargs[array])
    bad[0, 9, 0, 3] = np.nan
    o, state, grads = run_vjp(MOSAIC, {**kwargs, array: bad})
    o_clean, state_clean, grads_clean = clean
    np.testing.assert_array_equal(np.asarray(o[0, :9]), np.asarray(o_clean[0, :9]))
    np.testing.assert_array_equal(np.asarray(o[1]), np.asarray(o_clean[1]))
    np.testing.assert_array_equal(np.asarray(state[1]), np.asarray(state_clean[1]))
    for name, grad in grads.items():
        if np.ndim(grad) and np.shape(grad)[0] == 2:  # per-row arrays: row 1 untouched
            np.testing.assert_array_equal(np.asarray(grad[1]), np.asarray(grads_clean[name][1]), err_msg=name)


@pytest.mark.slow  # 40-70 s on a loaded 2-core CPU: two interpret-mode compiles
def test_mosaic_gpu_interpret_is_a_public_name_of_recurrent():
    """`implementation="mosaic_gpu_interpret"` runs these kernels in interpret mode on any backend
    (a CPU here): the same output and state as the driver's entry point, near the reference."""
    from recurrax.tools.cases import call

    kwargs = make_inputs(Case(T=20, gates=("g_head",), **BF16))
    by_name = call("mosaic_gpu_interpret", **kwargs)
    for got, want in zip(by_name, call(MOSAIC, **kwargs)):
        np.testing.assert_array_equal(np.asarray(got, np.float64), np.asarray(want, np.float64))
    exact = {k: (v.astype(jnp.float64) if hasattr(v, "dtype") and v.dtype == jnp.bfloat16 else v) for k, v in kwargs.items()}
    for got, want in zip(by_name, call("reference", **exact)):
        assert max_rel_error(got, want) <= BF16_TOL
