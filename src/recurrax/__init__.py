"""recurrax: linear-time recurrent (gated linear) attention for JAX."""

from . import reference as _reference  # noqa: F401  (registers "reference")
from . import scan as _scan  # noqa: F401  (registers "scan")
from ._inputs import Problem
from ._recurrent import recurrent
from .registry import Backend, Implementation, Platform, Request, Support, kernel_registry

__all__ = [
    "Backend",
    "Implementation",
    "Platform",
    "Problem",
    "Request",
    "Support",
    "kernel_registry",
    "recurrent",
]
__version__ = "0.1.0"
