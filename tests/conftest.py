import gc
import os

# XLA's backend at optimisation level 0: most of the suite's time is compiling many small programs,
# which compile ~35-40% faster so (measured side by side on test_pretrained_minimax and test_delta's
# float64 cases); the tests' tiny shapes run about as fast. A level the caller set stays.
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_backend_optimization_level=0".strip()

import jax  # noqa: E402  (after XLA_FLAGS: the backend reads them when it starts)
import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

# Eight host devices for the sequence-parallel tests; everything else runs on device 0.
jax.config.update("jax_num_cpu_devices", 8)
# The commands and examples the tests run (in this process or in subprocesses, which inherit it)
# write no persistent compilation cache into ~/.cache: test_compilation_cache.py turns it on itself.
os.environ.setdefault("RECURRAX_COMPILATION_CACHE", "off")
# Exactness is asserted in float64; float32 cases ask for float32 explicitly.
jax.config.update("jax_enable_x64", True)

# Property tests are reproducible: the same commit draws the same examples on every run
# (derandomize), with no example database carried between runs, and a failure prints the
# `@reproduce_failure` blob that replays it. HYPOTHESIS_PROFILE=explore draws new examples.
settings.register_profile(
    "ci", derandomize=True, database=None, print_blob=True, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("explore", deadline=None, print_blob=True, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: a run without the plugin (the TPU VM's) ignores it
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
