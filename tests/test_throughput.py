"""Training throughput (recurrax.nn._throughput): parameters counted, MFU from the chip's peak,
the fast dtype per platform."""

from __future__ import annotations

import types

import pytest

pytest.importorskip("flax", reason="recurrax.nn needs flax")

import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from recurrax.nn import (  # noqa: E402
    PEAK_FLOPS,
    Throughput,
    parameter_count,
    peak_flops,
    training_dtype,
    training_throughput,
)


class TwoParts(nnx.Module):
    def __init__(self):
        self.linear = nnx.Linear(3, 4, rngs=nnx.Rngs(0))  # 3·4 weights + 4 biases
        self.embed = nnx.Embed(5, 6, rngs=nnx.Rngs(0))  # 5·6
        self.count = nnx.Variable(jnp.zeros(7))  # not a parameter


def device(kind: str, platform: str):
    return types.SimpleNamespace(device_kind=kind, platform=platform)


def test_parameter_count_counts_params_only():
    assert parameter_count(TwoParts()) == 3 * 4 + 4 + 5 * 6


def test_mfu_is_six_n_tokens_over_the_peak():
    v5e = device("TPU v5 lite", "tpu")
    assert peak_flops(v5e) == 197e12 == PEAK_FLOPS["TPU v5 lite"]
    rate = training_throughput(16384, 0.5, 340_000_000, v5e)
    assert rate.tokens_per_second == 32768
    assert rate.mfu == pytest.approx(6 * 340e6 * 32768 / 197e12, rel=1e-12)
    assert str(rate) == ("32,768 tokens/s, MFU 33.9% (6 · 340.0M parameters · tokens/s over TPU v5 lite's "
                         "197 TFLOP/s bf16)")


def test_unknown_peak_reports_tokens_per_second_only():
    rate = training_throughput(1000, 2.0, 10, device("cpu", "cpu"))
    assert rate == Throughput(500.0, 10, "cpu", None) and rate.mfu is None
    assert str(rate) == "500 tokens/s (MFU: no peak FLOP/s known for cpu)"
    with pytest.raises(ValueError, match="seconds > 0"):
        training_throughput(10, 0.0, 10)


def test_training_dtype_is_bfloat16_on_accelerators():
    assert training_dtype(device("TPU v5 lite", "tpu")) == jnp.bfloat16
    assert training_dtype(device("NVIDIA H100 80GB HBM3", "gpu")) == jnp.bfloat16
    assert training_dtype(device("cpu", "cpu")) == jnp.float32
