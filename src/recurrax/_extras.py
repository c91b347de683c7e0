"""Optional dependencies: a missing one raises an ImportError naming the extra that brings it."""

from __future__ import annotations

import importlib
from types import ModuleType


def require(module: str, extra: str, needed_by: str) -> ModuleType:
    """Import `module`, or raise ImportError saying which extra of recurrax installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise ImportError(
            f"{needed_by} needs the '{module.split('.')[0]}' package, from recurrax's '{extra}' extra: "
            f"pip install 'recurrax[{extra}]' (from a clone: pip install '.[{extra}]')"
        ) from error
