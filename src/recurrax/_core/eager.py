"""Eager calls of the public entry points run one cached compiled program.

Called outside any transformation, `recurrent`, `recurrent_step` and `parallel.recurrent`
would otherwise execute their algorithms op by op: every `lax.scan` re-traced and
re-compiled on every call (hundreds of milliseconds for a tiny input). `cached_when_eager`
routes such calls through one `jax.jit` of the same function, keyed by the shapes and the
static options, so a second call with the same shapes reuses the compiled program. Under an
outer `jit`, `grad` or `vmap` (any argument a tracer), inside `runtime_checks()` or
`recurrax.target(...)` (the cache is keyed for this host's chip), or when a static option is
not hashable (it then fails validation with its own message), the function runs as it is.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import jax

from .problem import runtime_checks_enabled
from .registry import judging_a_target


def _hashable(value: Any) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True


def cached_when_eager(static_argnames: Sequence[str]) -> Callable:
    """Decorator: eager calls of `fn` go through one `jax.jit(fn, static_argnames=...)`."""

    def decorate(fn: Callable) -> Callable:
        signature = inspect.signature(fn)
        jitted = jax.jit(fn, static_argnames=tuple(static_argnames))

        @functools.wraps(fn)
        def call(*args, **kwargs):
            bound = signature.bind(*args, **kwargs)
            static = [bound.arguments[name] for name in static_argnames if name in bound.arguments]
            dynamic = [value for name, value in bound.arguments.items() if name not in static_argnames]
            traced = any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves(dynamic))
            if traced or runtime_checks_enabled() or judging_a_target() or not all(map(_hashable, static)):
                return fn(*args, **kwargs)
            return jitted(*args, **kwargs)

        call.jitted = jitted  # its `_cache_size()` counts the compiled programs (tests)
        return call

    return decorate
