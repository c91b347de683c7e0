"""Each XLA path asks for the matmul precision it promises (`recurrax._core.matmul_precision`).

A CPU computes float32 products exactly whatever precision a program asks for, so these tests
read the traced programs instead: every `dot_general` of the forward and of every gradient.
float32 inputs with `precision=None` must trace every product at HIGHEST (a TPU's default is one
bfloat16 pass); `precision="default"` and bfloat16 inputs keep the one-pass products, except the
log-decay cumulative sums, which are at HIGHEST in every call.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _cases import equations
from jax.sharding import Mesh

import recurrax
from recurrax import parallel

HIGHEST = (jax.lax.Precision.HIGHEST, jax.lax.Precision.HIGHEST)
B, T, H, K, V = 1, 32, 2, 16, 16


def dot_precisions(jaxpr) -> list:
    """The `precision` of every dot_general in a jaxpr and all the jaxprs inside it."""
    return [e.params["precision"] for e in equations(jaxpr) if e.primitive.name == "dot_general"]


def arrays(dtype, gate: str, delta: bool) -> dict:
    rng = np.random.default_rng(0)
    normal = lambda *s: jnp.asarray(rng.standard_normal(s), dtype)  # noqa: E731
    log_decay = lambda *s: jnp.asarray(-np.abs(rng.standard_normal(s)) / 8, jnp.float32)  # noqa: E731
    out = {"query": normal(B, T, H, K), "key": normal(B, T, H, K), "value": normal(B, T, H, V)}
    if delta:
        out["beta"] = jnp.asarray(rng.uniform(0, 1, (B, T, H)), jnp.float32)
    out[{"g": "g", "gk": "gk", "gv": "gv"}[gate]] = log_decay(B, T, H, V if gate == "gv" else K) if gate != "g" \
        else log_decay(B, T, H)
    return out


def traced_precisions(call, inputs: dict) -> list:
    """Precisions of the forward and the gradient of every floating input."""

    def loss(inputs):
        output, final = call(**inputs)
        return jnp.sum(output.astype(jnp.float32) ** 2) + jnp.sum(final**2)

    return dot_precisions(jax.make_jaxpr(jax.value_and_grad(loss))(inputs).jaxpr)


OPERATIONS = [
    ("recurrent", name, gate) for name in ("chunk", "scan", "reference") for gate in ("g", "gk", "gv")
] + [("delta_rule", name, gate) for name in ("chunk", "scan", "reference") for gate in ("g", "gk")]


def call_of(operation: str, implementation: str, **options):
    def call(**inputs):
        if operation == "recurrent":
            return recurrax.recurrent(**inputs, implementation=implementation, **options)
        return recurrax.delta_rule(**inputs, qk_l2norm=True, implementation=implementation, **options)

    return call


@pytest.mark.parametrize("operation,implementation,gate", OPERATIONS)
def test_float32_products_are_at_highest(operation, implementation, gate):
    inputs = arrays(jnp.float32, gate, operation == "delta_rule")
    precisions = traced_precisions(call_of(operation, implementation), inputs)
    assert precisions, "the program has no products to check"
    assert all(p == HIGHEST for p in precisions), precisions


@pytest.mark.parametrize("operation,implementation,gate", [c for c in OPERATIONS if c[1] != "reference"])
def test_one_pass_when_asked_and_for_bfloat16(operation, implementation, gate):
    """`precision="default"` leaves the data's products at the backend default; bfloat16 inputs
    trace the very same precisions (only the gate sums at HIGHEST)."""
    delta = operation == "delta_rule"
    asked = traced_precisions(call_of(operation, implementation, precision="default"), arrays(jnp.float32, gate, delta))
    half = traced_precisions(call_of(operation, implementation), arrays(jnp.bfloat16, gate, delta))
    one_pass = [p for p in asked if p != HIGHEST]
    assert one_pass, "every product is still at HIGHEST"
    assert all(p in (None, (jax.lax.Precision.DEFAULT,) * 2) for p in one_pass), one_pass
    assert sorted(map(str, half)) == sorted(map(str, asked))


def test_decoding_steps_are_at_highest_for_float32():
    inputs = arrays(jnp.float32, "g", True)
    one_token = {name: x[:, 0] for name, x in inputs.items()}
    state = jnp.zeros((B, H, K, V), jnp.float32)
    step = lambda **kw: recurrax.delta_rule_step(**kw, state=state, qk_l2norm=True)  # noqa: E731
    precisions = traced_precisions(step, one_token)
    assert precisions and all(p == HIGHEST for p in precisions), precisions
    chunk_of_tokens = {name: x[:, :8] for name, x in inputs.items() if name != "beta"}
    step = lambda **kw: recurrax.recurrent_step(**kw, state=state)  # noqa: E731
    precisions = traced_precisions(step, chunk_of_tokens)
    assert precisions and all(p == HIGHEST for p in precisions), precisions


@pytest.mark.parametrize("operation", ["recurrent", "delta_rule"])
def test_sequence_parallel_products_are_at_highest(operation):
    mesh = Mesh(np.array(jax.devices()[:2]), ("seq",))
    inputs = arrays(jnp.float32, "gk", operation == "delta_rule")
    fn = getattr(parallel, operation)
    extra = {"qk_l2norm": True} if operation == "delta_rule" else {}
    precisions = traced_precisions(lambda **kw: fn(**kw, **extra, mesh=mesh, sequence_axis="seq"), inputs)
    assert precisions and all(p == HIGHEST for p in precisions), precisions


@pytest.mark.parametrize("bad", ["fast", 3, jnp.float32])
def test_an_unknown_precision_is_refused_by_name(bad):
    inputs = arrays(jnp.float32, "g", False)
    with pytest.raises(ValueError, match="precision"):
        recurrax.recurrent(**inputs, precision=bad)


@pytest.mark.parametrize("given,expected", [
    (None, "highest"), ("HIGHEST", "highest"), (jax.lax.Precision.DEFAULT, "default"), ("tensorfloat32", "tensorfloat32"),
])
def test_precision_is_resolved_from_the_inputs(given, expected):
    from recurrax._core.matmul_precision import resolve

    assert resolve(given, jnp.float32) == expected
    assert resolve(None, jnp.bfloat16) == "default"
