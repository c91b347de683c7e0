"""The kernels compiled for the real chips on this CPU (marker `compile`; not in the default
suite): every configuration of `REPRESENTATIVE` with what dispatch picks on each named target —
Mosaic GPU kernels through ptxas for H100 and H200 (sm_90a), the Triton kernels for B200
(sm_100a, in processes of their own), the TPU kernels through libtpu for v5e and v6e. Any pass,
ptxas or VMEM error fails. Test names carry the target (CI selects by `-k 'h100 or b200'`,
`-k 'v5e or v6e'`).

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
from recurrax.tools.compile import (FULL, REPRESENTATIVE, Configuration, compile_configuration, mosaic_tpu_kernels,
                                    program, selection)

pytestmark = pytest.mark.compile
REQUIRED = os.environ.get("RECURRAX_REQUIRE_TOOLCHAIN") == "1"


def need(target: str) -> targets.Target:
    missing = targets.toolchain_missing(target)
    if missing is not None:
        if REQUIRED:
            pytest.fail(f"RECURRAX_REQUIRE_TOOLCHAIN=1 but {target} cannot be compiled for here: {missing}")
        pytest.skip(missing)
    return targets.get_target(target)


# ----------------------------------------------------------------------------- H100, H200: Mosaic GPU, ptxas


def check_h100(configuration: Configuration) -> None:
    """What dispatch picks on H100 (the Mosaic GPU kernels) compiles, within the chip's limits."""
    target = need("h100")
    result = compile_configuration("h100", configuration)
    assert result.implementation == "mosaic_gpu"
    kernels = {kernel.name.removeprefix("recurrax_mgpu_chunk_"): kernel for kernel in result.compiled.kernels}
    expected = {"fwd", "states", "bwd"} if configuration.gradient else {"fwd"}
    launched = [*kernels, *(name.removeprefix("recurrax_mgpu_chunk_") for name in result.compiled.unreported)]
    # a launch whose Mosaic module `targets._ptxas` could not parse back is named "?" (seen once
    # in a CI-like run, not reproduced): the count and the names that could be read must agree
    assert len(launched) == len(expected) and set(launched) - {"?"} <= expected, launched
    for kernel in kernels.values():
        assert kernel.arch == "sm_90a" and 0 < kernel.registers <= 255
        assert kernel.threads == 128  # one warpgroup per program
        assert 0 < kernel.smem_bytes <= target.spec.smem_per_block_optin


def check_h200(configuration: Configuration) -> None:
    """H200 is sm_90a too: dispatch picks the same kernels, and the program compiles for its
    `GpuTargetConfig` (the kernels themselves come from the plugin's cache of the H100 build)."""
    need("h200")
    result = compile_configuration("h200", configuration)
    assert result.implementation == "mosaic_gpu"
    assert {kernel.arch for kernel in result.compiled.kernels} <= {"sm_90a"}


@pytest.mark.parametrize("configuration", REPRESENTATIVE["gpu"], ids=lambda c: c.label.replace(" ", "-"))
def test_dispatch_compiles_for_h100(configuration):
    check_h100(configuration)


@pytest.mark.parametrize("configuration", REPRESENTATIVE["gpu"], ids=lambda c: c.label.replace(" ", "-"))
def test_dispatch_compiles_for_h200_as_for_h100(configuration):
    """After every H100 program (an H200 compile between H100 ones was seen to leave the next
    H100 program's ptxas reports unpaired: the known mis-pairing of same-named kernels)."""
    check_h200(configuration)


@pytest.mark.slow
@pytest.mark.parametrize("configuration", FULL["gpu"], ids=lambda c: c.label.replace(" ", "-"))
def test_mosaic_gpu_compiles_for_h100_every_configuration(configuration):
    check_h100(configuration)


# ----------------------------------------------------------------------------- B200: the Triton kernels, sm_100a

B200_CHECK = """
import sys
from recurrax.tools.compile import REPRESENTATIVE, attempt, selection

for index in map(int, sys.argv[1:]):
    configuration = REPRESENTATIVE["gpu"][index]
    result = attempt("b200", configuration)
    print(index, result.implementation, result.error or "compiled", flush=True)
"""
B200_MOSAIC_CHECK = """
from recurrax import targets
from recurrax.kernels.mosaic_gpu import mosaic_gpu_recurrent
from recurrax.tools.cases import canonical
from recurrax.tools.compile import Configuration, program, selection

case = Configuration("channel", 64, 64, "bfloat16", packed=True)
print("picked", selection("b200", case).name, "|", dict(selection("b200", case).answers)["mosaic_gpu"])
_, (diff, arrays) = program(case, implementation="chunk")

def direct(diff, arrays):
    problem, config, _ = canonical({**diff, **arrays})
    return mosaic_gpu_recurrent(problem, scale=config.scale, reverse=config.reverse)

try:
    targets.compile_for("b200", direct, diff, arrays)
    print("mosaic_gpu compiled for sm_100a")
except Exception as error:
    print("mosaic_gpu refused:", "wgmma" in str(error))
"""
B200_PROCESSES = 2
"""The B200 set is split over this many processes at once (CI's machine has two cores)."""


def b200_children(script: str, arguments: list[list[str]]) -> list[str]:
    """Run `script` in a process per argument list at once (sm_100a: the CUDA plugin's kernel
    cache does not tell it from the sm_90a of this process's H100 builds); their outputs."""
    import subprocess
    import sys

    children = [subprocess.Popen([sys.executable, "-c", script, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True) for args in arguments]
    outputs = []
    for child in children:
        out, err = child.communicate(timeout=1800)
        assert child.returncode == 0, err[-3000:]
        outputs.append(out)
    return outputs


def test_dispatch_compiles_for_b200():
    """Every configuration of the set compiles for sm_100a with what dispatch picks there (the
    Triton kernels, or chunk where JAX lacks them); it was fail-open on the packed ones (Triton
    could not lower their state reset for Blackwell's tensor memory)."""
    need("b200")
    indices = [str(index) for index in range(len(REPRESENTATIVE["gpu"]))]
    outputs = b200_children(B200_CHECK, [indices[part::B200_PROCESSES] for part in range(B200_PROCESSES)])
    lines = sorted((line.split(" ", 2) for out in outputs for line in out.strip().splitlines()), key=lambda x: int(x[0]))
    assert [int(index) for index, _, _ in lines] == list(range(len(REPRESENTATIVE["gpu"])))
    failures = [f"{REPRESENTATIVE['gpu'][int(index)].label}: {outcome}" for index, _, outcome in lines if outcome != "compiled"]
    assert not failures, "\n".join(failures)
    assert {implementation for _, implementation, _ in lines} <= {"pallas_gpu", "chunk"}


def test_mosaic_gpu_forced_on_b200_fails_in_ptxas():
    """Dispatch refuses the Mosaic GPU kernels on sm_100a, saying why (wgmma); forced past
    dispatch they fail in ptxas."""
    need("b200")
    (out,) = b200_children(B200_MOSAIC_CHECK, [[]])
    picked, refused = out.strip().splitlines()[-2:]
    assert picked.split()[1] in ("pallas_gpu", "chunk") and "wgmma" in picked
    assert refused == "mosaic_gpu refused: True"


# ----------------------------------------------------------------------------- TPU v5e, v6e: Mosaic TPU, libtpu


def check_tpu(generation: str, configuration: Configuration) -> None:
    """The Pallas TPU kernels compile for the generation (named: dispatch passes some over on a
    chip that measured `chunk` faster, `recurrax/kernels/tpu/_measured.py`)."""
    need(generation)
    result = compile_configuration(generation, configuration, "pallas_tpu")
    assert result.implementation == "pallas_tpu"
    text = result.compiled.executable.as_text()
    # the delta rule's backward reruns its forward for the chunk states; `recurrent`'s reads the
    # states its differentiated forward wrote
    kinds = ("fwd", "states", "bwd") if configuration.delta else ("fwd", "bwd")
    assert text.count("tpu_custom_call") == len(kinds)
    kernels = set(mosaic_tpu_kernels(result.compiled).split(", "))  # what `recurrax compile` lists
    operation = "delta" if configuration.delta else "chunk"
    assert kernels == {f"recurrax_tpu_{operation}_{kind}" for kind in kinds}, kernels
    _, args = program(configuration)
    inputs = sum(np.asarray(leaf).nbytes for leaf in jax.tree.leaves(args))
    assert result.compiled.memory().argument_size_in_bytes >= inputs  # TPU layouts pad to tiles


@pytest.mark.parametrize("generation", ["v5e", "v6e"])
@pytest.mark.parametrize("configuration", REPRESENTATIVE["tpu"], ids=lambda c: c.label.replace(" ", "-"))
def test_tpu_kernels_compile(generation, configuration):
    check_tpu(generation, configuration)


@pytest.mark.slow
@pytest.mark.parametrize("generation", ["v5e", "v6e"])
@pytest.mark.parametrize("configuration", FULL["tpu"], ids=lambda c: c.label.replace(" ", "-"))
def test_tpu_kernels_compile_every_configuration(generation, configuration):
    check_tpu(generation, configuration)


# ----------------------------------------------------------------------------- `recurrax compile`: the report


def test_recurrax_compile_forward_only_prints_one_table_and_a_fit_line_for_v5e():
    """`--forward-only` compiles forward programs of the TPU set (which holds gradient programs
    only; it raised IndexError); the table is printed once, then one fit line; libtpu's
    start-up messages are not shown."""
    import subprocess
    import sys

    need("v5e")
    command = [sys.executable, "-m", "recurrax.tools.cli", "compile", "--target", "v5e", "--forward-only", "--limit", "1"]
    child = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert child.returncode == 0, child.stderr[-3000:]
    lines = child.stdout.strip().splitlines()
    assert sum(line.startswith("| configuration |") for line in lines) == 1
    assert " forward | pallas_tpu |" in lines[-2]
    assert lines[-1].startswith("v5e: 1 of 1 configurations compiled; every kernel fit the 16 MiB scoped VMEM")
    assert child.stderr.strip() == ""


def test_recurrax_compile_reports_a_failure_as_a_row_and_goes_on_for_v6e(monkeypatch, capsys):
    """A configuration that does not compile is a row with the first error line; the next one
    still compiles, and the exit status is 1."""
    from recurrax.kernels.tpu import TpuTiles, tpu_recurrent
    from recurrax.tools import compile as tool
    from recurrax.tools.cases import canonical

    need("v6e")

    def program_with_a_chunk_too_large(configuration, implementation=None):
        fn, args = program(configuration, implementation)
        if configuration.dtype != "bfloat16":
            return fn, args

        def oversized(diff, arrays):
            problem, config, _ = canonical({**diff, **arrays})
            return tpu_recurrent(problem, scale=config.scale, reverse=False, tiles=TpuTiles(chunk=4096))

        return oversized, args

    monkeypatch.setattr(tool, "program", program_with_a_chunk_too_large)
    assert tool.main(["--target", "v6e", "--gates", "none", "--limit", "2"]) == 1
    lines = capsys.readouterr().out.strip().splitlines()
    failed, compiled, summary = lines[-3:]
    assert failed.startswith("| none K128 V128 bfloat16 dense gradient | pallas_tpu | failed "
                             "| ValueError: TPU chunk kernels: chunk=4096 needs")
    assert compiled.startswith("| none K128 V128 float32 dense gradient | pallas_tpu |")
    assert summary.startswith("v6e: 1 of 2 configurations compiled, 1 failed;")


# ----------------------------------------------------------------------------- TPU tiles: the VMEM check against libtpu


@pytest.fixture
def no_headroom(monkeypatch):
    """The kernels compile with the default scoped-VMEM limit, the one the estimate judges by."""
    from recurrax.kernels.tpu import _vmem

    monkeypatch.setattr(_vmem, "KERNEL_HEADROOM", 1)


def test_a_small_per_channel_float32_backward_compiles_for_v5e():
    """At B2 T128 (one chunk), 4 heads of 64, float32, XLA places the backward kernel's operands
    in VMEM and libtpu 0.0.42.1 (JAX 0.10.2's, the v5e's) needed 20.3 MiB for its scoped
    allocation (the chip refused it, 2026-12-07; T = 512 fits 16 MiB): the kernels compile with
    headroom over the default limit (`_vmem.KERNEL_HEADROOM`). The newer libtpu CI compiles with
    fits it in 16 MiB; this fails without the headroom under libtpu 0.0.42.1."""
    import jax.numpy as jnp

    from recurrax.kernels.tpu import TpuTiles, tpu_recurrent
    from recurrax.tools.cases import Case, canonical, make_inputs, split_args

    need("v5e")
    diff, rest = split_args(make_inputs(Case(B=2, T=128, H=4, Hkv=4, K=64, V=64, gates=("gk",), dtype="float32")))

    def loss(diff):
        problem, config, _ = canonical({**rest, **diff})
        output, state = tpu_recurrent(problem, scale=config.scale, reverse=False, tiles=TpuTiles(heads=4))
        return jnp.sum(output) + jnp.sum(state)

    compiled = targets.compile_for("v5e", jax.grad(loss), diff)
    assert compiled.executable.as_text().count("tpu_custom_call") == 2


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_guarded_grouped_per_channel_call_compiles_for_v5e(dtype):
    """`recurrent` with grouped heads (4 value heads of 128 on 2 key heads of 64) and a
    per-channel decay, forward and backward through `pallas_tpu` with the non-finite guard,
    compiles for a v5e: a rewrite of the guard that formed its per-token flags inside its
    `lax.cond` by a matrix-vector product over D = 128 failed to compile there (libtpu 0.0.42.1
    on the chip, 2026-12-07, and CI's libtpu: "Shape mismatch between parameter number 0 and
    its operand", a [T, H] layout)."""
    import jax.numpy as jnp

    import recurrax
    from recurrax.tools.cases import Case, make_inputs, split_args

    need("v5e")
    diff, rest = split_args(make_inputs(Case(B=1, T=128, H=4, Hkv=2, K=64, V=128, gates=("gk",), dtype=dtype)))

    def forward_backward(diff):
        (output, state), pullback = jax.vjp(lambda d: recurrax.recurrent(**d, **rest, implementation="pallas_tpu"),
                                            diff)
        return output, state, pullback((jnp.ones_like(output), jnp.ones_like(state)))[0]

    compiled = targets.compile_for("v5e", forward_backward, diff)
    assert compiled.executable.as_text().count("tpu_custom_call") == 2


def largest_accepted_chunk(generation: str, K: int, V: int, dtype, gate) -> int:
    """The largest chunk (128 · 2^i) whose forward and backward the VMEM check accepts."""
    from recurrax.kernels.tpu._vmem import vmem_problem

    accepted = [C for C in (128, 256, 512, 1024, 2048, 4096)
                if not any(vmem_problem(C, K, min(V, 128), dtype, gate, b, generation) for b in (False, True))]
    return accepted[-1]


def check_largest_chunk(generation: str, K: int, V: int, dtype: str, gates: str) -> None:
    """What the VMEM check accepts, libtpu compiles (forward and backward kernels) within the
    default scoped limit (the kernels' headroom off)."""
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
    assert compiled.executable.as_text().count("tpu_custom_call") == 2, compiled.executable.as_text().count("tpu_custom_call")


@pytest.mark.parametrize("generation", ["v5e", "v6e"])
def test_the_largest_tpu_chunk_the_vmem_check_accepts_compiles(generation, no_headroom):
    check_largest_chunk(generation, 128, 128, "bfloat16", "head")


@pytest.mark.slow
@pytest.mark.parametrize("generation", ["v5e", "v6e"])
def test_the_largest_tpu_chunk_the_vmem_check_accepts_compiles_float32_k256(generation, no_headroom):
    check_largest_chunk(generation, 256, 256, "float32", "both")


def largest_accepted_heads(generation: str, K: int, V: int, dtype, gate, H: int) -> int:
    """The most heads per grid step (a divisor of H, C = 128) whose forward and backward the VMEM
    check accepts."""
    from recurrax.kernels.tpu._vmem import vmem_problem

    return max(heads for heads in range(1, H + 1) if H % heads == 0 and not any(
        vmem_problem(128, K, min(V, 128), dtype, gate, b, generation, heads=heads) for b in (False, True)))


def check_most_heads(generation: str, K: int, V: int, dtype: str, gates: str, expected: int) -> None:
    """What the VMEM check accepts with many heads per grid step, libtpu compiles (forward,
    states and backward kernels, 16 heads, two chunks)."""
    import jax.numpy as jnp

    from recurrax.kernels.tpu import TpuTiles, tpu_recurrent
    from recurrax.problem import Gate
    from recurrax.tools.cases import Case, canonical, make_inputs, split_args
    from recurrax.tools.compile import GATE_SETS

    need(generation)
    gate = {"head": Gate.HEAD, "channel": Gate.KEY}[gates]
    heads = largest_accepted_heads(generation, K, V, jnp.dtype(dtype), gate, 16)
    assert heads == expected  # the estimate's answer; a change of it is seen here
    case = Case(B=1, T=256, H=16, Hkv=16, K=K, V=V, gates=GATE_SETS[gates], dtype=dtype)
    diff, rest = split_args(make_inputs(case))

    def loss(diff):
        problem, config, _ = canonical({**rest, **diff})
        output, state = tpu_recurrent(problem, scale=config.scale, reverse=False, tiles=TpuTiles(heads=heads))
        return jnp.sum(output.astype(jnp.float32)) + jnp.sum(state)

    compiled = targets.compile_for(generation, jax.grad(loss), diff)
    assert compiled.executable.as_text().count("tpu_custom_call") == 2, compiled.executable.as_text().count("tpu_custom_call")


@pytest.mark.parametrize(("generation", "expected"), [("v5e", 16), ("v6e", 16)])
def test_the_most_heads_per_step_the_vmem_check_accepts_compile(generation, expected, no_headroom):
    check_most_heads(generation, 64, 64, "bfloat16", "head", expected)


@pytest.mark.slow
@pytest.mark.parametrize(("generation", "expected"), [("v5e", 4), ("v6e", 8)])
def test_the_most_heads_per_step_the_vmem_check_accepts_compile_per_channel_k128(generation, expected, no_headroom):
    check_most_heads(generation, 128, 128, "bfloat16", "channel", expected)


def delta_heads(generation: str, gates: str, chunk: int) -> tuple[int, int]:
    """The heads per grid step the delta rule's kernels take by default (forward, backward) at
    GDN's / KDA's shape of issue 45: 32 value heads on 16 query/key heads, K = V = 128, bf16."""
    import jax.numpy as jnp

    from recurrax.kernels.tpu import _tiles
    from recurrax.problem import Gate

    s = _tiles.Shapes(B=1, H=32, Tp=2 * chunk, K=128, V=128, BV=128, C=chunk, c=16, G=16, delta=True)
    gate = {"g": Gate.HEAD, "gk": Gate.KEY}[gates]
    with targets.target(generation):
        return tuple(_tiles.most_heads(s, gate, jnp.bfloat16, backward) for backward in (False, True))


def check_delta_heads(generation: str, gates: str, chunk: int, expected: tuple[int, int]) -> None:
    """What the delta rule's VMEM estimate takes by default (the most heads a step, up to 8,
    forward and backward apart) libtpu compiles: forward, states and backward kernels."""
    import jax.numpy as jnp

    from recurrax.delta import canonicalize_delta
    from recurrax.kernels.tpu import TpuTiles, tpu_delta

    need(generation)
    assert delta_heads(generation, gates, chunk) == expected  # the estimate's answer; a change of it is seen here
    rng = np.random.default_rng(0)
    T, H, G, D = 2 * chunk, 32, 16, 128
    arrays = {"q": rng.normal(size=(1, T, G, D)), "k": rng.normal(size=(1, T, G, D)), "v": rng.normal(size=(1, T, H, D)),
              "beta": rng.uniform(size=(1, T, H)),
              "g": -rng.uniform(size=(1, T, H) if gates == "g" else (1, T, H, D))}
    arrays = {name: np.asarray(x, jnp.bfloat16 if name in "qkv" else np.float32) for name, x in arrays.items()}

    def loss(arrays):
        problem, scale, _ = canonicalize_delta(arrays["q"], arrays["k"], arrays["v"], arrays["beta"],
                                                    arrays["g"] if gates == "g" else None,
                                                    arrays["g"] if gates == "gk" else None, None, None, None, True)
        output, state = tpu_delta(problem, scale=scale, tiles=TpuTiles(chunk=chunk))
        return jnp.sum(output.astype(jnp.float32)) + jnp.sum(state)

    compiled = targets.compile_for(generation, jax.value_and_grad(loss), arrays)  # grad alone drops the forward
    assert compiled.executable.as_text().count("tpu_custom_call") == 3, compiled.executable.as_text().count("tpu_custom_call")


@pytest.mark.parametrize(("generation", "gates", "expected"), [("v5e", "g", (8, 8)), ("v5e", "gk", (8, 8)),
                                                                ("v6e", "g", (8, 8))])
def test_the_delta_rules_default_heads_per_step_compile(generation, gates, expected):
    check_delta_heads(generation, gates, 128, expected)


@pytest.mark.slow
@pytest.mark.parametrize(("generation", "gates", "expected"), [("v5e", "g", (8, 4)), ("v5e", "gk", (4, 1))])
def test_the_delta_rules_default_heads_per_step_compile_chunk_256(generation, gates, expected):
    """Chunk 256 on v5e: 8 heads of the per-head backward and 2 of the per-channel one overflow
    the 16 MiB (libtpu 0.0.42.1); the estimate takes 4 and 1."""
    check_delta_heads(generation, gates, 256, expected)


# ----------------------------------------------------------------------------- mixture of experts: ragged_dot


MOE_SHAPES = {"64e-top8": (64, 8), "512e-top10": (512, 10)}
"""(experts, top-k) of benchmarks/moe.py's layers: d_model 1024, expert FFN 512, 8 × 512 tokens."""


def check_moe(target: str, experts: int, top_k: int) -> None:
    """`MixtureOfExperts`' forward and backward compile for the target with the grouped matmul
    its backend gets (`jax.lax.ragged_dot`), where this CPU's own choice is the block-padded
    batched matmul (no `ragged_dot` in its program)."""
    import jax.numpy as jnp
    from flax import nnx

    import recurrax.nn as rnn

    need(target)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: rnn.MixtureOfExperts(1024, experts, 512, top_k,
                                                                             rngs=nnx.Rngs(0))))
    x = jax.ShapeDtypeStruct((8, 512, 1024), jnp.float32)

    def loss(state, x):
        return jnp.sum(jnp.square(nnx.merge(graphdef, state)(x)))

    def gradients(state, x):  # traced by a new function each time: jit's cache ignores the target judged
        return jax.grad(loss, argnums=(0, 1))(state, x)

    compiled = targets.compile_for(target, gradients, state, x)
    assert "ragged_dot" in compiled.executable.as_text()
    with targets.target(target):
        assert "ragged_dot" in str(jax.make_jaxpr(lambda *args: gradients(*args))(state, x))
    assert "ragged_dot" not in str(jax.make_jaxpr(lambda *args: gradients(*args))(state, x))  # this host


@pytest.mark.parametrize("shape", [pytest.param(shape, marks=pytest.mark.slow if shape != "64e-top8" else ())
                                   for shape in MOE_SHAPES])
def test_mixture_of_experts_compiles_with_ragged_dot_for_h100(shape):
    check_moe("h100", *MOE_SHAPES[shape])


@pytest.mark.parametrize("shape", [pytest.param(shape, marks=pytest.mark.slow if shape != "64e-top8" else ())
                                   for shape in MOE_SHAPES])
def test_mixture_of_experts_compiles_with_ragged_dot_for_v5e(shape):
    check_moe("v5e", *MOE_SHAPES[shape])


# ----------------------------------------------------------------------------- a long-context training step (v5e)


def test_a_slim_training_step_with_the_chunked_loss_compiles_for_v5e_within_its_bound():
    """benchmarks/long_context.py's step in small: a tiny model's forward, backward (remat
    "block", the chunked `token_losses`) and AdamW compiled by libtpu for one v5e chip. The
    compiler's memory analysis holds the parameters, the optimizer state and the tokens as
    arguments (their bytes, plus at most half again for the TPU's padding of small arrays to
    its (8, 128) tiles: 12% here), and the temporaries stay below one copy of the full
    `[B, T, vocab]` float32 logits, which a loss that materialised them would hold twice (the
    logits and their gradient)."""
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from recurrax.nn.pretrained import from_size

    need("v5e")
    B, T, vocab = 1, 4096, 2048
    model = nnx.eval_shape(lambda: from_size("tiny", vocab_size=vocab, remat="block", rngs=nnx.Rngs(0)))
    graphdef, params = nnx.split(model)
    optimizer = optax.adamw(1e-3)
    opt_state = jax.eval_shape(optimizer.init, params)
    tokens = jax.ShapeDtypeStruct((B, T), jnp.int32)

    def step(params, opt_state, inputs, targets):
        loss = lambda p: nnx.merge(graphdef, p).token_losses(inputs, targets).mean()  # noqa: E731
        value, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    compiled = targets.compile_for("v5e", step, params, opt_state, tokens, tokens)
    memory = compiled.memory()
    assert memory is not None
    state_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves((params, opt_state)))
    exact = state_bytes + 2 * B * T * 4
    assert exact <= memory.argument_size_in_bytes <= 1.5 * exact
    assert 0 < memory.temp_size_in_bytes < B * T * vocab * 4


# ----------------------------------------------------------------------------- XLA around the TPU kernels (v5e)


def test_recurrent_per_head_gate_as_projected_runs_two_kernels_and_no_gate_cumsum_on_v5e():
    """`recurrent(..., g=per-head, implementation="pallas_tpu")` on arrays held [B, T, H · D]
    as a model's projections write them, bf16, forward and forward+backward compiled for a v5e:
    the kernels are the forward and the backward only (the backward reads the chunk states the
    differentiated forward wrote), and XLA forms no chunk-local cumulative sum of the gate (the
    kernels form it): no `reduce-window` in either program. (The guard of non-finite inputs
    still has XLA write transposed copies of the token arrays around the kernels: its rewrite
    was reverted after the chip measured the `gk` chunk path slower with it.)"""
    import jax.numpy as jnp

    import recurrax

    need("v5e")
    B, T, H, D = 1, 4096, 16, 64
    token = jax.ShapeDtypeStruct((B, T, H * D), jnp.bfloat16)
    gate = jax.ShapeDtypeStruct((B, T, H), jnp.float32)

    def forward(q, k, v, g):
        heads = lambda x: x.reshape(B, T, H, D)  # noqa: E731
        output, final = recurrax.recurrent(heads(q), heads(k), heads(v), g=g, implementation="pallas_tpu")
        return output.reshape(B, T, H * D), final

    def loss(q, k, v, g, d_output):
        output, final = forward(q, k, v, g)
        return jnp.sum(output * d_output) + jnp.sum(final)

    for fn, args, kernels in ((forward, (token, token, token, gate), 1),
                              (jax.grad(loss, argnums=(0, 1, 2, 3)), (token, token, token, gate, token), 2)):
        hlo = targets.compile_for("v5e", fn, *args).executable.as_text()
        assert hlo.count("tpu_custom_call") == kernels
        assert "reduce-window(" not in hlo
