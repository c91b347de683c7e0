"""`recurrent_step`: one-token decoding against `recurrent`, in float64 via the reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _cases import GATE_COMBOS, Case, float64, floor_tolerance, make_inputs, max_rel_error

import recurrax
from recurrax.recurrence._step import recurrent_step

PER_TOKEN = ("query", "key", "value", "g", "gk", "gv")
TOL = 1e-12


def token(kwargs: dict, t: int | slice) -> dict:
    """`recurrent_step`'s keyword arguments for token(s) `t` of a dense case's inputs."""
    step = {name: kwargs[name][:, t] for name in PER_TOKEN if name in kwargs}
    if "g_gamma" in kwargs:
        step["g_gamma"] = kwargs["g_gamma"]
    step["softmax_scale"] = kwargs.get("softmax_scale")
    return step


def call_step(args: dict, state):
    args = dict(args)
    q, k, v = args.pop("query"), args.pop("key"), args.pop("value")
    return recurrent_step(q, k, v, state, **args)


def reference(kwargs: dict, initial_state=None):
    args = {k: v for k, v in kwargs.items() if k not in ("initial_state", "reverse")}
    return recurrax.recurrent(**args, initial_state=initial_state, implementation="reference")


CASES = [Case(T=5, gates=gates) for gates in GATE_COMBOS] + [
    Case(T=4, H=6, Hkv=2, K=3, V=7, gates=("g_head", "gv"), scale=0.7),
    Case(T=3, H=2, Hkv=1, K=5, V=4, gates=("g_channel", "g_gamma")),
    Case(T=4, H=4, Hqk=2, gates=("g_head",)),  # query and key shared by two value heads each
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_token_by_token_equals_recurrent(case):
    kwargs = make_inputs(case)
    o_ref, state_ref = reference(kwargs, kwargs["initial_state"])
    state, outputs = kwargs["initial_state"], []
    for t in range(case.T):
        o_t, state = call_step(token(kwargs, t), state)
        assert o_t.shape == (case.B, case.H, case.V) and state.shape == state_ref.shape
        outputs.append(o_t)
    assert max_rel_error(jnp.stack(outputs, axis=1), o_ref) < TOL
    assert max_rel_error(state, state_ref) < TOL


@pytest.mark.parametrize("prefix", [1, 4, 6])
def test_prefix_then_steps_reproduces_the_whole_sequence(prefix):
    case = Case(T=7, gates=("g_channel", "g_gamma", "gv"))
    kwargs = make_inputs(case, seed=2)
    o_full, state_full = reference(kwargs, kwargs["initial_state"])
    o_prefix, state = reference({k: token(kwargs, slice(0, prefix)).get(k, v) for k, v in kwargs.items()},
                                kwargs["initial_state"])
    outputs = [o_prefix]
    for t in range(prefix, case.T):
        o_t, state = call_step(token(kwargs, t), state)
        outputs.append(o_t[:, None])
    assert max_rel_error(jnp.concatenate(outputs, axis=1), o_full) < TOL
    assert max_rel_error(state, state_full) < TOL


@pytest.mark.parametrize("tokens", [1, 5])
def test_several_tokens_at_once_equal_recurrent_with_initial_state(tokens):
    case = Case(T=tokens, gates=("g_head", "gk", "gv"))
    kwargs = make_inputs(case, seed=3)
    o_ref, state_ref = reference(kwargs, kwargs["initial_state"])
    o, state = call_step(token(kwargs, slice(None)), kwargs["initial_state"])
    assert o.shape == o_ref.shape
    assert max_rel_error(o, o_ref) < TOL and max_rel_error(state, state_ref) < TOL


def test_no_state_means_an_empty_history():
    kwargs = make_inputs(Case(T=1, gates=("g_head",)), seed=4)
    o_ref, state_ref = reference(kwargs)
    o, state = call_step(token(kwargs, 0), None)
    assert max_rel_error(o, o_ref[:, 0]) < TOL and max_rel_error(state, state_ref) < TOL


DIFFERENTIABLE = ("query", "key", "value", "g", "g_gamma", "gk", "gv", "initial_state")


@pytest.mark.parametrize("gates", [("g_head", "gk", "gv", "g_gamma"), ("g_channel",)], ids=str)
def test_gradients_through_steps_equal_gradients_of_recurrent(gates):
    """Three decoding steps, differentiated, against `recurrent` over the same three tokens."""
    case = Case(T=3, H=4, Hkv=2, K=4, V=3, gates=gates)
    kwargs = make_inputs(case, seed=5)
    diff = {k: v for k, v in kwargs.items() if k in DIFFERENTIABLE}
    rng = np.random.default_rng(6)
    w_o = jnp.asarray(rng.standard_normal((case.B, case.T, case.H, case.V)))
    w_s = jnp.asarray(rng.standard_normal((case.B, case.H, case.K, case.V)))

    def loss_recurrent(diff):
        o, state = reference({**kwargs, **diff}, diff["initial_state"])
        return jnp.sum(o * w_o) + jnp.sum(state * w_s)

    def loss_steps(diff):
        args, state, total = {**kwargs, **diff}, diff["initial_state"], 0.0
        for t in range(case.T):
            o_t, state = call_step(token(args, t), state)
            total = total + jnp.sum(o_t * w_o[:, t])
        return total + jnp.sum(state * w_s)

    expected, got = jax.grad(loss_recurrent)(diff), jax.jit(jax.grad(loss_steps))(diff)
    for name in diff:
        assert got[name].shape == diff[name].shape and got[name].dtype == diff[name].dtype, name
        assert max_rel_error(got[name], expected[name]) < 1e-11, name


def test_one_step_gradient_matches_finite_differences():
    kwargs = make_inputs(Case(B=1, T=1, H=2, Hkv=1, K=3, V=2, gates=("g_channel", "gv")), seed=7)
    args = token(kwargs, 0)
    diff = {k: args[k] for k in ("query", "key", "value", "g", "gv")} | {"state": kwargs["initial_state"]}
    weights = jnp.asarray(np.random.default_rng(8).standard_normal((1, 2, 2)))

    @jax.jit
    def loss(diff):
        diff = dict(diff)
        state = diff.pop("state")
        o, state = call_step({**args, **diff}, state)
        return jnp.sum(o * weights) + jnp.sum(state**2)

    grads, eps = jax.grad(loss)(diff), 1e-6
    for name, x in diff.items():
        flat = np.asarray(x).ravel()
        numeric = np.zeros_like(flat)
        for i in range(flat.size):
            bump = np.zeros_like(flat)
            bump[i] = eps
            plus = loss({**diff, name: jnp.asarray((flat + bump).reshape(x.shape))})
            minus = loss({**diff, name: jnp.asarray((flat - bump).reshape(x.shape))})
            numeric[i] = (plus - minus) / (2 * eps)
        assert max_rel_error(np.asarray(grads[name]).ravel(), numeric) < 1e-7, name


FLOAT32_CASES = [Case(T=1, K=16, V=12, gates=gates, dtype="float32") for gates in GATE_COMBOS] + [
    Case(T=1, H=6, Hqk=1, K=32, V=8, gates=("g_head",), dtype="float32"),  # Mamba-2's layout
]


@pytest.mark.parametrize("case", FLOAT32_CASES, ids=str)
def test_float32_step_within_the_rounding_floor_of_the_float64_step(case):
    """The step's reads come before its update (its sums in another order than the token
    loop's): in float32, within the rounding floor of the token loop's float32 reference."""
    kwargs = make_inputs(case, seed=10)
    arrays = {k: v for k, v in kwargs.items() if isinstance(v, jax.Array)}  # float32 (the case's dtype)
    exact = reference({**kwargs, **float64(arrays)}, float64(arrays["initial_state"]))
    floor = reference(kwargs, kwargs["initial_state"])
    o, state = jax.jit(call_step)(token(kwargs, 0), kwargs["initial_state"])
    assert o.dtype == jnp.float32 and state.dtype == jnp.float32
    for got, expected, rounded in ((o, exact[0][:, 0], floor[0][:, 0]), (state, exact[1], floor[1])):
        assert max_rel_error(got, expected) <= floor_tolerance(max_rel_error(rounded, expected))


def test_under_jit_with_bfloat16_inputs():
    kwargs = make_inputs(Case(T=1, gates=("g_head",), dtype="bfloat16"), seed=9)
    args = token(kwargs, 0)
    state = jnp.zeros((2, 4, 8, 6), jnp.float32)
    o, new_state = jax.jit(lambda args, state: call_step(args, state))(
        {k: v for k, v in args.items() if k != "softmax_scale"}, state
    )
    assert o.dtype == jnp.bfloat16 and o.shape == (2, 4, 6)
    assert new_state.dtype == jnp.float32 and new_state.shape == (2, 4, 8, 6)


B, H, HKV, K, V = 2, 4, 2, 8, 6


def step_inputs(**changes):
    rng = np.random.default_rng(0)
    args = dict(
        query=rng.standard_normal((B, H, K)),
        key=rng.standard_normal((B, HKV, K)),
        value=rng.standard_normal((B, HKV, V)),
        state=rng.standard_normal((B, H, K, V)),
    )
    args.update(changes)
    return {k: (jnp.asarray(v) if isinstance(v, np.ndarray) else v) for k, v in args.items()}


@pytest.mark.parametrize(
    "changes, name, error",
    [
        (dict(state=np.zeros((B, H, K, V + 1))), "state", ValueError),
        (dict(state=np.zeros((B + 1, H, K, V))), "state", ValueError),
        (dict(state=np.zeros((B, H, K, V), np.int32)), "state", TypeError),
        (dict(key=np.zeros((B, 3, K))), "key", ValueError),
        (dict(key=np.zeros((B, HKV, K + 1))), "key", ValueError),
        (dict(value=np.zeros((B, HKV))), "value", ValueError),
        (dict(query=np.zeros((B, K))), "query", ValueError),
        (dict(query=np.zeros((B, H, K), np.int32)), "query", TypeError),
        (dict(query=[[1.0]]), "query", TypeError),
        (dict(g=np.zeros((B, H + 1))), "g", ValueError),
        (dict(g=np.zeros((B, H, K + 1))), "g", ValueError),
        (dict(g=np.zeros(B)), "g", ValueError),
        (dict(g_gamma=np.zeros(H + 1)), "g_gamma", ValueError),
        (dict(gk=np.zeros((B, H, V))), "gk", ValueError),
        (dict(gv=np.zeros((B, H, K))), "gv", ValueError),
        (dict(softmax_scale="big"), "softmax_scale", TypeError),
    ],
    ids=lambda x: x if isinstance(x, str) else "",
)
def test_errors_name_the_argument(changes, name, error):
    args = step_inputs(**changes)
    q, k, v, state = (args.pop(n) for n in ("query", "key", "value", "state"))
    with pytest.raises(error, match=rf"^{name} "):
        recurrent_step(q, k, v, state, **args)


def test_errors_in_the_several_token_form_name_the_argument():
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((B, 3, H, K)))
    kv = jnp.asarray(rng.standard_normal((B, 3, HKV, K)))
    with pytest.raises(ValueError, match="^state "):
        recurrent_step(q, kv, kv, jnp.zeros((B, H, K, K + 2)))
    with pytest.raises(ValueError, match="^g "):
        recurrent_step(q, kv, kv, None, g=jnp.zeros((B, 2, H)))
