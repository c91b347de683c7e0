"""The README's Python examples run as written, and its Quickstart has exactly two commands."""

import pathlib
import re

import jax
import pytest

README = (pathlib.Path(__file__).parents[1] / "README.md").read_text()
EXAMPLES = re.findall(r"```python\n(.*?)```", README, flags=re.S)


def test_quickstart_is_two_commands():
    assert README.startswith("## Quickstart")
    block = re.search(r"## Quickstart\s+```bash\n(.*?)```", README, flags=re.S).group(1)
    lines = [line for line in block.splitlines() if line.strip()]
    assert len(lines) == 2 and "pytest" in lines[1]


@pytest.mark.parametrize("source", EXAMPLES, ids=[f"example{i}" for i in range(len(EXAMPLES))])
def test_readme_example_runs(source):
    with jax.enable_x64(False):  # as a user runs them: JAX's default precision
        exec(compile(source, "README.md", "exec"), {"__name__": "readme"})
