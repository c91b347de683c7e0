"""The kernels compiled for the real chips on this CPU (marker `compile`; not in the default
suite): Mosaic GPU kernels through ptxas for H100 (sm_90a), the Triton kernels for B200
(sm_100a), the TPU kernels through libtpu for v5e and v6e. Any pass, ptxas or VMEM error fails.

Needs a toolchain (`pip install '.[test,compile-cuda]'` or `'.[test,compile-tpu]'`, separate
environments) and `JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1` (CUDA, before JAX starts). Where one is
missing the tests skip, saying why — unless `RECURRAX_REQUIRE_TOOLCHAIN=1` (CI), which makes
them fail instead. `-m compile` runs the representative sets; `-m slow` adds the products.
"""

import os

import jax
import numpy as np
import pytest

from recurrax import targets
from recurrax.tools.compile import FULL, REPRESENTATIVE, Configuration, compile_configuration, program, selection

pytestmark = pytest.mark.compile
REQUIRED = os.environ.get("RECURRAX_REQUIRE_TOOLCHAIN") == "1"


def need(target: str) -> targets.Target:
    missing = targets.toolchain_missing(target)
    if missing is not None:
        if REQUIRED:
            pytest.fail(f"RECURRAX_REQUIRE_TOOLCHAIN=1 but {target} cannot be compiled for here: {missing}")
        pytest.skip(missing)
    return targets.get_target(target)


# ----------------------------------------------------------------------------- H100: Mosaic GPU, ptxas


def check_h100(configuration: Configuration) -> None:
    target = need("h100")
    result = compile_configuration("h100", configuration, implementation="mosaic_gpu")
    kernels = {kernel.name.removeprefix("recurrax_mgpu_chunk_"): kernel for kernel in result.compiled.kernels}
    expected = {"fwd", "states", "bwd"} if configuration.gradient else {"fwd"}
    assert set(kernels) | {name.removeprefix("recurrax_mgpu_chunk_") for name in result.compiled.unreported} == expected
    for kernel in kernels.values():
        assert kernel.arch == "sm_90a" and 0 < kernel.registers <= 255
        assert kernel.threads == 128  # one warpgroup per program
        assert 0 < kernel.smem_bytes <= target.spec.smem_per_block_optin


@pytest.mark.parametrize("configuration", REPRESENTATIVE["gpu"], ids=lambda c: c.label)
def test_mosaic_gpu_compiles_for_h100(configuration):
    check_h100(configuration)


@pytest.mark.slow
@pytest.mark.parametrize("configuration", FULL["gpu"], ids=lambda c: c.label)
def test_mosaic_gpu_compiles_for_h100_every_configuration(configuration):
    check_h100(configuration)


B200_CASE = Configuration("channel", 64, 64, "bfloat16", packed=True)


def test_b200_dispatches_to_a_kernel_that_compiles_there():
    """On sm_100a dispatch picks the Triton kernels (or chunk where JAX lacks them), and that
    program compiles; the Mosaic GPU kernels are refused because ptxas has no wgmma there."""
    need("b200")
    chosen = selection("b200", B200_CASE)
    assert chosen.name in ("pallas_gpu", "chunk") and "wgmma" in dict(chosen.answers)["mosaic_gpu"]
    assert compile_configuration("b200", B200_CASE).implementation == chosen.name


def test_mosaic_gpu_kernels_do_not_build_for_b200():
    """Why mosaic_gpu declares 9.x only: forced past dispatch, ptxas refuses sm_100a."""
    need("b200")
    from recurrax.kernels.mosaic_gpu import mosaic_gpu_recurrent
    from recurrax.tools.cases import canonical

    fn, (diff, arrays) = program(B200_CASE, implementation="chunk")

    def direct(diff, arrays):
        problem, config, _ = canonical({**diff, **arrays})
        return mosaic_gpu_recurrent(problem, scale=config.scale, reverse=config.reverse)

    with pytest.raises(Exception, match="wgmma"):
        targets.compile_for("b200", direct, diff, arrays)


# ----------------------------------------------------------------------------- TPU v5e, v6e: Mosaic TPU, libtpu


def check_tpu(generation: str, configuration: Configuration) -> None:
    need(generation)
    result = compile_configuration(generation, configuration, implementation="pallas_tpu")
    assert result.compiled.executable.as_text().count("tpu_custom_call") == 3  # forward, states, backward
    _, args = program(configuration)
    inputs = sum(np.asarray(leaf).nbytes for leaf in jax.tree.leaves(args))
    assert result.compiled.memory().argument_size_in_bytes == inputs


@pytest.mark.parametrize("generation", ["v5e", "v6e"])
@pytest.mark.parametrize("configuration", REPRESENTATIVE["tpu"], ids=lambda c: c.label)
def test_tpu_kernels_compile(generation, configuration):
    check_tpu(generation, configuration)


@pytest.mark.slow
@pytest.mark.parametrize("generation", ["v5e", "v6e"])
@pytest.mark.parametrize("configuration", FULL["tpu"], ids=lambda c: c.label)
def test_tpu_kernels_compile_every_configuration(generation, configuration):
    check_tpu(generation, configuration)


# ----------------------------------------------------------------------------- TPU tiles: the VMEM check against libtpu


def largest_accepted_chunk(generation: str, K: int, V: int, dtype, gate) -> int:
    """The largest chunk (128 · 2^i) whose forward and backward the VMEM check accepts."""
    from recurrax.kernels.tpu._vmem import vmem_problem

    accepted = [C for C in (128, 256, 512, 1024, 2048, 4096)
                if not any(vmem_problem(C, K, min(V, 128), dtype, gate, b, generation) for b in (False, True))]
    return accepted[-1]


def check_largest_chunk(generation: str, K: int, V: int, dtype: str, gates: str) -> None:
    """What the VMEM check accepts, libtpu compiles (forward and backward kernels)."""
    import jax.numpy as jnp

    from recurrax.kernels.tpu import TpuTiles, tpu_recurrent
    from recurrax.problem import Gate
    from recurrax.tools.cases import Case, canonical, make_inputs, split_args
    from recurrax.tools.compile import GATE_SETS

    need(generation)
    gate = {"head": Gate.HEAD, "both": Gate.KEY}[gates]
    C = largest_accepted_chunk(generation, K, V, jnp.dtype(dtype), gate)
    diff, rest = split_args(make_inputs(Case(B=1, T=2 * C, H=1, Hkv=1, K=K, V=V, gates=GATE_SETS[gates], dtype=dtype)))

    def loss(diff):
        problem, config, _ = canonical({**rest, **diff})
        output, state = tpu_recurrent(problem, scale=config.scale, reverse=False, tiles=TpuTiles(chunk=C))
        return jnp.sum(output.astype(jnp.float32)) + jnp.sum(state)

    compiled = targets.compile_for(generation, jax.grad(loss), diff)
    assert compiled.executable.as_text().count("tpu_custom_call") == 3


@pytest.mark.parametrize("generation", ["v5e", "v6e"])
def test_the_largest_tpu_chunk_the_vmem_check_accepts_compiles(generation):
    check_largest_chunk(generation, 128, 128, "bfloat16", "head")


@pytest.mark.slow
@pytest.mark.parametrize("generation", ["v5e", "v6e"])
def test_the_largest_tpu_chunk_the_vmem_check_accepts_compiles_float32_k256(generation):
    check_largest_chunk(generation, 256, 256, "float32", "both")
