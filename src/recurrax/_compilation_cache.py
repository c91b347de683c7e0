"""JAX's persistent compilation cache for recurrax's commands and examples: a second start of
`recurrax demo`, `generate` or `serve` (or of an example) reads its compiled programs from disk.

    directory = $RECURRAX_COMPILATION_CACHE, else $XDG_CACHE_HOME/recurrax/jax, else ~/.cache/recurrax/jax
    RECURRAX_COMPILATION_CACHE=off (or 0, false, no, none): no cache

Every program is cached (`jax_persistent_cache_min_compile_time_secs = 0`, JAX's default being
1 s): a generation start compiles dozens of programs (a prefill per bucket, the decode step, the
sampler) that each take well under a second on a CPU and together most of the start. An entry
is the serialized executable, a few kB to a few MB; JAX never evicts them (delete the directory
to reclaim the space). A cache directory set already (`JAX_COMPILATION_CACHE_DIR` or
`jax.config`) is left as it is.
"""

from __future__ import annotations

import os
from pathlib import Path

ENVIRONMENT_VARIABLE = "RECURRAX_COMPILATION_CACHE"
"""The environment variable that moves the cache (a directory) or turns it off (`off`, `0`, …)."""
OFF = frozenset({"", "0", "off", "false", "no", "none"})
"""Values of `RECURRAX_COMPILATION_CACHE` that turn the cache off (any case)."""


def default_cache_directory() -> Path:
    """`$XDG_CACHE_HOME/recurrax/jax`, `~/.cache/recurrax/jax` without it (XDG base directories)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "recurrax" / "jax"


def use_compilation_cache(directory: str | os.PathLike | None = None) -> str | None:
    """Turn on JAX's persistent compilation cache for this process; call it before the first
    compilation. Returns the directory in use, or None where `RECURRAX_COMPILATION_CACHE` turns
    it off.

    **Arguments:**
    - `directory`: where to keep the compiled programs (default: `RECURRAX_COMPILATION_CACHE`,
      else `$XDG_CACHE_HOME/recurrax/jax`, else `~/.cache/recurrax/jax`). A directory JAX was
      given already (`JAX_COMPILATION_CACHE_DIR`) wins over the default, not over `directory`.
    """
    import jax

    setting = os.environ.get(ENVIRONMENT_VARIABLE)
    if directory is None and setting is not None and setting.strip().lower() in OFF:
        return None
    if directory is None:
        directory = setting or jax.config.jax_compilation_cache_dir or default_cache_directory()
    directory = str(Path(directory).expanduser())
    os.makedirs(directory, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return directory
