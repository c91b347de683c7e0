"""The named chips one can compile for: NVIDIA GPUs as `GpuTargetConfig` text protos, TPUs as
topology names of libtpu.

The GPU figures are the chips' public data sheets (SM count, memory, bandwidth, L2, shared
memory per block); what the compiler uses from them is the compute capability (the ptxas
target, e.g. `sm_90a`) and the shared-memory limit per block.
"""

from __future__ import annotations

import dataclasses
import re

from .._core.registry import Chip

GiB = 1 << 30


@dataclasses.dataclass(frozen=True)
class GpuSpec:
    """What the `GpuTargetConfig` of one NVIDIA GPU says (bytes, bytes/s, GHz)."""

    device_kind: str
    compute_capability: tuple[int, int]
    sm_count: int
    memory_bytes: int
    bandwidth_bytes_per_s: float
    l2_bytes: int
    clock_ghz: float
    smem_per_block_optin: int = 232448  # 227 KiB: Hopper and Blackwell data-centre parts
    smem_per_sm: int = 233472  # 228 KiB

    def target_config(self) -> str:
        """The `GpuTargetConfig` text proto `topologies.get_topology_desc(platform="cuda")` takes."""
        major, minor = self.compute_capability
        return f"""
gpu_device_info {{
  threads_per_block_limit: 1024 threads_per_warp: 32 threads_per_core_limit: 2048
  shared_memory_per_block: 49152 shared_memory_per_block_optin: {self.smem_per_block_optin}
  shared_memory_per_core: {self.smem_per_sm}
  core_count: {self.sm_count} fpus_per_core: 128
  block_dim_limit_x: 2147483647 block_dim_limit_y: 65535 block_dim_limit_z: 65535
  memory_bandwidth: {int(self.bandwidth_bytes_per_s)} l2_cache_size: {self.l2_bytes}
  clock_rate_ghz: {self.clock_ghz} device_memory_size: {self.memory_bytes}
  cuda_compute_capability {{ major: {major} minor: {minor} }}
  registers_per_core_limit: 65536 registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 8 }}
runtime_version {{ major: 12 minor: 9 }}
device_description_str: "{self.device_kind}"
"""


@dataclasses.dataclass(frozen=True)
class TpuSpec:
    """One TPU generation: libtpu's topology prefix, its `device_kind`, and memory per chip.

    `scoped_vmem_bytes` is the compiler's default scoped-VMEM limit for a Pallas kernel (what a
    kernel's buffers must fit unless it raises `vmem_limit_bytes`)."""

    topology: str
    device_kind: str
    generation: str
    hbm_bytes: int
    vmem_bytes: int
    scoped_vmem_bytes: int


@dataclasses.dataclass(frozen=True)
class Target:
    """A chip to compile for. `chip` is how dispatch judges it; `spec` how the compiler sees it;
    `topology` the chips of a TPU slice (`"1x1"`; GPUs: one device)."""

    name: str
    spec: GpuSpec | TpuSpec
    topology: str = "1x1"

    @property
    def backend(self) -> str:
        return "gpu" if isinstance(self.spec, GpuSpec) else "tpu"

    @property
    def chip(self) -> Chip:
        if isinstance(self.spec, GpuSpec):
            return Chip("gpu", self.spec.device_kind, compute_capability=self.spec.compute_capability)
        return Chip("tpu", self.spec.device_kind, generation=self.spec.generation)

    @property
    def arch(self) -> str:
        """`sm_90a`-style ptxas target of a GPU; the generation of a TPU."""
        if isinstance(self.spec, GpuSpec):
            major, minor = self.spec.compute_capability
            return f"sm_{major}{minor}a"
        return self.spec.generation


TARGETS: dict[str, Target] = {
    "h100": Target("h100", GpuSpec("NVIDIA H100 80GB HBM3", (9, 0), 132, 80 * GiB, 3.35e12, 50 << 20, 1.98)),
    "h200": Target("h200", GpuSpec("NVIDIA H200", (9, 0), 132, 141 * 10**9, 4.8e12, 50 << 20, 1.98)),
    "b200": Target("b200", GpuSpec("NVIDIA B200", (10, 0), 148, 180 * 10**9, 7.7e12, 126 << 20, 1.965)),
    "v5e": Target("v5e", TpuSpec("v5e", "TPU v5 lite", "v5e", 16 * GiB, 128 << 20, 16 << 20)),
    "v6e": Target("v6e", TpuSpec("v6e", "TPU v6 lite", "v6e", 32 * GiB, 128 << 20, 32 << 20)),
}
"""The named targets: `h100`, `h200` (sm_90a), `b200` (sm_100a), `v5e`, `v6e`."""


SLICE = re.compile(r"[1-9][0-9]*(x[1-9][0-9]*){1,2}")
"""A TPU slice: chips along two or three axes, `"2x2"`, `"2x2x1"`."""


def get_target(target: str | Target) -> Target:
    """A `Target` from its name, with an optional TPU slice: `"v5e"`, `"v5e:2x2"`."""
    if isinstance(target, Target):
        return target
    if not isinstance(target, str):
        raise TypeError(f"target must be a name of {sorted(TARGETS)} (a TPU may add a slice, e.g. 'v5e:2x2') "
                        f"or a Target, got {target!r}")
    name, _, topology = target.partition(":")
    if name not in TARGETS:
        raise ValueError(f"unknown target {target!r}: one of {sorted(TARGETS)} (a TPU may add a slice, e.g. v5e:2x2)")
    chosen = TARGETS[name]
    if topology:
        if chosen.backend != "tpu":
            raise ValueError(f"{name} is one GPU; a slice ({topology!r}) is for TPU targets")
        if not SLICE.fullmatch(topology):
            raise ValueError(f"the slice of target {target!r} must be chips per axis, e.g. '2x2' or '2x2x1'; "
                             f"got topology {topology!r}")
        chosen = dataclasses.replace(chosen, topology=topology)
    return chosen
