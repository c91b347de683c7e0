"""The API reference (mkdocs + mkdocstrings, `mkdocs.yml`) builds with no warning, and covers
the public names. Skipped when the `docs` extra is not installed."""

from __future__ import annotations

import ast
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS_PACKAGES = ("mkdocs", "mkdocstrings", "mkdocstrings_handlers.python")


def _missing() -> list[str]:
    missing = []
    for name in DOCS_PACKAGES:
        try:
            found = importlib.util.find_spec(name) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            missing.append(name)
    return missing


needs_docs = pytest.mark.skipif(bool(_missing()) or not (ROOT / "mkdocs.yml").exists(),
                                reason=f"needs the docs extra (pip install '.[docs]'); missing {_missing()}")


def public_names(path: Path) -> list[str]:
    """`__all__` of a module, read from its source (no import, so no flax needed)."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return list(ast.literal_eval(node.value))
    raise AssertionError(f"no __all__ in {path}")


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The site built strictly (any warning is an error) into a temporary folder."""
    out = tmp_path_factory.mktemp("site")
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"),
                             "-d", str(out)], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    return out


def page_text(site: Path) -> str:
    return "\n".join(p.read_text() for p in (site / "api").rglob("index.html"))


PUBLIC_MODULES = {
    "recurrax": "src/recurrax/__init__.py",
    "recurrax.parallel": "src/recurrax/parallel.py",
    "recurrax.targets": "src/recurrax/targets/__init__.py",
    "recurrax.nn": "src/recurrax/nn/__init__.py",
    "recurrax.nn.pretrained": "src/recurrax/nn/pretrained/__init__.py",
    "recurrax.generation": "src/recurrax/generation/__init__.py",
}
"""The modules a user imports (the rest of the package is internal: docs/architecture.md)."""


@needs_docs
def test_builds_strictly_with_every_page(site):
    for page in ("recurrent", "delta", "parallel", "problem", "registry", "targets", "decays", "nn", "pretrained", "generation"):
        assert (site / "api" / page / "index.html").exists(), page


@needs_docs
@pytest.mark.parametrize("module", sorted(PUBLIC_MODULES))
def test_public_names_are_documented(site, module):
    """Every name in a public module's `__all__` appears on a page under its own module's
    path, or under the module it is re-exported from (`recurrax.nn.alibi_slopes` is
    `recurrax.decays.alibi_slopes`)."""
    text = page_text(site)
    undocumented = [name for name in public_names(ROOT / PUBLIC_MODULES[module])
                    if f"{module}.{name}" not in text and f"recurrax.decays.{name}" not in text]
    assert not undocumented, f"on no API page: {[f'{module}.{name}' for name in undocumented]}"


@needs_docs
def test_argument_lists_render_as_lists(site):
    """The docstrings' `**Arguments:**` lists become HTML lists (docs/api/griffe_markdown_lists.py)."""
    html = (site / "api" / "recurrent" / "index.html").read_text()
    assert re.search(r"<strong>Arguments:</strong></p>\s*<ul>\s*<li><code>query</code>", html)
    assert "\n- <code>" not in html     # no list left as a run-on paragraph


def test_separate_lists():
    spec = importlib.util.spec_from_file_location("griffe_markdown_lists", ROOT / "docs/api/griffe_markdown_lists.py")
    if importlib.util.find_spec("griffe") is None or spec is None:
        pytest.skip("needs griffe (the docs extra)")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    text = "Intro.\n\n**Arguments:**\n- `a`: one\n  continued.\n- `b`: two\n\n```\nx\n- not a list\n```\n    - code"
    expected = "Intro.\n\n**Arguments:**\n\n- `a`: one\n  continued.\n- `b`: two\n\n```\nx\n- not a list\n```\n    - code"
    assert module.separate_lists(text) == expected
    assert module.separate_lists(expected) == expected
