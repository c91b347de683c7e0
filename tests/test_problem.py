"""The canonical form: every malformed argument fails at trace time with an error naming it;
`g_gamma` per row; grouped-head gradients summed in float32."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import recurrax
from _cases import Case, make_inputs, max_rel_error

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
    ("g_gamma", ValueError, good(g_gamma=jnp.zeros((B + 1, H)))),
    ("g_gamma", ValueError, good(g_gamma=jnp.zeros((B, H + 1)))),
    ("g_gamma", ValueError, good(g_gamma=jnp.zeros((1, 1, H)))),
    ("g_gamma", ValueError, packed(g_gamma=jnp.zeros((3, H)))),
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


def test_g_gamma_message_lists_the_accepted_shapes():
    with pytest.raises(ValueError) as info:
        recurrax.recurrent(**good(g_gamma=jnp.zeros((B + 1, H))))
    message = str(info.value)
    assert "[num_heads], [1, num_heads] or [batch, num_heads]" in message and f"({B + 1}, {H})" in message, message
    with pytest.raises(ValueError, match=r"\[num_seqs, num_heads\]"):
        recurrax.recurrent(**packed(g_gamma=jnp.zeros((3, H))))


# --------------------------------------------------------------------------- g_gamma per row

def _rows_case(packed_layout: bool) -> Case:
    cu = (0, 5, 5, 12, 20) if packed_layout else None
    return Case(B=3, T=20, H=4, Hkv=2, K=16, V=16, gates=("gk",), cu_seqlens=cu, packed_3d=packed_layout, dtype="float32")


def _token_rows(case: Case) -> np.ndarray:
    """The row (batch row, or packed sequence) of every token, flattened in token order."""
    if case.cu_seqlens is None:
        return np.repeat(np.arange(case.B), case.T)
    cu = np.asarray(case.cu_seqlens)
    return np.searchsorted(cu[1:], np.arange(cu[-1]), side="right")


def _g_gamma_as_g(g_gamma: np.ndarray, case: Case, lead: tuple) -> np.ndarray:
    """The same decay written out per token (the independent form): [*lead, H]."""
    rows = g_gamma.reshape(-1, g_gamma.shape[-1])  # [1 or R, H]
    token_rows = _token_rows(case) if rows.shape[0] > 1 else np.zeros(int(np.prod(lead)), int)
    return rows[token_rows].reshape(*lead, rows.shape[-1])


ROW_CASES = [("chunk", packed, rows) for packed in (False, True) for rows in ("[H]", "[1, H]", "[R, H]")] + [
    (name, packed, "[R, H]") for name in ("reference", "scan", "pallas_interpret") for packed in (False, True)
]


@pytest.mark.parametrize("implementation, packed_layout, rows", ROW_CASES, ids=str)
def test_g_gamma_per_row_matches_it_written_per_token(implementation, packed_layout, rows):
    """Every accepted g_gamma shape equals the same decays passed as a per-head `g`, under jit
    with a traced cu_seqlens; its gradient has the shape passed in and is the per-token
    gradient summed over each row's tokens."""
    case = _rows_case(packed_layout)
    kwargs = make_inputs(case)
    R, H_ = (len(case.cu_seqlens) - 1 if packed_layout else case.B), case.H
    rng = np.random.default_rng(3)
    g_gamma = {"[H]": -rng.uniform(0.01, 0.5, (H_,)), "[1, H]": -rng.uniform(0.01, 0.5, (1, H_)),
               "[R, H]": -rng.uniform(0.01, 0.5, (R, H_))}[rows].astype(np.float32)
    as_g = _g_gamma_as_g(g_gamma, case, kwargs["query"].shape[:-2]).astype(np.float32)
    cu = kwargs.pop("cu_seqlens", None)

    def loss(decay, name, cu):
        o, state = recurrax.recurrent(**kwargs, **{name: decay}, cu_seqlens=cu, implementation=implementation)
        return jnp.sum(o * o) + jnp.sum(jnp.sin(state)), (o, state)

    run = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=1)
    (_, (o, state)), d_gamma = run(jnp.asarray(g_gamma), "g_gamma", cu)
    (_, (o_ref, state_ref)), d_g = run(jnp.asarray(as_g), "g", cu)
    assert max_rel_error(o, o_ref) < 1e-5 and max_rel_error(state, state_ref) < 1e-5
    assert d_gamma.shape == g_gamma.shape
    d_g = np.asarray(d_g, np.float64).reshape(-1, as_g.shape[-1])
    if rows == "[R, H]":
        token_rows = _token_rows(case)
        want = np.stack([d_g[token_rows == r].sum(0) for r in range(R)])
    else:
        want = d_g.sum(0).reshape(g_gamma.shape)
    assert max_rel_error(d_gamma, want) < 1e-4


def test_g_gamma_per_row_in_recurrent_step_and_parallel():
    kwargs = make_inputs(Case(B=2, T=8, H=4, Hkv=4, K=4, V=4, gates=("g_head",), dtype="float32"))
    g_gamma = jnp.asarray([[-0.1, -0.2, -0.3, -0.4], [-0.5, -0.05, -0.01, -1.0]], jnp.float32)
    o, state = recurrax.recurrent(**kwargs, g_gamma=g_gamma)
    g = kwargs.pop("g")
    q, k, v = kwargs.pop("query"), kwargs.pop("key"), kwargs.pop("value")
    step_state = kwargs["initial_state"]
    for t in range(8):
        o_t, step_state = recurrax.recurrent_step(q[:, t], k[:, t], v[:, t], step_state, g=g[:, t], g_gamma=g_gamma)
        assert max_rel_error(o_t, o[:, t]) < 1e-5
    assert max_rel_error(step_state, state) < 1e-5
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("batch", "seq"))
    o_par, state_par = recurrax.parallel.recurrent(q, k, v, g=g, g_gamma=g_gamma, initial_state=kwargs["initial_state"],
                                                   mesh=mesh, sequence_axis="seq", batch_axis="batch")
    assert max_rel_error(o_par, o) < 1e-5 and max_rel_error(state_par, state) < 1e-5


# --------------------------------------------------------------------------- grouped heads in half precision


@pytest.mark.parametrize("implementation", ["reference", "scan", "chunk"])
@pytest.mark.parametrize("groups", [4, 8])
def test_grouped_head_gradients_are_rounded_once(implementation, groups):
    """fp16 dk, dv with a group of ≥ 4 query heads per kv head: within 0.5 ulp of the float64
    gradient of the same (fp16-representable) inputs, up to the float32 accumulation
    (2 float32 eps of the array's scale). Summing fp16-rounded per-head shares instead is off
    by hundreds of ulps on small entries. (The XLA algorithms compute in float32; the Pallas
    kernels round matmul operands to the input dtype, as tensor cores do, so their own error
    exceeds half an ulp whatever the group sum; the sum itself is the same float32 one.)"""
    Bq, Tq, Hkv, D = 2, 33, 2, 16
    rng = np.random.default_rng(0)
    half = lambda *shape: rng.standard_normal(shape).astype(np.float16).astype(np.float64)  # noqa: E731
    q, k, v, do = half(Bq, Tq, Hkv * groups, D), half(Bq, Tq, Hkv, D), half(Bq, Tq, Hkv, D), half(Bq, Tq, Hkv * groups, D)
    g = -rng.uniform(0, 0.5, (Bq, Tq, Hkv * groups)).astype(np.float16).astype(np.float64)

    def grads(dtype, name):
        def loss(k, v):
            o, _ = recurrax.recurrent(jnp.asarray(q, dtype), k, v, g=jnp.asarray(g, dtype), implementation=name)
            return jnp.vdot(o.astype(jnp.float64), do)

        return jax.grad(loss, argnums=(0, 1))(jnp.asarray(k, dtype), jnp.asarray(v, dtype))

    for got, exact in zip(grads(jnp.float16, implementation), grads(jnp.float64, "reference")):
        assert got.dtype == jnp.float16
        got, exact = np.asarray(got, np.float64), np.asarray(exact)
        half_ulp = 0.5 * np.spacing(np.abs(exact).astype(np.float16)).astype(np.float64)
        allowance = half_ulp + 2 * np.finfo(np.float32).eps * np.max(np.abs(exact))
        assert np.all(np.abs(got - exact) <= allowance), np.max((np.abs(got - exact) - half_ulp) / half_ulp)


def test_a_query_in_the_wrong_layout_is_named():
    """[batch, heads, seq_len, dim] instead of [batch, seq_len, heads, dim]: the key is refused,
    and the message says its expected dims come from the query."""
    with pytest.raises(ValueError, match=r"from query's shape \(2, 4, 5, 8\)"):
        recurrax.recurrent(jnp.ones((B, H, T, K)), jnp.ones((B, T, HKV, K)), jnp.ones((B, T, HKV, V)))


@pytest.mark.parametrize("cu_seqlens, message", [
    ([1, 3, 7], r"cu_seqlens must start at 0, got \[1, 3, 7\]"),
    ([0, 5, 3, 7], r"cu_seqlens must be non-decreasing, got \[0, 5, 3, 7\]"),
    ([0, 3, 6], r"cu_seqlens must end at the token count 7, got \[0, 3, 6\]"),
])
def test_concrete_cu_seqlens_messages_match_the_runtime_checks(cu_seqlens, message):
    """The eager checks word each fault as `runtime_checks()` does under jit."""
    with pytest.raises(ValueError, match=message):
        recurrax.recurrent(**packed(cu_seqlens=jnp.array(cu_seqlens)))


def test_query_and_key_shared_by_groups_of_value_heads():
    """Mamba-2's layout: query and key with fewer heads than value; gates and state per value head."""
    q, v = jnp.ones((B, T, 1, K)), jnp.ones((B, T, 3, V))
    o, state = recurrax.recurrent(q, q, v, g=jnp.zeros((B, T, 3)), initial_state=jnp.zeros((B, 3, K, V)))
    assert o.shape == (B, T, 3, V) and state.shape == (B, 3, K, V)
    problem = recurrax.Problem.create(query=q, key=q, value=v)
    assert problem.shares_query_key and problem.query.shape[2] == 1
    assert problem.expanded().query.shape == (B, T, 3, K) and not problem.expanded().shares_query_key
    with pytest.raises(ValueError, match="value must be a head count that num_heads=2 divides"):
        recurrax.recurrent(jnp.ones((B, T, 2, K)), jnp.ones((B, T, 2, K)), jnp.ones((B, T, 5, V)))
    with pytest.raises(ValueError, match=r"g must be .* = \[2, 5, 3\]"):
        recurrax.recurrent(q, q, v, g=jnp.zeros((B, T, 1)))
    with pytest.raises(ValueError, match="key must be a head count dividing num_heads=1"):
        recurrax.recurrent(q, jnp.ones((B, T, 3, K)), v)
