"""The files people expect: a license matching pyproject, a changelog, the typing marker shipped."""

import pathlib
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_license_matches_pyproject():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert pyproject["project"]["license"] == "Apache-2.0"  # an SPDX expression (PEP 639)
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text


def test_changelog_and_typing_marker():
    assert (ROOT / "CHANGELOG.md").read_text().startswith("# Changelog")
    assert (ROOT / "src" / "recurrax" / "py.typed").exists()
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "py.typed" in pyproject["tool"]["setuptools"]["package-data"]["recurrax"]


def test_installed_package_has_the_typing_marker():
    import importlib.resources

    marker = importlib.resources.files("recurrax") / "py.typed"
    if not marker.is_file():
        pytest.fail("py.typed is not installed with recurrax (package-data)")


def test_every_source_folder_is_a_package():
    """setuptools' package discovery (`packages.find`) ships only folders with an `__init__.py`:
    a folder of modules without one (a new `nn/pretrained/families/` subfolder, say) would be
    left out of the wheel while the tests, run from the source tree, still pass."""
    src = ROOT / "src" / "recurrax"
    folders = [d for d in src.rglob("*") if d.is_dir() and any(d.glob("*.py"))]
    assert len(folders) > 5
    assert [str(d.relative_to(src)) for d in folders if not (d / "__init__.py").is_file()] == []


def test_recurrax_imports_and_runs_without_absl():
    """JAX 0.10's Mosaic GPU backend imports absl-py, which `pip install jax` does not install (a
    TPU VM's own JAX lacked it): recurrax still imports, says why those kernels are unavailable,
    and runs. absl is hidden from a fresh interpreter (`sys.modules['absl'] = None`)."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['absl'] = None\n"
            "import jax.numpy as jnp, recurrax\n"
            "print(recurrax.kernel_registry.unavailable.get('mosaic_gpu', 'registered'))\n"
            "x = jnp.ones((1, 8, 2, 4)); print(recurrax.recurrent(x, x, x)[0].shape)\n")
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, child.stderr[-2000:]
    reason, shape = child.stdout.strip().splitlines()[-2:]
    # JAX 0.12's Mosaic GPU imports without absl (registered); 0.10's needs it (unavailable, saying why)
    assert reason == "registered" or ("Mosaic GPU backend does not import here" in reason and "absl" in reason)
    assert shape == "(1, 8, 2, 4)"


def test_what_the_commands_write_by_default_is_ignored():
    """`recurrax demo`'s plot, `examples/train_text.py`'s checkpoint directory and the README's
    `--output my_model` are not offered for commit (issue 49: they were untracked files)."""
    import re
    import shutil
    import subprocess

    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    demo = re.search(r'"--out", default="([^"]+)"', (ROOT / "src/recurrax/tools/demo.py").read_text()).group(1)
    trained = re.search(r'"--output", default="([^"]+)"', (ROOT / "examples/train_text.py").read_text()).group(1)
    for path in (demo, f"{trained}/config.json", "my_model/model.safetensors"):
        checked = subprocess.run(["git", "check-ignore", "-q", "--no-index", path], cwd=ROOT)
        assert checked.returncode == 0, f"{path} is not ignored by .gitignore"
