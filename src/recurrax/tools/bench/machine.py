"""What a benchmark was measured on: the machine, the software, and its float32 matmul peak."""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

import recurrax


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo, or `platform.processor()`."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"

def cpu_vector_extensions() -> list[str]:
    """The matmul-relevant instruction-set flags (FMA, AVX*, AMX) of the CPU."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = line.split(":", 1)[1].split()
                return [f for f in flags if f.startswith(("fma", "avx", "amx"))]
    except OSError:
        pass
    return []

def memory_gib() -> float | None:
    """Total RAM in GiB from /proc/meminfo."""
    try:
        first = Path("/proc/meminfo").read_text().splitlines()[0]
        return int(first.split()[1]) / 2**20
    except (OSError, IndexError, ValueError):
        return None

def git_commit() -> str | None:
    """The short commit hash of the source tree, with `+dirty` when it has changes."""
    here = Path(__file__).resolve().parent
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True, check=True
        ).stdout.strip()
        status = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=here, capture_output=True, text=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return commit + ("+dirty" if status else "")

def machine_description() -> dict[str, Any]:
    """What the numbers were measured on."""
    import jaxlib

    device = jax.devices()[0]
    return {
        "cpu": cpu_model(),
        "logical_cpus": os.cpu_count(),
        "usable_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "cpu_extensions": cpu_vector_extensions(),
        "memory_gib": memory_gib(),
        "os": platform.platform(),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "recurrax": recurrax.__version__,
        "commit": git_commit(),
        "backend": jax.default_backend(),
        "device": f"{device.platform}:{device.device_kind}",
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "load_average_start": list(os.getloadavg()),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }

def seconds_of(run: Callable[[], Any]) -> float:
    """Wall time of one call of `run`, waiting for its results."""
    start = time.perf_counter()
    jax.block_until_ready(run())
    return time.perf_counter() - start

def matmul_flops(size: int) -> int:
    """FLOPs of a square `size × size` matrix product: 2·n³."""
    return 2 * size**3

def matmul_peak(size: int, repeats: int) -> dict[str, float]:
    """This machine's float32 matmul throughput: median time of a jitted `jnp.dot`."""
    key_a, key_b = jax.random.split(jax.random.PRNGKey(0))
    a = jax.random.normal(key_a, (size, size), jnp.float32)
    b = jax.random.normal(key_b, (size, size), jnp.float32)
    dot = jax.jit(jnp.dot).lower(a, b).compile()
    seconds_of(lambda: dot(a, b))  # warm-up
    median = statistics.median(seconds_of(lambda: dot(a, b)) for _ in range(repeats))
    return {"size": size, "repeats": repeats, "median_s": median, "flops_per_s": matmul_flops(size) / median}
