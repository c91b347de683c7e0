"""Training throughput: tokens/s and the model FLOPs utilisation (MFU) of a chip.

    MFU = 6 · N · tokens/s / peak        N: the model's parameters (embedding included)

6N is the forward's 2N and the backward's 4N FLOPs per token of the matmuls against the
parameters; it leaves out the mixers' own FLOPs (the recurrence, attention scores) and a
remat's recomputation, as the published MFU figures do. The peak is the chip's dense bfloat16
matmul rate from `PEAK_FLOPS` (by `device.device_kind`); for a CPU or a chip not in the table
the MFU is unknown (None) and only tokens/s is reported.
"""

from __future__ import annotations

import dataclasses

import jax
from flax import nnx

PEAK_FLOPS = {
    "TPU v5 lite": 197e12,  # TPU v5e (Google Cloud's TPU v5e page: 197 TFLOP/s bf16)
    "TPU v6 lite": 918e12,  # TPU v6e / Trillium (Google Cloud's TPU v6e page: 918 TFLOP/s bf16)
    "NVIDIA H100 80GB HBM3": 989e12,  # H100 SXM, dense bf16 (NVIDIA's datasheet, 1,979 with sparsity)
    "NVIDIA H200": 989e12,  # H200 SXM, dense bf16
}
"""Dense bfloat16 matmul peak, FLOP/s, per chip by its JAX `device_kind`."""


def peak_flops(device: jax.Device | None = None) -> float | None:
    """The dense bfloat16 peak of `device` (default: the first device) from `PEAK_FLOPS`, or
    None for a CPU or a chip not in the table."""
    device = jax.devices()[0] if device is None else device
    return PEAK_FLOPS.get(getattr(device, "device_kind", None))


def parameter_count(model: nnx.Module) -> int:
    """The numbers in `model`'s parameters (`nnx.Param`), embedding and head included."""
    return sum(leaf.size for leaf in jax.tree.leaves(nnx.state(model, nnx.Param)))


@dataclasses.dataclass(frozen=True)
class Throughput:
    """Tokens/s of a training run, and its MFU where the chip's peak is known.

    **Fields:** `tokens_per_second`; `parameters` (N); `device_kind`; `peak_flops` (None:
    unknown); `mfu` (`6 · N · tokens_per_second / peak_flops`, None without a peak)."""

    tokens_per_second: float
    parameters: int
    device_kind: str
    peak_flops: float | None

    @property
    def mfu(self) -> float | None:
        return None if self.peak_flops is None else 6 * self.parameters * self.tokens_per_second / self.peak_flops

    def __str__(self) -> str:
        rate = f"{self.tokens_per_second:,.0f} tokens/s"
        if self.mfu is None:
            return f"{rate} (MFU: no peak FLOP/s known for {self.device_kind})"
        return (f"{rate}, MFU {self.mfu:.1%} (6 · {self.parameters / 1e6:,.1f}M parameters · tokens/s over "
                f"{self.device_kind}'s {self.peak_flops / 1e12:,.0f} TFLOP/s bf16)")


def training_throughput(tokens: int, seconds: float, parameters: int, device: jax.Device | None = None) -> Throughput:
    """The throughput of `tokens` trained in `seconds` by a model of `parameters` numbers on
    `device` (default: the first device)."""
    if seconds <= 0 or tokens < 0:
        raise ValueError(f"need tokens ≥ 0 and seconds > 0, got {tokens} tokens in {seconds} s")
    device = jax.devices()[0] if device is None else device
    return Throughput(tokens / seconds, parameters, str(getattr(device, "device_kind", device.platform)),
                      peak_flops(device))


def training_dtype(device: jax.Device | None = None):
    """The computation dtype a training step runs fastest in on `device` (default: the first
    device), parameters staying float32: bfloat16 on a TPU or GPU (their matmul units' type),
    float32 on a CPU (which has no faster bfloat16 matmul)."""
    device = jax.devices()[0] if device is None else device
    return jax.numpy.bfloat16 if device.platform in ("tpu", "gpu", "cuda", "rocm") else jax.numpy.float32
