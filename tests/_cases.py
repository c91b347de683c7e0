"""The shared harness is the one input maker, `recurrax.tools.cases` (`recurrax check` and the benchmarks use it too),
plus what several test files share."""

import pytest

from recurrax.tools.cases import (  # noqa: F401
    DIFF_ARGS,
    GATE_COMBOS,
    GATES,
    Case,
    assert_matches,
    canonical,
    compare,
    default_tolerance,
    make_inputs,
    max_rel_error,
    run_vjp,
    split_args,
)


def by_tier(names, fast):
    """`names` as pytest params, those not in `fast` marked slow (CI's default tier runs `fast`)."""
    return [pytest.param(name, marks=() if name in fast else pytest.mark.slow) for name in names]


FLOOR_FACTOR = 8.0
FLOOR_ABSOLUTE = 4 * 2.0**-23


def floor_tolerance(floor: float, factor: float = FLOOR_FACTOR) -> float:
    """A tolerance for two float32 computations of the same thing (sharded vs one device,
    cached vs parallel, …), from the rounding floor the test measures on the CPU it runs on.

    `floor` is the error, in the test's own metric, of one float32 computation against the
    same computation in float64 (same inputs, cast up). Each float32 result lies about `floor`
    from the exact one, so two of them differ by up to ~2·floor; another CPU's reduction order
    or vector width should move the floor and the difference together, which a fixed number
    written from one machine's figures does not (issue 31: 3.6e-6 on an AMD EPYC, 1.17e-5 on
    a Xeon, against a fixed 1e-5). Held to `factor` (8) times the floor — on an AMD EPYC the
    differences measured ≤ 2.2× their floors — plus 4·2⁻²³ ≈ 4.8e-7 (four float32 epsilons,
    relative) so that a floor which happens to round to ~0 does not demand bit equality."""
    return factor * float(floor) + FLOOR_ABSOLUTE


def float64(tree):
    """`tree` with its floating leaves cast to float64 (needs x64, which conftest.py enables)."""
    import jax
    import jax.numpy as jnp

    return jax.tree.map(lambda x: x.astype(jnp.float64) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


def compile_once_quickly(jitted, *args):
    """`jitted` (a `jax.jit` function) compiled for `args`' shapes at XLA's optimisation level
    0: a float64 computation run once or twice for a rounding floor compiles ~35% faster so."""
    return jitted.lower(*args).compile(compiler_options={"xla_backend_optimization_level": 0})


def equations(jaxpr, outside: tuple[str, ...] = ()):
    """Every equation of `jaxpr` and of the jaxprs inside its equations' parameters (scan,
    cond, custom_vjp, pallas_call, shard_map bodies), depth first; the bodies of the
    primitives named in `outside` (e.g. `"pallas_call"`: a kernel's own body) not entered."""
    for eqn in jaxpr.eqns:
        yield eqn
        if eqn.primitive.name in outside:
            continue
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                sub = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr's jaxpr
                if hasattr(sub, "eqns"):
                    yield from equations(sub, outside)
