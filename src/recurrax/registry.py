"""The implementation registry: who can run a call, and who runs it.

Each implementation registers with a platform (how it is written), a backend (where it
runs), a priority and a `Support` declaration; the library's own registrations are the
table in `recurrax/implementations.py`. Dispatch is fail-closed: a call goes only
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
import jax.numpy as jnp

from .problem import Gate, Problem


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


FLOAT_DTYPES = frozenset({"float16", "bfloat16", "float32", "float64"})
"""Every floating-point input dtype (what the XLA algorithms accept)."""
ALL_GATES = frozenset(Gate)


@dataclasses.dataclass(frozen=True)
class Request:
    """The static facts of one call that an implementation may accept or refuse.

    **Arguments:**
    - `dtype`: the query's dtype name (`"float32"`, `"bfloat16"`, ...).
    - `gates`: which decay kinds (`Gate`) are present.
    - `varlen`: whether the call is packed with `cu_seqlens`.
    - `backend`: the JAX backend the call runs on (`"cpu"`, `"gpu"`, `"tpu"`).
    - `qk_head_dim`, `v_head_dim`, `seq_len`: sizes, for implementations with tiling limits.
    """

    dtype: str
    gates: frozenset[Gate]
    varlen: bool
    backend: str
    qk_head_dim: int
    v_head_dim: int
    seq_len: int

    @classmethod
    def of(cls, problem: Problem) -> Request:
        """The static facts of a canonical problem on the current backend."""
        _, T, _, K = problem.query.shape
        return cls(
            dtype=jnp.dtype(problem.query.dtype).name,
            gates=problem.gates,
            varlen=problem.cu_seqlens is not None,
            backend=current_backend(),
            qk_head_dim=K,
            v_head_dim=problem.value.shape[-1],
            seq_len=T,
        )


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
    gates: frozenset[Gate] = frozenset()
    varlen: bool = False
    check: Callable[[Request], str | None] | None = None

    def refusal(self, request: Request) -> str | None:
        """Why this declaration does not cover `request`, or `None` when it does."""
        if request.dtype not in self.dtypes:
            return f"dtype {request.dtype} is not among {sorted(self.dtypes)}"
        missing = request.gates - self.gates
        if missing:
            return f"gate kinds {sorted(getattr(kind, 'value', kind) for kind in missing)} are not supported"
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


@dataclasses.dataclass(frozen=True)
class Selection:
    """Which implementation a call gets, and what every registered one answered.

    **Arguments:**
    - `name`: the implementation dispatch picks (None when none can run the call).
    - `answers`: `(name, refusal)` for every implementation, highest priority first;
      `refusal` is None for those that can run the call.
    """

    name: str | None
    answers: tuple[tuple[str, str | None], ...]

    def __str__(self) -> str:
        lines = [f"runs: {self.name}" if self.name else "no registered implementation can run this call"]
        for name, refusal in self.answers:
            lines.append(f"  {name}: {'can run it' if refusal is None else 'refuses: ' + refusal}")
        return "\n".join(lines)


class KernelRegistry:
    """Named implementations of the recurrent operation."""

    def __init__(self) -> None:
        self._implementations: dict[str, Implementation] = {}
        self.unavailable: dict[str, str] = {}
        """Implementations this installation cannot offer at all (e.g. a JAX without the Pallas
        backend they are written for), with the reason; forcing one raises it."""

    def mark_unavailable(self, name: str, reason: str) -> None:
        """Record that `name` exists but cannot be registered here, and why."""
        self.unavailable[name] = reason

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

    def select(self, *arguments, implementation: str | None = None, **keyword_arguments) -> Selection:
        """Which implementation `recurrax.recurrent(*arguments, **keyword_arguments)` would run
        on this backend, and why the others refuse: a `Selection` (print it for a summary).

        Takes `recurrent`'s arguments (validated as `recurrent` validates them), or a single
        `Request`.
        """
        if len(arguments) == 1 and isinstance(arguments[0], Request) and not keyword_arguments:
            request = arguments[0]
        else:
            from .problem import Problem

            names = ("query", "key", "value", "g", "g_gamma", "gk", "gv", "softmax_scale", "initial_state",
                     "reverse", "cu_seqlens")
            given = {**dict(zip(names, arguments)), **keyword_arguments}
            given.pop("softmax_scale", None), given.pop("reverse", None)
            request = Request.of(Problem.create(**given))
        answers = tuple((impl.name, impl.refusal(request)) for impl in self.implementations())
        answers += tuple((name, f"not available here: {reason}") for name, reason in self.unavailable.items())
        if implementation is not None:
            chosen = self._forced(implementation, request).name
        else:
            chosen = next((name for name, refusal in answers if refusal is None), None)
        return Selection(chosen, answers)

    def _forced(self, name: str, request: Request) -> Implementation:
        if name in self.unavailable:
            raise ValueError(f"implementation={name!r} is not available here: {self.unavailable[name]}")
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
