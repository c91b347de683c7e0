"""recurrax: linear-time recurrent (gated linear) attention for JAX."""

from . import reference as _reference  # noqa: F401  (registers "reference")
from . import scan as _scan  # noqa: F401  (registers "scan")
from . import chunk as _chunk  # noqa: F401  (registers "chunk")
from . import pallas as _pallas  # noqa: F401  (registers "pallas_gpu", "pallas_interpret")
from . import parallel
from .decode import recurrent_step
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
    "parallel",
    "recurrent",
    "recurrent_step",
]
__version__ = "0.1.0"
