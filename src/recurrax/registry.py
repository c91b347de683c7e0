"""The implementation registry: who can run a call, and who runs it.

Each implementation registers with a platform (how it is written), a backend (where it
runs), a priority and a `Support` declaration. Dispatch is fail-closed: a call goes only
to an implementation whose declaration covers it; with no name given, the highest
priority among those wins; a forced name that cannot take the call raises `ValueError`
saying why.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
from typing import Any

import jax


class Platform(str, enum.Enum):
    """How an implementation is written."""

    XLA = "xla"
    PALLAS = "pallas"
    TRITON = "triton"
    CUDA = "cuda"


class Backend(str, enum.Enum):
    """Where an implementation runs; `ANY` runs wherever JAX does."""

    CPU = "cpu"
    GPU = "gpu"
    TPU = "tpu"
    ANY = "any"


GATE_KINDS = frozenset({"head", "key", "value"})
"""Decay kinds of the canonical form: per-head scalar, per key channel, per value channel."""


@dataclasses.dataclass(frozen=True)
class Request:
    """The static facts of one call that an implementation may accept or refuse.

    **Arguments:**
    - `dtype`: the query's dtype name (`"float32"`, `"bfloat16"`, ...).
    - `gates`: which decay kinds are present (subset of `GATE_KINDS`).
    - `varlen`: whether the call is packed with `cu_seqlens`.
    - `backend`: the JAX backend the call runs on (`"cpu"`, `"gpu"`, `"tpu"`).
    - `qk_head_dim`, `v_head_dim`, `seq_len`: sizes, for implementations with tiling limits.
    """

    dtype: str
    gates: frozenset[str]
    varlen: bool
    backend: str
    qk_head_dim: int
    v_head_dim: int
    seq_len: int


@dataclasses.dataclass(frozen=True)
class Support:
    """What an implementation declares it can run. Nothing is implied: fail-closed.

    **Arguments:**
    - `dtypes`: accepted query dtype names.
    - `gates`: decay kinds it handles; a call with any other kind is refused.
    - `varlen`: whether packed `cu_seqlens` calls are accepted.
    - `check`: optional extra test returning a reason to refuse, or `None` to accept.
    """

    dtypes: frozenset[str]
    gates: frozenset[str] = frozenset()
    varlen: bool = False
    check: Callable[[Request], str | None] | None = None

    def refusal(self, request: Request) -> str | None:
        """Why this declaration does not cover `request`, or `None` when it does."""
        if request.dtype not in self.dtypes:
            return f"dtype {request.dtype} is not among {sorted(self.dtypes)}"
        missing = request.gates - self.gates
        if missing:
            return f"gate kinds {sorted(missing)} are not supported"
        if request.varlen and not self.varlen:
            return "packed variable-length input (cu_seqlens) is not supported"
        return self.check(request) if self.check is not None else None


@dataclasses.dataclass(frozen=True)
class Implementation:
    """One registered algorithm: `fn(problem, *, scale, reverse) -> (output, final_state)`."""

    name: str
    platform: Platform
    backend: Backend
    priority: int
    support: Support
    fn: Callable[..., Any]

    def refusal(self, request: Request) -> str | None:
        """Why this implementation cannot take `request`, or `None` when it can."""
        if self.backend is not Backend.ANY and self.backend.value != request.backend:
            return f"it runs on {self.backend.value}, this call is on {request.backend}"
        return self.support.refusal(request)


class KernelRegistry:
    """Named implementations of the recurrent operation."""

    def __init__(self) -> None:
        self._implementations: dict[str, Implementation] = {}

    def register(
        self,
        name: str,
        platform: Platform,
        backend: Backend,
        *,
        priority: int = 0,
        supports: Support,
    ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """Decorator registering `fn` under `name`; returns `fn` unchanged."""

        def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
            if name in self._implementations:
                raise ValueError(f"an implementation named {name!r} is already registered")
            self._implementations[name] = Implementation(
                name, Platform(platform), Backend(backend), priority, supports, fn
            )
            return fn

        return decorate

    def implementations(self) -> list[Implementation]:
        """Every registered implementation, highest priority first."""
        return sorted(self._implementations.values(), key=lambda impl: -impl.priority)

    def names(self) -> list[str]:
        return [impl.name for impl in self.implementations()]

    def get(self, name: str | None, request: Request) -> Implementation:
        """The implementation to run `request`: `name`'s if given, else the best supporting one."""
        if name is not None:
            return self._forced(name, request)
        refusals = []
        for impl in self.implementations():
            reason = impl.refusal(request)
            if reason is None:
                return impl
            refusals.append(f"  {impl.name}: {reason}")
        raise ValueError("no registered implementation supports this call:\n" + "\n".join(refusals))

    def _forced(self, name: str, request: Request) -> Implementation:
        if name not in self._implementations:
            raise ValueError(f"implementation must be one of {self.names()} or None, got {name!r}")
        impl = self._implementations[name]
        reason = impl.refusal(request)
        if reason is not None:
            raise ValueError(f"implementation={name!r} cannot run this call: {reason}")
        return impl


kernel_registry = KernelRegistry()


def current_backend() -> str:
    """The default JAX backend's name: `cpu`, `gpu` or `tpu`."""
    platform = jax.default_backend()
    return "gpu" if platform in ("cuda", "rocm") else platform
