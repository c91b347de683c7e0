"""The shared harness lives in the package (`recurrax check` uses it too); tests import it here."""

from recurrax._testing import (  # noqa: F401
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
