"""Targets and dispatch by chip, without any toolchain: ptxas reports parsed, chips named by
device kind, and which implementation dispatch picks for a faked compute capability or TPU
generation (the kernels' architecture declarations, fail-closed)."""

import jax
import jax.numpy as jnp
import pytest

import recurrax
from recurrax import Chip, kernel_registry
from recurrax.kernels.mosaic_gpu import has_interpret_mode
from recurrax._core.registry import chip_of, current_chip, judging_for
from recurrax.targets import TARGETS, get_target, parse_ptxas

REPORT = """\
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'recurrax_mgpu_chunk_fwd_mosaic_gpu_kernel' for 'sm_90a'
ptxas info    : Function properties for recurrax_mgpu_chunk_fwd_mosaic_gpu_kernel
    8 bytes stack frame, 300 bytes spill stores, 296 bytes spill loads
ptxas info    : Used 255 registers, used 2 barriers, 1 bytes smem
ptxas info    : Compile time = 143.755 ms
ptxas info    : Compiling entry function 'recurrax_mgpu_chunk_bwd_mosaic_gpu_kernel' for 'sm_90a'
ptxas info    : Function properties for recurrax_mgpu_chunk_bwd_mosaic_gpu_kernel
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 148 registers, used 1 barriers
"""


def test_ptxas_report_is_parsed_per_kernel():
    fwd, bwd = parse_ptxas("unrelated output\n" + REPORT)
    assert (fwd.name, fwd.arch, fwd.registers) == ("recurrax_mgpu_chunk_fwd_mosaic_gpu_kernel", "sm_90a", 255)
    assert (fwd.stack_bytes, fwd.spill_stores, fwd.spill_loads, fwd.smem_bytes, fwd.spills) == (8, 300, 296, 1, True)
    assert (bwd.registers, bwd.spill_stores, bwd.spill_loads, bwd.smem_bytes, bwd.spills) == (148, 0, 0, 0, False)


@pytest.mark.parametrize(
    ("platform", "kind", "capability", "expected"),
    [
        ("gpu", "NVIDIA H100 80GB HBM3", None, Chip("gpu", "NVIDIA H100 80GB HBM3", (9, 0))),
        ("cuda", "NVIDIA B200", None, Chip("gpu", "NVIDIA B200", (10, 0))),
        ("gpu", "NVIDIA GB200", None, Chip("gpu", "NVIDIA GB200", (10, 0))),
        ("gpu", "NVIDIA GeForce RTX 5090", None, Chip("gpu", "NVIDIA GeForce RTX 5090", (12, 0))),
        ("gpu", "Some new GPU", "12.1", Chip("gpu", "Some new GPU", (12, 1))),  # a device's attribute wins
        ("gpu", "Some new GPU", None, Chip("gpu", "Some new GPU", None)),
        ("tpu", "TPU v5 lite", None, Chip("tpu", "TPU v5 lite", generation="v5e")),
        ("tpu", "TPU v6 lite", None, Chip("tpu", "TPU v6 lite", generation="v6e")),
        ("tpu", "TPU v5", None, Chip("tpu", "TPU v5", generation="v5p")),
        ("cpu", "cpu", None, Chip("cpu", "cpu")),
    ],
)
def test_chip_of_a_device_kind(platform, kind, capability, expected):
    assert chip_of(platform, kind, capability) == expected


BF16 = jnp.zeros((1, 64, 2, 64), jnp.bfloat16)
CHANNEL = dict(gk=jnp.zeros((1, 64, 2, 64), jnp.float32))


def picked(chip: Chip, **gates) -> str:
    with judging_for(chip):
        return kernel_registry.select(BF16, BF16, BF16, **gates).name


@pytest.mark.parametrize(
    ("capability", "expected"),
    [((9, 0), "mosaic_gpu"), ((9, 5), "mosaic_gpu"), ((8, 0), "pallas_gpu"), ((10, 0), "pallas_gpu"),
     ((10, 3), "pallas_gpu"), ((12, 0), "pallas_gpu"), ((7, 5), "chunk"), (None, "chunk")],
)
def test_gpu_dispatch_by_compute_capability(capability, expected):
    """mosaic_gpu only on 9.x (wgmma); Blackwell and Ampere get the Triton kernels; older or
    unknown GPUs XLA chunk."""
    if expected != "chunk" and expected not in kernel_registry.names():
        pytest.skip(f"{expected} is not available in this JAX")
    assert picked(Chip("gpu", "a GPU", capability)) == expected
    assert picked(Chip("gpu", "a GPU", capability), **CHANNEL) == expected


def test_blackwell_without_the_triton_backend_runs_chunk():
    """Where this JAX lacks Pallas Triton, a 10.x GPU falls back to chunk, not to mosaic_gpu."""
    from recurrax.registry import KernelRegistry

    registry = KernelRegistry()
    for impl in kernel_registry.implementations():
        if impl.name != "pallas_gpu":
            registry.register(impl.name, impl.platform, impl.backend, priority=impl.priority, supports=impl.support)(impl.fn)
    registry.mark_unavailable("pallas_gpu", "no Triton backend")
    with judging_for(Chip("gpu", "NVIDIA B200", (10, 0))):
        assert registry.select(BF16, BF16, BF16).name == "chunk"


def test_forcing_mosaic_gpu_on_blackwell_says_why():
    with recurrax.target("b200"), pytest.raises(ValueError, match="compute capability 10.0 is not 9.x.*wgmma"):
        kernel_registry.select(BF16, BF16, BF16, implementation="mosaic_gpu")


@pytest.mark.parametrize(
    ("generation", "expected"), [("v5e", "pallas_tpu"), ("v6e", "pallas_tpu"), ("v5p", "chunk"), ("v4", "chunk"),
                                 (None, "chunk")],
)
def test_tpu_dispatch_by_generation(generation, expected):
    """pallas_tpu only on the generations it is compiled and tested for."""
    assert picked(Chip("tpu", "a TPU", generation=generation)) == expected
    if expected == "chunk":
        with judging_for(Chip("tpu", "a TPU", generation=generation)), pytest.raises(ValueError, match="v5e"):
            kernel_registry.select(BF16, BF16, BF16, implementation="pallas_tpu")


def test_v5e_runs_chunk_where_the_chip_measured_the_kernel_slower():
    """On a v5e, calls with a per-key-channel decay go to `chunk` (the chip measured the kernel
    4-5× slower, `kernels/tpu/_measured.py`), per-head decays keep the kernel, and the
    selection says which measurement decided; v6e (not measured) keeps the kernel; a call
    that names the kernel still gets it."""
    v5e, v6e = Chip("tpu", "TPU v5 lite", generation="v5e"), Chip("tpu", "TPU v6 lite", generation="v6e")
    per_head = dict(g=jnp.zeros((1, 64, 2), jnp.float32))
    assert picked(v5e, **CHANNEL) == "chunk"
    assert picked(v5e, **per_head) == picked(v5e) == picked(v6e, **CHANNEL) == "pallas_tpu"
    with judging_for(v5e):
        selection = kernel_registry.select(BF16, BF16, BF16, **CHANNEL)
        forced = kernel_registry.select(BF16, BF16, BF16, **CHANNEL, implementation="pallas_tpu")
    reason = dict(selection.passed_over)["pallas_tpu"]
    assert "measured slower than chunk on TPU v5e" in reason and "results/tpu.md" in reason
    assert dict(selection.answers)["pallas_tpu"] is None  # it can run the call; dispatch passes it over
    assert "pallas_tpu: can run it, passed over: measured slower" in str(selection)
    assert forced.name == "pallas_tpu"


def test_a_kernel_passed_over_everywhere_still_runs_when_nothing_else_can():
    from recurrax.registry import Backend, KernelRegistry, Platform, Support

    registry = KernelRegistry()
    support = Support(dtypes=frozenset({"bfloat16"}))
    registry.register("only", Platform.XLA, Backend.ANY, priority=1, supports=support,
                      passed_over=lambda request: "always slower")(lambda problem, **_: "only")
    assert registry.select(BF16, BF16, BF16).name == "only"


def test_named_targets_are_judged_as_their_chips():
    assert [picked(get_target(name).chip) for name in ("h100", "h200", "b200", "v5e", "v6e")] == (
        ["mosaic_gpu", "mosaic_gpu", "pallas_gpu" if "pallas_gpu" in kernel_registry.names() else "chunk",
         "pallas_tpu", "pallas_tpu"])
    assert [TARGETS[name].arch for name in ("h100", "b200", "v5e")] == ["sm_90a", "sm_100a", "v5e"]
    assert get_target("v5e:2x2").topology == "2x2"
    with pytest.raises(ValueError, match="unknown target"):
        get_target("a100")


def test_the_host_is_judged_outside_a_target():
    assert current_chip().backend == jax.default_backend() == "cpu"
    assert picked(current_chip()) == kernel_registry.select(BF16, BF16, BF16).name == "chunk"


@pytest.mark.skipif(not hasattr(jax.sharding, "AbstractDevice"), reason="JAX < 0.12 has no abstract devices")
def test_an_abstract_mesh_names_the_chip():
    device = jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=None, platform="gpu")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), (jax.sharding.AxisType.Explicit,), abstract_device=device)
    with jax.sharding.use_abstract_mesh(mesh):
        assert current_chip() == Chip("gpu", "NVIDIA H100 80GB HBM3", (9, 0))
    assert current_chip().backend == "cpu"


@pytest.mark.skipif(not has_interpret_mode(), reason=f"the Mosaic GPU kernels need JAX >= 0.12 (this is {jax.__version__})")
def test_mosaic_gpu_is_traced_for_h100_on_this_cpu():
    """Under `recurrax.target("h100")`, forcing mosaic_gpu through the public call traces its
    kernels (running or compiling them needs the chip or `recurrax.targets.compile_for`)."""
    spec = jax.ShapeDtypeStruct((1, 64, 2, 64), jnp.bfloat16)
    with recurrax.target("h100"):
        traced = jax.jit(lambda q: recurrax.recurrent(q, q, q, implementation="mosaic_gpu")[0]).trace(spec)
    assert "recurrax_mgpu_chunk_fwd" in str(traced.jaxpr)
    with pytest.raises(ValueError, match="runs on gpu, this call is on cpu"):
        jax.jit(lambda q: recurrax.recurrent(q, q, q, implementation="mosaic_gpu")[0]).trace(spec)


def test_the_cli_sets_the_targets_environment():
    from recurrax.targets import ENVIRONMENT
    from recurrax.tools.cli import TOOLCHAIN_ENVIRONMENT

    assert TOOLCHAIN_ENVIRONMENT == ENVIRONMENT


# ----------------------------------------------------------------------------- TPU tiles judged against VMEM


def test_vmem_tiles_are_counted_in_words_of_eight_by_128():
    from recurrax.kernels.tpu._vmem import tile_bytes

    assert tile_bytes(2048, 1, 4) == 2048 * 128 * 4  # a column pads to 128 lanes
    assert tile_bytes(1, 2048, 4) == 8 * 2048 * 4  # a row pads to 8 sublanes
    assert tile_bytes(10, 100, 2) == 16 * 128 * 2  # 16-bit types pack 16 rows


@pytest.mark.parametrize("generation", ["v5e", "v6e", None])
def test_the_declared_tpu_tiles_fit_every_declared_configuration(generation):
    from recurrax.kernels.tpu import HEAD_DIMS, TILES
    from recurrax.kernels.tpu._vmem import vmem_problem
    from recurrax.problem import Gate

    for K in HEAD_DIMS:
        for V in HEAD_DIMS:
            for dtype in (jnp.bfloat16, jnp.float32):
                for gate in (None, Gate.HEAD, Gate.KEY):
                    for backward in (False, True):
                        bv = min(V, TILES.block_v)
                        assert vmem_problem(TILES.chunk, K, bv, dtype, gate, backward, generation) is None


def test_a_chunk_of_2048_is_refused_before_mosaic_for_v5e():
    """libtpu: "CompileTimeScopedVmemOom ... size 17.24M and limit 16.00M" for this forward on v5e."""
    from recurrax.kernels.tpu import TpuTiles, tpu_recurrent
    from recurrax.problem import Problem

    def forward(q, g):
        return tpu_recurrent(Problem.create(query=q, key=q, value=q, g=g), scale=1.0, reverse=False, tiles=TpuTiles(chunk=2048))[0]

    specs = (jax.ShapeDtypeStruct((1, 4096, 1, 128), jnp.bfloat16), jax.ShapeDtypeStruct((1, 4096, 1), jnp.float32))
    with recurrax.target("v5e"), pytest.raises(ValueError, match="chunk=2048 needs about .* MiB of VMEM.*16 MiB.*v5e"):
        jax.jit(forward).trace(*specs)


def test_recurrax_compile_says_which_extra_is_missing(capsys):
    from recurrax.targets import toolchain_missing
    from recurrax.tools.compile import main

    missing = toolchain_missing("v6e")
    if missing is None:
        pytest.skip("libtpu is installed here")
    assert main(["--target", "v6e"]) == 2
    assert capsys.readouterr().out.strip() == f"cannot compile for v6e: {missing}"
    assert "compile-tpu" in missing and "under Python ≥ 3.12" in missing


@pytest.mark.parametrize("version", [(3, 11, 9), (3, 13, 1)])
def test_a_missing_toolchain_names_the_python_its_extra_needs(monkeypatch, version):
    """The toolchain extras need JAX ≥ 0.12, so Python ≥ 3.12; under 3.11 the message says it
    will not install there (issue 49: it recommended the extra that pip refuses on 3.11)."""
    import importlib.util
    import types

    from recurrax.targets import _compile

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: None)
    monkeypatch.setattr(_compile, "sys", types.SimpleNamespace(version_info=version))
    for name, extra in (("h100", "compile-cuda"), ("v5e", "compile-tpu")):
        missing = _compile.toolchain_missing(name)
        assert f"pip install 'recurrax[{extra}]' under Python ≥ 3.12 (the extra needs JAX ≥ 0.12)" in missing
        assert ("this is Python 3.11, where it does not install" in missing) == (version < (3, 12))
