"""recurrax: linear-time recurrent (gated linear) attention for JAX.

Public entry points: `recurrent` (the operation), `recurrent_step` (decoding),
`delta_rule` and `delta_rule_step` (the delta rule, `recurrax.delta`),
`parallel.recurrent` (sequence parallelism); `Problem` (the canonical form) and the registry
(`kernel_registry`, `Platform`, `Backend`, `Request`, `Support`, `Chip`); `target(name)`, a
context in which dispatch judges a named chip, and `targets` (compiling for it without one);
`use_compilation_cache` (JAX's persistent compilation cache, on in the commands and examples). `docs/architecture.md`
maps the package.
"""

from . import decays, parallel, targets
from ._compilation_cache import use_compilation_cache
from ._core.problem import Gate, Problem, runtime_checks
from ._core.registry import Backend, Chip, Implementation, Platform, Request, Support, kernel_registry
from .delta import DeltaProblem, delta_rule, delta_rule_step
from .recurrence import recurrent, recurrent_step
from .targets import target

__all__ = [
    "Backend",
    "Chip",
    "DeltaProblem",
    "Gate",
    "Implementation",
    "Platform",
    "Problem",
    "Request",
    "Support",
    "decays",
    "delta_rule",
    "delta_rule_step",
    "kernel_registry",
    "parallel",
    "recurrent",
    "recurrent_step",
    "runtime_checks",
    "target",
    "targets",
    "use_compilation_cache",
]
__version__ = "0.1.0"
