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
