"""The implementation registry: who can run a call, and who runs it (`KernelRegistry`,
`Selection`, `Support`, `Request`, the chip a call is judged for). (The code:
`recurrax/_core/registry.py`; `recurrent`'s table: `recurrax/recurrence/_implementations.py`.)"""

from ._core.registry import (
    ALL_GATES,
    FLOAT_DTYPES,
    Backend,
    Chip,
    Implementation,
    KernelRegistry,
    Platform,
    Request,
    Selection,
    Support,
    current_backend,
    current_chip,
    judging_for,
    kernel_registry,
)

__all__ = [
    "ALL_GATES",
    "FLOAT_DTYPES",
    "Backend",
    "Chip",
    "Implementation",
    "KernelRegistry",
    "Platform",
    "Request",
    "Selection",
    "Support",
    "current_backend",
    "current_chip",
    "judging_for",
    "kernel_registry",
]
