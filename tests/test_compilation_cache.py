"""The persistent compilation cache (recurrax.use_compilation_cache) the commands and examples
turn on: where it goes, what turns it off, and a real process started twice compiling nothing
the second time (JAX's own monitoring events: every compile request a cache hit)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from recurrax import use_compilation_cache
from recurrax._compilation_cache import ENVIRONMENT_VARIABLE, default_cache_directory

ROOT = Path(__file__).resolve().parent.parent
SETTINGS = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
            "jax_persistent_cache_min_entry_size_bytes")


@pytest.fixture
def restored_settings():
    """JAX's cache settings put back after the test (which compiles nothing meanwhile)."""
    saved = {name: getattr(jax.config, name) for name in SETTINGS}
    yield
    for name, value in saved.items():
        jax.config.update(name, value)


def test_directory_follows_xdg_and_the_environment(tmp_path, monkeypatch, restored_settings):
    monkeypatch.delenv(ENVIRONMENT_VARIABLE, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    jax.config.update("jax_compilation_cache_dir", None)
    assert default_cache_directory() == tmp_path / "xdg" / "recurrax" / "jax"
    assert use_compilation_cache() == str(tmp_path / "xdg" / "recurrax" / "jax")
    assert jax.config.jax_compilation_cache_dir == str(tmp_path / "xdg" / "recurrax" / "jax")
    assert jax.config.jax_persistent_cache_min_compile_time_secs == 0
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_cache_directory() == tmp_path / "home" / ".cache" / "recurrax" / "jax"
    monkeypatch.setenv(ENVIRONMENT_VARIABLE, str(tmp_path / "mine"))
    assert use_compilation_cache() == str(tmp_path / "mine") and (tmp_path / "mine").is_dir()
    assert use_compilation_cache(tmp_path / "given") == str(tmp_path / "given")


@pytest.mark.parametrize("value", ["off", "0", "False", "none"])
def test_environment_turns_it_off(value, monkeypatch, restored_settings):
    monkeypatch.setenv(ENVIRONMENT_VARIABLE, value)
    jax.config.update("jax_compilation_cache_dir", None)
    assert use_compilation_cache() is None
    assert jax.config.jax_compilation_cache_dir is None


COUNTING_RUN = """
import collections, json, runpy, sys
import jax.monitoring
events = collections.Counter()
jax.monitoring.register_event_listener(lambda name, **kwargs: events.update([name]))
sys.argv = [sys.argv[1], *sys.argv[2:]]
runpy.run_path(sys.argv[0], run_name="__main__")
print("EVENTS " + json.dumps(dict(events)))
"""
"""Run a script, then print JAX's monitoring events of the run (compile requests, cache hits)."""


def counted_run(cache: Path, *flags: str) -> dict:
    env = {key: value for key, value in os.environ.items() if key != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", **{ENVIRONMENT_VARIABLE: str(cache)})
    done = subprocess.run([sys.executable, "-c", COUNTING_RUN, str(ROOT / "examples" / "train_lm.py"), *flags],
                          capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    line = [line for line in done.stdout.splitlines() if line.startswith("EVENTS ")][-1]
    return json.loads(line[len("EVENTS "):])


def test_second_start_compiles_nothing(tmp_path):
    pytest.importorskip("optax")
    flags = ("--steps", "2", "--batch-size", "2", "--seq-len", "8", "--num-layers", "1", "--d-model", "16",
             "--vocab-size", "16")
    requests, hits = "/jax/compilation_cache/compile_requests_use_cache", "/jax/compilation_cache/cache_hits"
    first = counted_run(tmp_path / "cache", *flags)
    assert first.get(requests, 0) > 0 and first.get(hits, 0) == 0, first
    entries = sorted(path.name for path in (tmp_path / "cache").iterdir())
    assert entries, "the first run wrote nothing to the cache"
    second = counted_run(tmp_path / "cache", *flags)
    assert second.get(requests, 0) == first[requests] and second.get(hits, 0) == second[requests], second
    assert sorted(path.name for path in (tmp_path / "cache").iterdir()) == entries
    off = counted_run(tmp_path / "unused", *flags, "--no-compilation-cache")
    assert off.get(hits, 0) == 0 and not (tmp_path / "unused").exists(), off
