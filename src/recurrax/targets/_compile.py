"""Compile a function for a named target chip on a machine without it (deviceless AOT).

`compile_for` builds the target's deviceless topology (the CUDA plugin for a GPU, libtpu for a
TPU), traces and lowers the function with dispatch judging that chip (`judging_for`) inside
the topology's abstract mesh, and compiles it: for a GPU the Mosaic GPU passes, PTX and ptxas
for the target's `sm_XXa`; for a TPU Mosaic TPU's passes and its VMEM check. Errors of any of
those raise here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import os
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np

from .._core.registry import judging_for
from ._chips import Target, get_target
from ._ptxas import KernelResources, captured_fd1, mosaic_launches, parse_ptxas

ENVIRONMENT = {"JAX_PLATFORMS": "cpu", "JAX_SKIP_CUDA_CONSTRAINTS_CHECK": "1", "TPU_SKIP_MDS_QUERY": "1",
               "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}
"""What the process needs before JAX starts its backends, on a machine without the chip: only
the CPU backend at run time; the CUDA plugin loads without a GPU (it would stop at "cuInit(0)
failed" checking versions); libtpu does not look for a TPU's metadata server, and several
processes may load it at once (compiling uses no TPU)."""

TPU_TRAINING_OPTIONS = {"xla_tpu_enable_windowed_einsum_for_all_gather": False,
                        "xla_tpu_enable_windowed_einsum_for_reduce_scatter": False}
"""libtpu options (`jax.jit(..., compiler_options=...)` on a TPU, or `.compile(compiler_options=...)`)
for a training step with FSDP and `remat`: no windowed einsums. libtpu turns an all-gathered
weight's matmul and a reduce-scattered gradient's matmul into loops over the shards whose
output buffers (`AllocateBuffer`) it schedules at the start of the backward, every layer's at
once: under `remat="block"` each layer then held about 8 block inputs' worth of bytes
through the whole backward (GLA 1.3B at 128k tokens on a v5e-8: 1 GiB per layer per chip,
`benchmarks/long_context.py`). Without them the gathers are plain all-gathers, issued
layer by layer."""


def prepare_environment() -> None:
    """Set `ENVIRONMENT`'s variables where unset; call before JAX initialises its backends."""
    for name, value in ENVIRONMENT.items():
        os.environ.setdefault(name, value)


@contextlib.contextmanager
def target(name: str | Target | None) -> Iterator[Target | None]:
    """`with recurrax.target("h100"):` dispatch judges support for that chip rather than this
    host's device (`kernel_registry.select`, `recurrax.recurrent` traced under `jit`). Yields the
    `Target`; `None` judges this host (or the abstract mesh's device) and yields None.

    Running the call still needs the chip: a kernel picked for it and run here raises a
    `ValueError` saying so; `compile_for` compiles it without one."""
    if name is None:
        with judging_for(None):
            yield None
        return
    chosen = get_target(name)
    with judging_for(chosen.chip):
        try:
            yield chosen
        except ValueError as error:
            if not str(error).startswith(PALLAS_ON_CPU):
                raise
            raise ValueError(_run_on_host_message(chosen)) from error


PALLAS_ON_CPU = "Only interpret mode is supported on CPU backend"
"""How Pallas refuses to lower a kernel for the CPU (JAX's `pallas_call` lowering)."""


def _run_on_host_message(chosen: Target) -> str:
    return (f"recurrax.target({chosen.name!r}) picks kernels for the {chosen.spec.device_kind} ({chosen.arch}) and "
            f"compiles for that chip; it does not run on it, and this host is {jax.default_backend()}. Compile with "
            f"recurrax.targets.compile_for({chosen.name!r}, fn, *args), or call outside recurrax.target to run here.")


def toolchain_missing(name: str | Target) -> str | None:
    """Why this installation cannot compile for `name` (the extra to install), or None."""
    chosen = get_target(name)
    missing = _extra_missing(chosen)
    if missing is not None:
        return missing
    try:
        topology(chosen)
    except Exception as error:  # noqa: BLE001  (the plugin's own message says what is wrong)
        return f"no deviceless {chosen.backend} topology here ({type(error).__name__}: {error}); environment {ENVIRONMENT}"
    return None


TOOLCHAIN_PYTHON = (3, 12)
"""The toolchain extras need JAX ≥ 0.12, which needs Python ≥ 3.12 (pip refuses them on 3.11)."""


def _extra_missing(chosen: Target) -> str | None:
    """The extra to install when the target's toolchain (CUDA plugin, libtpu) is absent, or None."""
    if chosen.backend == "gpu":
        if not any(importlib.util.find_spec(f"jax_cuda{version}_plugin") for version in (12, 13)):
            return f"the CUDA toolchain is not installed: {_install('compile-cuda')}"
    elif importlib.util.find_spec("libtpu") is None:
        return f"libtpu is not installed: {_install('compile-tpu')}"
    return None


def _install(extra: str) -> str:
    """How to install a toolchain extra, and the Python it needs."""
    needed = ".".join(map(str, TOOLCHAIN_PYTHON))
    advice = f"pip install 'recurrax[{extra}]' under Python ≥ {needed} (the extra needs JAX ≥ 0.12)"
    if sys.version_info[:2] < TOOLCHAIN_PYTHON:
        advice += f"; this is Python {sys.version_info[0]}.{sys.version_info[1]}, where it does not install"
    return advice


def topology(name: str | Target):
    """The deviceless topology (cached) of a target: a name of `TARGETS` (`"h100"`, `"v5e:2x2"`)
    or a `Target`. Raises `RuntimeError` naming the extra to install when its toolchain is absent."""
    chosen = get_target(name)
    missing = _extra_missing(chosen)
    if missing is not None:
        raise RuntimeError(f"cannot compile for {chosen.name}: {missing}")
    return _topology(chosen.name, chosen.topology)


@functools.cache
def _topology(name: str, slice_shape: str):
    from jax.experimental import topologies

    spec = get_target(name).spec
    if get_target(name).backend == "gpu":
        return topologies.get_topology_desc(platform="cuda", target_config=spec.target_config(), topology="1x1x1")
    return topologies.get_topology_desc(topology_name=f"{spec.topology}:{slice_shape}", platform="tpu")


def mesh_for(name: str | Target, axis_name: str = "x") -> jax.sharding.Mesh:
    """A one-axis mesh over every device of the target's topology."""
    devices = np.array(topology(name).devices).reshape(-1)
    return jax.sharding.Mesh(devices, (axis_name,))


@dataclasses.dataclass(frozen=True)
class CompiledProgram:
    """One program compiled for a target.

    **Arguments:**
    - `target`: the `Target`.
    - `executable`: the `jax.stages.Compiled` (`memory_analysis()`, `as_text()`).
    - `seconds`: trace + lower + compile time.
    - `kernels`: ptxas's report per Mosaic GPU kernel launched, in program order (empty on
      TPU and for kernels of other kinds); a kernel this process compiled before without a
      report is left out and named in `unreported`.
    """

    target: Target
    executable: Any
    seconds: float
    kernels: tuple[KernelResources, ...]
    unreported: tuple[str, ...] = ()

    def memory(self):
        """XLA's per-device memory analysis (argument, output, temporary bytes)."""
        return self.executable.memory_analysis()

    def serialize(self):
        """`(payload, in_tree, out_tree)` of `jax.experimental.serialize_executable.serialize`,
        for loading on the target machine."""
        from jax.experimental import serialize_executable

        return serialize_executable.serialize(self.executable)


_GPU_ARCH: list[str] = []
"""The GPU architecture this process compiles for: the CUDA plugin caches Mosaic GPU kernels
by a hash that does not include the target, so after `h100` a `b200` compile of the same kernel
would silently reuse the sm_90a build (measured: the wgmma kernels then "compile" for b200)."""

_REPORTS: dict[bytes, KernelResources] = {}
"""ptxas reports by Mosaic kernel hash (the plugin compiles a kernel once per process)."""


def compile_for(name: str | Target, fn: Callable, *args) -> CompiledProgram:
    """Compile `jax.jit(fn)(*args)` for the target chip `name` (`"h100"`, `"v5e"`, ...).

    **Arguments:**
    - `name`: a target name of `TARGETS` (a TPU may add a slice, `"v5e:2x2"`) or a `Target`.
    - `fn`: the function; `recurrax` calls in it dispatch for the target.
    - `args`: pytrees of arrays or `jax.ShapeDtypeStruct`s; leaves without a sharding on the
      target's mesh are replicated over it (`mesh_for`).

    Raises the toolchain's error (ptxas, Mosaic, VMEM) when the program does not compile, and
    `RuntimeError` for a second GPU architecture in one process (h100 and h200 share sm_90a)
    or a missing toolchain (naming the extra to install)."""
    chosen = get_target(name)
    mesh = mesh_for(chosen)
    if chosen.backend == "gpu":
        if _GPU_ARCH and _GPU_ARCH[0] != chosen.arch:
            raise RuntimeError(f"this process compiled for {_GPU_ARCH[0]}; compile for {chosen.arch} in another process "
                               "(the CUDA plugin's kernel cache does not tell GPU architectures apart)")
        _GPU_ARCH[:] = [chosen.arch]
    specs = jax.tree.map(functools.partial(_spec_on, mesh), args)
    report = chosen.backend == "gpu"
    with _dumping_ptxas(report), captured_fd1() if report else contextlib.nullcontext([""]) as output:
        start = time.perf_counter()
        with judging_for(chosen.chip), jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            lowered = jax.jit(fn).trace(*specs).lower()
        executable = lowered.compile()
        seconds = time.perf_counter() - start
    if not report:
        return CompiledProgram(chosen, executable, seconds, ())
    kernels, unreported = _kernel_reports(lowered, "".join(output))
    return CompiledProgram(chosen, executable, seconds, kernels, unreported)


def _spec_on(mesh: jax.sharding.Mesh, leaf) -> jax.ShapeDtypeStruct:
    sharding = getattr(leaf, "sharding", None)
    if not (isinstance(sharding, jax.sharding.NamedSharding) and sharding.mesh == mesh):
        sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)


@contextlib.contextmanager
def _dumping_ptxas(enabled: bool) -> Iterator[None]:
    previous = os.environ.get("MOSAIC_GPU_DUMP_PTXAS")
    if enabled:
        os.environ["MOSAIC_GPU_DUMP_PTXAS"] = "1"
    try:
        yield
    finally:
        if enabled and previous is None:
            del os.environ["MOSAIC_GPU_DUMP_PTXAS"]
        elif enabled:
            os.environ["MOSAIC_GPU_DUMP_PTXAS"] = previous


def _kernel_reports(lowered, ptxas_output: str) -> tuple[tuple[KernelResources, ...], tuple[str, ...]]:
    """Pair ptxas's reports (by kernel name, in order) with the program's Mosaic launches."""
    launches = mosaic_launches(lowered)
    pending = list(launches)
    for found in parse_ptxas(ptxas_output):
        match = next((launch for launch in pending if launch.kernel_hash not in _REPORTS
                      and found.name in (f"{launch.name}_mosaic_gpu_kernel", launch.name)), None)
        if match is None:
            continue
        pending.remove(match)
        smem = None if match.smem_bytes is None else match.smem_bytes + (found.smem_bytes or 0)
        _REPORTS[match.kernel_hash] = dataclasses.replace(found, name=match.name, smem_bytes=smem,
                                                          threads=match.threads)
    kernels = tuple(_REPORTS[launch.kernel_hash] for launch in launches if launch.kernel_hash in _REPORTS)
    unreported = tuple(launch.name for launch in launches if launch.kernel_hash not in _REPORTS)
    return kernels, unreported
