"""Compile for a chip this machine does not have: named targets, deviceless compilation, and
ptxas's resource report per Mosaic GPU kernel.

| module      | what it holds                                                              |
|-------------|----------------------------------------------------------------------------|
| `_chips`    | `Target`, `GpuSpec` (a `GpuTargetConfig` text proto), `TpuSpec`, `TARGETS` |
| `_compile`  | `target` (dispatch context), `compile_for`, `CompiledProgram`, the environment |
| `_ptxas`    | `KernelResources`, `parse_ptxas`, fd-level capture (`captured_fd`), Mosaic launch sizes |

**Targets** (`TARGETS`): `h100`, `h200` (compute capability 9.0, ptxas `sm_90a`), `b200`
(10.0, `sm_100a`), `v5e`, `v6e` (a TPU may add a slice: `"v5e:2x2"`).

**Toolchains** (extras): `pip install 'recurrax[compile-cuda]'` (the CUDA plugin and ptxas;
about 1.2 GB, no GPU needed) and `pip install 'recurrax[compile-tpu]'` (libtpu), in separate
environments of Python ≥ 3.12 (they need JAX ≥ 0.12). Before JAX starts: `prepare_environment()` (or set `ENVIRONMENT` yourself).
`toolchain_missing(name)` says why a target cannot be compiled for here, or None.

**API:**
- `with recurrax.target("h100"): ...` — dispatch judges support for that chip
  (`kernel_registry.select`, `recurrax.recurrent(..., implementation="mosaic_gpu")` under
  `jit`), not for this host; `recurrax.target(None)` judges the host. It compiles for the
  chip, it does not run on it: a kernel picked for it and run here raises a `ValueError`.
- `topology("v5e:2x2")`, `mesh_for("h100")` — the target's deviceless topology and a mesh over
  it; without the toolchain a `RuntimeError` names the extra to install.
- `compile_for("h100", fn, *args) -> CompiledProgram` — `jax.jit(fn)` traced, lowered and
  compiled for the target inside its deviceless mesh; `.seconds`, `.executable`
  (`memory_analysis()`), `.kernels`, `.serialize()`.
- `CompiledProgram.kernels`: a `KernelResources` per Mosaic GPU kernel — `name`, `arch`,
  `registers`, `spill_stores`, `spill_loads` (bytes per thread), `stack_bytes`,
  `smem_bytes` (dynamic + static per block), `threads`; `.spills`.

    prepare_environment()
    program = compile_for("h100", jax.grad(loss), q, k, v)   # ShapeDtypeStructs suffice
    for kernel in program.kernels:
        print(kernel.name, kernel.registers, kernel.spill_stores, kernel.smem_bytes)

One GPU architecture per process (the CUDA plugin's kernel cache ignores the target):
`compile_for` refuses a second one. Compiling checks the toolchain (passes, PTX, ptxas, register allocation, SMEM and VMEM
limits), not numbers or speed.
"""

from ._chips import TARGETS, GpuSpec, Target, TpuSpec, get_target
from ._compile import (
    ENVIRONMENT,
    TPU_TRAINING_OPTIONS,
    CompiledProgram,
    compile_for,
    mesh_for,
    prepare_environment,
    target,
    toolchain_missing,
    topology,
)
from ._ptxas import KernelResources, captured_fd, captured_fd1, parse_ptxas

__all__ = [
    "ENVIRONMENT",
    "TARGETS",
    "TPU_TRAINING_OPTIONS",
    "CompiledProgram",
    "GpuSpec",
    "KernelResources",
    "Target",
    "TpuSpec",
    "captured_fd",
    "captured_fd1",
    "compile_for",
    "get_target",
    "mesh_for",
    "parse_ptxas",
    "prepare_environment",
    "target",
    "toolchain_missing",
    "topology",
]
