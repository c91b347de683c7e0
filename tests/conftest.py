import gc
import os

import jax
import pytest
from hypothesis import HealthCheck, settings

# Eight host devices for the sequence-parallel tests; everything else runs on device 0.
jax.config.update("jax_num_cpu_devices", 8)
# Exactness is asserted in float64; float32 cases ask for float32 explicitly.
jax.config.update("jax_enable_x64", True)
# The suite compiles thousands of small programs that each run for microseconds, and XLA's CPU
# compiler spends most of a compile optimising machine code (LLVM): with that off the suite
# takes about 30% less time (2 cores, JAX 0.10: 14:16 → 9:45). What the tests check stays: XLA's
# program-level passes still run (the same fusions, buffers and temporaries), and the results
# differ from the optimised build's only in their last bits (a float32 `recurrent` forward and
# backward: at most 2.3e-7 relative), which every tolerance here covers. Users' programs are
# compiled fully optimised; so are the programs of the subprocess tests (examples, demo, CLI,
# server) and of the chip compiles (`compile` marker).
jax.config.update("jax_disable_most_optimizations", True)

# Property tests are reproducible: the same commit draws the same examples on every run
# (derandomize), with no example database carried between runs, and a failure prints the
# `@reproduce_failure` blob that replays it. HYPOTHESIS_PROFILE=explore draws new examples.
settings.register_profile(
    "ci", derandomize=True, database=None, print_blob=True, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("explore", deadline=None, print_blob=True, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_xdist_auto_num_workers(config):
    """`-n auto` (pyproject's addopts): one worker process per core, at most 4 — each worker
    is a JAX process whose compiled programs and 8 simulated devices cost memory. Test files
    stay whole on one worker (`--dist loadfile`), so a file's shared compiled functions and
    fixtures are built once."""
    return max(1, min(os.cpu_count() or 1, 4))


MAPS = "/proc/self/maps"
MAX_MAPS = "/proc/sys/vm/max_map_count"


@pytest.fixture(scope="module", autouse=True)
def _release_compiled_programs(request):
    """After each test file, drop JAX's caches of traced and compiled functions. A pytest-xdist
    worker lives through half the suite, and every program XLA's CPU JIT compiles keeps its
    code and data sections mapped while an executable holds it: left alone, a worker reached
    Linux's 65,530 memory mappings (`vm.max_map_count`) near the suite's end and LLVM aborted
    ("Unable to allocate section memory!") or crashed inside a compile. Where Linux tells, a
    file that leaves more than half that many mappings behind fails here, by name."""
    yield
    jax.clear_caches()
    gc.collect()
    if os.path.exists(MAPS) and os.path.exists(MAX_MAPS):
        with open(MAPS) as maps, open(MAX_MAPS) as limit:
            count, allowed = sum(1 for _ in maps), int(limit.read())
        assert count <= allowed // 2, f"{request.module.__name__} left {count} memory mappings (the limit: {allowed})"


@pytest.fixture(autouse=True)
def _chips_compiled_fully_optimised(request):
    """The `compile` tests build kernels for H100 / B200 / TPU as users get them (their register
    and spill budgets are those of an optimised build): optimisation back on for them."""
    if request.node.get_closest_marker("compile") is None:
        yield
        return
    jax.config.update("jax_disable_most_optimizations", False)
    try:
        yield
    finally:
        jax.config.update("jax_disable_most_optimizations", True)
