"""ptxas's report on every Mosaic GPU kernel of a compiled program.

With `MOSAIC_GPU_DUMP_PTXAS=1`, the CUDA plugin prints ptxas's `-v` report for each kernel it
builds to the process's standard output, at the file-descriptor level (C++, not Python's
`sys.stdout`):

    ptxas info    : Compiling entry function 'NAME_mosaic_gpu_kernel' for 'sm_90a'
    ptxas info    : Function properties for NAME_mosaic_gpu_kernel
        0 bytes stack frame, 300 bytes spill stores, 296 bytes spill loads
    ptxas info    : Used 255 registers, used 2 barriers, 1 bytes smem

`captured_fd1` redirects descriptor 1 to a file while it runs (`captured_fd` any descriptor); `parse_ptxas` reads the report.
Mosaic GPU kernels take their shared memory dynamically (ptxas sees only a byte or so), so the
shared memory of a kernel comes from its launch in the lowered program (`mosaic_launches`).
A kernel compiled once is cached by the plugin and not reported again in the same process:
reports are kept here by kernel hash.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import os
import re
import sys
import tempfile
from collections.abc import Iterator


@dataclasses.dataclass(frozen=True)
class KernelResources:
    """What one GPU kernel needs per thread block, as ptxas and the launch say.

    **Arguments:**
    - `name`: the kernel (the Pallas call's name).
    - `arch`: the ptxas target (`sm_90a`).
    - `registers`: registers per thread (255 is the ceiling).
    - `spill_stores`, `spill_loads`: bytes spilled to local memory per thread.
    - `stack_bytes`: the stack frame per thread.
    - `smem_bytes`: shared memory per block (dynamic + static); `None` when unknown.
    - `threads`: threads per block; `None` when unknown.
    """

    name: str
    arch: str
    registers: int
    spill_stores: int
    spill_loads: int
    stack_bytes: int
    smem_bytes: int | None = None
    threads: int | None = None

    @property
    def spills(self) -> bool:
        return self.spill_stores > 0 or self.spill_loads > 0


_ENTRY = re.compile(r"Compiling entry function '([^']+)' for '([^']+)'")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers(?:.*?(\d+) bytes smem)?")


def parse_ptxas(text: str) -> list[KernelResources]:
    """The kernels of a ptxas `-v` report, in the order ptxas built them (smem: ptxas's static
    figure only)."""
    kernels, entry, frame = [], None, (0, 0, 0)
    for line in text.splitlines():
        if match := _ENTRY.search(line):
            entry, frame = (match.group(1), match.group(2)), (0, 0, 0)
        elif (match := _FRAME.search(line)) and entry is not None:
            frame = tuple(int(x) for x in match.groups())
        elif (match := _USED.search(line)) and entry is not None:
            registers, smem = int(match.group(1)), int(match.group(2) or 0)
            kernels.append(KernelResources(entry[0], entry[1], registers, frame[1], frame[2], frame[0], smem))
            entry = None
    return kernels


@contextlib.contextmanager
def captured_fd(descriptor: int) -> Iterator[list[str]]:
    """Redirect file descriptor `descriptor` (1: standard output, 2: standard error; C and C++
    writes included) to a temporary file while the block runs; the yielded list receives the
    captured text afterwards. Process-wide: other threads' output to it is captured too."""
    libc = ctypes.CDLL(None)
    captured: list[str] = []
    stream = sys.stdout if descriptor == 1 else sys.stderr
    stream.flush()
    libc.fflush(None)
    saved = os.dup(descriptor)
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), descriptor)
        try:
            yield captured
        finally:
            stream.flush()
            libc.fflush(None)
            os.dup2(saved, descriptor)
            os.close(saved)
            sink.seek(0)
            captured.append(sink.read().decode(errors="replace"))


def captured_fd1() -> contextlib.AbstractContextManager[list[str]]:
    """`captured_fd(1)`: where the CUDA plugin prints ptxas's report."""
    return captured_fd(1)


@dataclasses.dataclass(frozen=True)
class MosaicLaunch:
    """One Mosaic GPU custom call of a lowered program: its kernel, hash and launch sizes."""

    name: str
    kernel_hash: bytes
    smem_bytes: int | None
    threads: int | None


_LAUNCH = re.compile(r'gpu\.launch"\(([^)]*)\)')


def mosaic_launches(lowered) -> list[MosaicLaunch]:
    """Every Mosaic GPU kernel launched by a `jax.stages.Lowered` program, in program order."""
    from jax._src.interpreters import mlir
    from jax._src.lib.mlir import ir

    launches: list[MosaicLaunch] = []
    module = lowered.compiler_ir("stablehlo")
    context = mlir.make_ir_context()
    context.allow_unregistered_dialects = True

    def visit(operation) -> None:
        for region in operation.regions:
            for block in region.blocks:
                for op in block.operations:
                    if op.name == "stablehlo.custom_call" and "mhlo.backend_config" in op.attributes:
                        config = ir.DictAttr(op.attributes["mhlo.backend_config"])
                        if "module" in config and "kernel_hash" in config:
                            launches.append(_launch(config, context, ir))
                    visit(op)

    visit(module.operation)
    return launches


def _launch(config, context, ir) -> MosaicLaunch:
    kernel_hash = bytes(ir.StringAttr(config["kernel_hash"]).value_bytes)
    blob = bytes(ir.StringAttr(config["module"]).value_bytes)
    try:
        with context:
            text = str(ir.Module.parse(blob))
    except Exception:  # an unreadable module: the kernel's sizes stay unknown  # noqa: BLE001
        return MosaicLaunch("?", kernel_hash, None, None)
    name = re.search(r"module @([\w.$-]+)", text)
    return MosaicLaunch(name.group(1) if name else "?", kernel_hash, *_launch_sizes(text))


def _launch_sizes(text: str) -> tuple[int | None, int | None]:
    """(dynamic shared memory bytes, threads per block) of the module's `gpu.launch`: its
    operands are (token, grid x y z, block x y z, shared memory bytes)."""
    launch = _LAUNCH.search(text)
    if launch is None:
        return None, None
    operands = [name.strip() for name in launch.group(1).split(",")]
    if len(operands) < 8:
        return None, None

    def constant(name: str) -> int | None:
        found = re.search(re.escape(name) + r' = "[\w.]*arith\.constant"\(\) \{value = (\d+) : \w+\}', text)
        return int(found.group(1)) if found else None

    block = [constant(name) for name in operands[4:7]]
    threads = None if None in block else block[0] * block[1] * block[2]
    return constant(operands[-1]), threads
