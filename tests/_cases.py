"""The shared harness is the one input maker, `recurrax.tools.cases` (`recurrax check` and the benchmarks use it too)."""

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
