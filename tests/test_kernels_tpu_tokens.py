"""`recurrent`'s token-major TPU forward (`TpuTiles(layout="tokens")`, `_token_forward`): TPU
interpret mode vs the float64 reference, gradients through the head-major backward it feeds.

Tolerances and the error measures are `test_kernels_tpu`'s (measured rounding floors: the
token-major forward does the same arithmetic as the head-major one, on per-head slices of
its blocks). Heads of K = 64 so that a step's heads are the chip's; two or all four heads a
grid step (interpret mode takes blocks of two heads, which Mosaic refuses: `token_problems`);
chunk 16 (interpret mode takes it) keeps T small.
"""

import functools

import jax
import jax.numpy as jnp
import pytest
from _cases import Case, make_inputs, split_args
from test_kernels_tpu import (BF16_G_GAMMA_TOL, BF16_GATE_TOL, BF16_TOL, F32_TOL, G_GAMMA_F32_TOL, _assert_lowered,
                              _assert_within, _pallas_operand_shapes, errors, export_tpu)

from recurrax.kernels.tpu import TpuTiles, tpu_interpret
from recurrax.kernels.tpu._tiles import Shapes
from recurrax.kernels.tpu._token_forward import token_problems
from recurrax.tools.cases import call


def tokens(heads: int | None):
    return functools.partial(tpu_interpret, tiles=TpuTiles(chunk=16, sub=8, block_v=64, heads=heads, layout="tokens"))


CASES = [  # (case, heads per grid step)
    # no decay, K = V = 64, two heads a step, an initial state
    (Case(B=2, T=33, H=4, Hkv=4, K=64, V=64, dtype="float32"), 2),
    # per-head g and g_gamma, V = 128, query/key heads shared by pairs, every head in one step, reverse
    (Case(B=1, T=33, Hqk=2, H=4, K=64, V=128, gates=("g_head", "g_gamma"), reverse=True, dtype="float32"), 4),
    # packed sequences (an empty one, boundaries inside chunks), one query/key head for four value
    # heads read by two steps of two
    (Case(T=40, Hqk=1, H=4, K=64, V=64, gates=("g_head",), cu_seqlens=(0, 3, 3, 20, 40), dtype="float32"), 2),
]


@pytest.mark.parametrize(("case", "heads"), CASES, ids=[f"{c}-Hb{h}" for c, h in CASES])
def test_token_major_forward_matches_reference(case, heads):
    """Outputs, final states and every gradient (q, k, v, g, g_gamma, h0) within the float32
    bounds of the head-major kernels."""
    _assert_within(errors(case, tokens(heads)), F32_TOL, g_gamma_tol=G_GAMMA_F32_TOL)


def test_token_major_forward_bfloat16():
    case = Case(B=1, T=20, H=2, Hkv=2, K=64, V=64, gates=("g_gamma",), dtype="bfloat16")
    _assert_within(errors(case, tokens(2)), BF16_TOL, BF16_GATE_TOL, BF16_G_GAMMA_TOL)


def test_token_major_forward_reads_the_drivers_arrays():
    """The forward kernels' operands are the driver's token-major arrays ([B, Tp, G, K],
    [B, Tp, H, V], the decay [B, Tp, H]): no head-major copy; the backward's stay head-major."""
    case = Case(B=1, T=40, Hqk=2, H=4, K=64, V=64, gates=("g_head",), dtype="float32")
    diff, rest = split_args(make_inputs(case))
    loss = lambda d: sum(jnp.sum(x) for x in call(tokens(2), **d, **rest))  # noqa: E731
    forward = _pallas_operand_shapes(jax.make_jaxpr(loss)(diff).jaxpr)
    assert forward == [(1, 48, 2, 64), (1, 48, 2, 64), (1, 48, 4, 64), (1, 48, 4), (1, 4, 64, 64)], forward
    backward = _pallas_operand_shapes(jax.make_jaxpr(jax.grad(loss))(diff).jaxpr)
    states, head_major = backward[5:9], backward[9:]  # after the forward: the states kernel reads k, v, A, h0
    assert states == [(1, 48, 2, 64), (1, 48, 4, 64), (1, 48, 4), (1, 4, 64, 64)], backward
    assert (1, 2, 48, 64) in head_major and (1, 48, 2, 64) not in head_major, backward


def test_token_blocks_mosaic_refuses_are_named():
    """A step's heads are its blocks' second-minor dim: a multiple of 8 or all of them."""
    s = Shapes(B=1, H=16, Tp=256, K=64, V=64, BV=64, C=128, c=16, G=16, Hb=2)
    assert len(token_problems(s)) == 2
    assert token_problems(Shapes(B=1, H=16, Tp=256, K=64, V=64, BV=64, C=128, c=16, G=16, Hb=8)) == []
    assert "query/key heads" in token_problems(Shapes(B=1, H=16, Tp=256, K=64, V=64, BV=64, C=128, c=16, G=2,
                                                      Hb=8))[0]
    assert token_problems(Shapes(B=1, H=1, Tp=256, K=64, V=64, BV=64, C=128, c=16, G=1, Hb=1)) == []
    with pytest.raises(ValueError, match="layout is one of"):
        TpuTiles(layout="rows")


def test_default_heads_of_the_token_major_forward_are_legal_blocks():
    """`heads=None`: the head-major default (the most up to 8 that divide H) where it is a legal
    token-major block, else all heads (12 heads: 6 is not a multiple of 8; a query/key head shared
    by 8 of 16 value heads: a step of 8 would read one of the 2 query/key heads)."""
    from recurrax.kernels._driver import KernelConfig
    from recurrax.kernels.tpu._token_forward import token_shapes
    from recurrax.problem import Gate

    static = KernelConfig(1.0, Gate.HEAD, interpret=False, tiles=TpuTiles(layout="tokens"))
    heads = lambda G, H: token_shapes(jax.ShapeDtypeStruct((1, 256, G, 64), jnp.bfloat16),  # noqa: E731
                                      jax.ShapeDtypeStruct((1, 256, H, 64), jnp.bfloat16), static).Hb
    assert (heads(16, 16), heads(32, 32), heads(12, 12), heads(2, 16), heads(4, 4)) == (8, 8, 12, 16, 4)


@pytest.mark.parametrize("gate_set", ["none", "head"])
def test_token_major_forward_lowers_to_mosaic(gate_set):
    """value_and_grad through the token-major forward (packed, reverse, a query/key head shared by
    both value heads) lowers for platforms=["tpu"]: forward, chunk states, backward."""
    tiles = TpuTiles(layout="tokens")
    _assert_lowered(export_tpu(gate_set, "bfloat16", 64, 64, varlen=True, reverse=True, tiles=tiles, Hqk=1))


@pytest.mark.parametrize(("G", "layout"), [(16, "tokens"), (8, "tokens"), (1, "tokens"), (2, "heads"), (4, "heads")])
def test_shared_query_key_heads_libtpu_cannot_compile_read_the_head_major_forward(G, layout):
    """Compiled, 2 or 4 query/key heads shared by 16 value heads crash libtpu's XLA (JAX 0.10.2)
    around the token-major forward: those run the head-major one (`token_major_takes`)."""
    from recurrax.kernels._driver import KernelConfig
    from recurrax.kernels.tpu._recurrent_forward import chunk_forward
    from recurrax.problem import Gate

    static = KernelConfig(1.0, Gate.HEAD, interpret=False, tiles=TpuTiles(layout="tokens"))
    qk, v = jax.ShapeDtypeStruct((1, 256, G, 64), jnp.bfloat16), jax.ShapeDtypeStruct((1, 256, 16, 64), jnp.bfloat16)
    a, h0 = jax.ShapeDtypeStruct((1, 256, 16), jnp.float32), jax.ShapeDtypeStruct((1, 16, 64, 64), jnp.float32)
    text = str(jax.make_jaxpr(lambda *x: chunk_forward(*x, static=static))(qk, qk, v, a, h0))
    name = {"tokens": "recurrax_tpu_tokens_fwd", "heads": "recurrax_tpu_chunk_fwd"}
    assert name[layout] in text and name[{"tokens": "heads", "heads": "tokens"}[layout]] not in text