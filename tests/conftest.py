import os

import jax
from hypothesis import HealthCheck, settings

# Eight host devices for the sequence-parallel tests; everything else runs on device 0.
jax.config.update("jax_num_cpu_devices", 8)
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
settings.load_profile(__import__("os").environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_xdist_auto_num_workers(config):
    """`-n auto` (pyproject's addopts): one worker process per core, at most 4 — each worker
    is a JAX process whose compiled programs and 8 simulated devices cost memory. Test files
    stay whole on one worker (`--dist loadfile`), so a file's shared compiled functions and
    fixtures are built once."""
    return max(1, min(os.cpu_count() or 1, 4))
