"""The implementation registry: who can run a call, and who runs it.

Each implementation registers with a platform (how it is written), a backend (where it
runs), a priority and a `Support` declaration; the library's own registrations are the
tables in `recurrax/recurrence/_implementations.py` and `recurrax/delta/_implementations.py`.
Dispatch is fail-closed: a call goes only to an implementation whose declaration covers it;
with no name given, the highest priority among those wins; a forced name that cannot take
the call raises `ValueError` saying why.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import enum
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp

from .matmul_precision import matmul_precision
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
    - `chip`: the device the call is compiled for (`current_chip()`); `None` in a hand-made
      request means this host's first device.
    - `heads`, `qk_heads`: value heads and query/key heads, for implementations whose tiles
      span heads (None in a hand-made request: not judged).
    """

    dtype: str
    gates: frozenset[Gate]
    varlen: bool
    backend: str
    qk_head_dim: int
    v_head_dim: int
    seq_len: int
    chip: Chip | None = None
    heads: int | None = None
    qk_heads: int | None = None

    @property
    def device(self) -> Chip:
        """The chip to judge architecture support against: `chip`, else this host's; one of
        another backend than `backend` counts as an unknown chip of `backend`."""
        chip = self.chip if self.chip is not None else host_chip()
        return chip if chip.backend == self.backend else Chip(self.backend)

    @classmethod
    def of(cls, problem: Problem) -> Request:
        """The static facts of a canonical problem on the current chip (`current_chip()`)."""
        _, T, G, K = problem.query.shape
        chip = current_chip()
        return cls(
            dtype=jnp.dtype(problem.query.dtype).name,
            gates=problem.gates,
            varlen=problem.cu_seqlens is not None,
            backend=chip.backend,
            qk_head_dim=K,
            v_head_dim=problem.value.shape[-1],
            seq_len=T,
            chip=chip,
            heads=problem.value.shape[2],
            qk_heads=G,
        )


@dataclasses.dataclass(frozen=True)
class Support:
    """What an implementation declares it can run. Nothing is implied: fail-closed.

    **Arguments:**
    - `dtypes`: accepted query dtype names.
    - `gates`: decay kinds it handles; a call with any other kind is refused.
    - `varlen`: whether packed `cu_seqlens` calls are accepted.
    - `check`: optional extra test returning a reason to refuse, or `None` to accept.
    - `shared_query_key`: whether it takes query and key shared by groups of heads as they
      are (`Problem.shares_query_key`); otherwise they reach it repeated to every head.
    """

    dtypes: frozenset[str]
    gates: frozenset[Gate] = frozenset()
    varlen: bool = False
    check: Callable[[Request], str | None] | None = None
    shared_query_key: bool = False

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
    """One registered algorithm: `fn(problem, *, scale, **options) -> (output, final_state)`
    (`recurrent`'s options: `reverse`; the delta rule has none)."""

    name: str
    platform: Platform
    backend: Backend
    priority: int
    support: Support
    fn: Callable[..., Any]
    passed_over: Callable[[Request], str | None] | None = None
    """Why dispatch skips it for a call it can run (a measurement on the chip found another
    faster), or None; a call that names it still gets it."""

    def refusal(self, request: Request) -> str | None:
        """Why this implementation cannot take `request`, or `None` when it can."""
        if self.backend is not Backend.ANY and self.backend.value != request.backend:
            return f"it runs on {self.backend.value}, this call is on {request.backend}"
        return self.support.refusal(request)

    def skipped(self, request: Request) -> str | None:
        """Why dispatch passes over a call this implementation can run, or None."""
        return self.passed_over(request) if self.passed_over is not None else None

    def run(self, problem: Problem, *, scale: float, precision: str | None = None, **options):
        """`fn` on a canonical problem, with shared query/key heads repeated first unless it
        takes them shared (`Support.shared_query_key`); the output in the query's dtype.
        An XLA algorithm traces its products at `precision` (a name `_matmul_precision.resolve`
        gave; `None` leaves the caller's); a kernel fixes its own."""
        dtype = problem.query.dtype
        if not self.support.shared_query_key:
            problem = problem.expanded()
        with matmul_precision(precision if self.platform is Platform.XLA else None):
            output, final_state = self.fn(problem, scale=scale, **options)
        return output.astype(dtype), final_state


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
    passed_over: tuple[tuple[str, str], ...] = ()
    """`(name, reason)` for each implementation that can run the call but that dispatch skips,
    with the measurement that decided it."""

    def __str__(self) -> str:
        lines = [f"runs: {self.name}" if self.name else "no registered implementation can run this call"]
        skipped = dict(self.passed_over)
        for name, refusal in self.answers:
            answer = "refuses: " + refusal if refusal is not None else "can run it"
            if name in skipped:
                answer += ", passed over: " + skipped[name]
            lines.append(f"  {name}: {answer}")
        return "\n".join(lines)


class KernelRegistry:
    """Named implementations of one operation (`recurrent`'s is `kernel_registry`, the delta
    rule's `recurrax.delta.kernel_registry`).

    **Arguments:**
    - `operation`: the public function's name, for messages.
    - `describe`: `(*arguments, **keyword_arguments) -> Request`, the operation's own
      validation of its arguments, used by `select` (default: `recurrent`'s).
    """

    def __init__(self, operation: str = "recurrent", describe: Callable[..., Request] | None = None) -> None:
        self.operation = operation
        self._describe = describe if describe is not None else _describe_recurrent
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
        passed_over: Callable[[Request], str | None] | None = None,
    ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """Decorator registering `fn` under `name`; returns `fn` unchanged. `passed_over`:
        why dispatch skips it for a call it can run (`Implementation.passed_over`)."""

        def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
            if name in self._implementations:
                raise ValueError(f"an implementation named {name!r} is already registered")
            self._implementations[name] = Implementation(
                name, Platform(platform), Backend(backend), priority, supports, fn, passed_over
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
        runnable = [impl for impl in self.implementations() if impl.refusal(request) is None]
        if not runnable:
            refusals = [f"  {impl.name}: {impl.refusal(request)}" for impl in self.implementations()]
            raise ValueError("no registered implementation supports this call:\n" + "\n".join(refusals))
        return next((impl for impl in runnable if impl.skipped(request) is None), runnable[0])

    def select(self, *arguments, implementation: str | None = None, **keyword_arguments) -> Selection:
        """Which implementation the operation called with `(*arguments, **keyword_arguments)`
        would run on this backend, and why the others refuse: a `Selection` (print it for a
        summary).

        Takes the operation's arguments (validated as the operation validates them), or a
        single `Request`.
        """
        if len(arguments) == 1 and isinstance(arguments[0], Request) and not keyword_arguments:
            request = arguments[0]
        else:
            request = self._describe(*arguments, **keyword_arguments)
        answers = tuple((impl.name, impl.refusal(request)) for impl in self.implementations())
        answers += tuple((name, f"not available here: {reason}") for name, reason in self.unavailable.items())
        passed_over = tuple((impl.name, impl.skipped(request)) for impl in self.implementations()
                            if impl.refusal(request) is None and impl.skipped(request) is not None)
        if implementation is not None:
            chosen = self._forced(implementation, request).name
        elif any(refusal is None for _, refusal in answers):
            chosen = self.get(None, request).name
        else:
            chosen = None
        return Selection(chosen, answers, passed_over)

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


def _describe_recurrent(*arguments, **keyword_arguments) -> Request:
    """The `Request` of `recurrax.recurrent(*arguments, **keyword_arguments)`."""
    names = ("query", "key", "value", "g", "g_gamma", "gk", "gv", "softmax_scale", "initial_state",
             "reverse", "cu_seqlens")
    given = {**dict(zip(names, arguments)), **keyword_arguments}
    given.pop("softmax_scale", None), given.pop("reverse", None)
    return Request.of(Problem.create(**given))


kernel_registry = KernelRegistry()


def current_backend() -> str:
    """The backend calls are judged for: `cpu`, `gpu` or `tpu` (`current_chip().backend`)."""
    return current_chip().backend


# ----------------------------------------------------------------------------- the chip a call is for


@dataclasses.dataclass(frozen=True)
class Chip:
    """The device a call is compiled for, as dispatch judges architecture support.

    **Arguments:**
    - `backend`: `"cpu"`, `"gpu"` or `"tpu"`.
    - `kind`: JAX's `device_kind` (`"NVIDIA H100 80GB HBM3"`, `"TPU v5 lite"`, ...).
    - `compute_capability`: `(major, minor)` of an NVIDIA GPU; `None` when unknown.
    - `generation`: a TPU's generation (`"v5e"`, `"v6e"`, `"v5p"`, ...); `None` when unknown.
    """

    backend: str
    kind: str = ""
    compute_capability: tuple[int, int] | None = None
    generation: str | None = None


GPU_CAPABILITIES = (
    ("GH200", (9, 0)), ("H100", (9, 0)), ("H200", (9, 0)), ("H800", (9, 0)), ("H20", (9, 0)),
    ("GB300", (10, 3)), ("B300", (10, 3)), ("GB200", (10, 0)), ("B200", (10, 0)),
    ("RTX PRO 6000 Blackwell", (12, 0)), ("RTX 50", (12, 0)),
    ("A100", (8, 0)), ("A800", (8, 0)), ("A10", (8, 6)), ("A40", (8, 6)), ("L40", (8, 9)), ("L4", (8, 9)),
)  # fmt: skip
"""Compute capability by a substring of an NVIDIA `device_kind` (first match wins): what an
abstract mesh, which names its device but not the capability, is judged by."""

TPU_GENERATIONS = {"TPU v4": "v4", "TPU v5 lite": "v5e", "TPU v5e": "v5e", "TPU v5": "v5p", "TPU v5p": "v5p",
                   "TPU v6 lite": "v6e", "TPU v6e": "v6e", "TPU7x": "v7x", "TPU v7x": "v7x"}
"""TPU generation by JAX's `device_kind`."""


def chip_of(platform: str, kind: str, compute_capability: Any = None) -> Chip:
    """The `Chip` of a device named by its platform and `device_kind` (and, for a real GPU, its
    `compute_capability` attribute, e.g. `"9.0"`)."""
    backend = "gpu" if platform in ("gpu", "cuda", "rocm") else platform
    if backend == "tpu":
        return Chip("tpu", kind, generation=TPU_GENERATIONS.get(kind))
    if backend != "gpu":
        return Chip(backend, kind)
    capability = _parsed_capability(compute_capability)
    if capability is None:
        capability = next((cc for name, cc in GPU_CAPABILITIES if name in kind), None)
    return Chip("gpu", kind, compute_capability=capability)


def _parsed_capability(value: Any) -> tuple[int, int] | None:
    try:
        major, minor = (str(value).split(".") + ["0"])[:2]
        return int(major), int(minor)
    except ValueError:
        return None


def host_chip() -> Chip:
    """This process's first JAX device as a `Chip`."""
    device = jax.devices()[0]
    return chip_of(device.platform, device.device_kind, getattr(device, "compute_capability", None))


_TARGET: contextvars.ContextVar[Chip | None] = contextvars.ContextVar("recurrax_target_chip", default=None)


@contextlib.contextmanager
def judging_for(chip: Chip | None) -> Iterator[Chip | None]:
    """Within this context, dispatch judges support for `chip` instead of this host's device
    (`recurrax.target(name)` enters it for a named chip); `None` judges the host again (or the
    abstract mesh's device)."""
    token = _TARGET.set(chip)
    try:
        yield chip
    finally:
        _TARGET.reset(token)


def judging_a_target() -> bool:
    """Whether a `judging_for` / `recurrax.target` context is active."""
    return _TARGET.get() is not None


def current_chip() -> Chip:
    """The chip dispatch judges a call for: the one set by `judging_for` / `recurrax.target`;
    else the device of the abstract mesh in use (`jax.sharding.use_abstract_mesh`, e.g. a
    deviceless topology's); else this host's first device."""
    explicit = _TARGET.get()
    if explicit is not None:
        return explicit
    mesh_chip = _abstract_mesh_chip()
    return mesh_chip if mesh_chip is not None else host_chip()


def _abstract_mesh_chip() -> Chip | None:
    get_mesh = getattr(jax.sharding, "get_abstract_mesh", None)
    mesh = get_mesh() if get_mesh is not None else None
    device = getattr(mesh, "abstract_device", None) if mesh is not None and not mesh.empty else None
    if device is None or not getattr(device, "platform", None):
        return None
    return chip_of(device.platform, device.device_kind or "")
