"""The README's Python examples run as written, and its Quickstart has exactly two commands."""

import pathlib
import re

import jax
import pytest

ROOT = pathlib.Path(__file__).parents[1]
README = (ROOT / "README.md").read_text()
EXAMPLES = re.findall(r"```python\n(.*?)```", README, flags=re.S)


def test_reads_top_down():
    """Title and what the library is first, then Install (with the clone), then Quickstart."""
    headings = re.findall(r"^(#{1,2} .+)$", README, flags=re.M)
    assert headings[:3] == ["# recurrax", "## Install", "## Quickstart"], headings[:3]
    install = README[README.index("## Install"):README.index("## Quickstart")]
    assert "git clone" in install
    assert README.count("Supported: Python") == 1


def test_quickstart_is_two_commands():
    block = re.search(r"## Quickstart\s+(?:[^`]*?)```bash\n(.*?)```", README, flags=re.S).group(1)
    lines = [line for line in block.splitlines() if line.strip()]
    assert len(lines) == 2 and "pytest" in lines[1]


def _table_rows(first_header: str) -> list[list[str]]:
    """The rows of the README table whose header row starts with `| first_header |`."""
    lines = README[README.index(f"| {first_header} |"):].splitlines()
    rows = []
    for line in lines[2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


def _requirement_names(requirements: list[str]) -> set[str]:
    return {re.match(r"[A-Za-z0-9_.-]+", r).group(0).lower().replace("_", "-") for r in requirements}


def test_extras_table_matches_pyproject():
    """Every extra of pyproject.toml has a row, and each row names exactly what the extra brings
    (an extra pulling another extra, `recurrax[docs]`, is named as 'the `docs` extra')."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    rows = {row[0].strip("`"): row[1] for row in _table_rows("extra")}
    assert set(rows) - {"(none)"} == set(extras), "the extras table and pyproject.toml list different extras"
    assert _requirement_names(re.findall(r"`([^`]+)`", rows["(none)"])) == _requirement_names(project["dependencies"])
    for name, requirements in extras.items():
        if name == "all":
            continue
        own = [r for r in requirements if not r.startswith("recurrax[")]
        named = _requirement_names(re.findall(r"`([^`]+)`", rows[name]))
        pulled = {re.search(r"\[(.*)\]", r).group(1) for r in requirements if r.startswith("recurrax[")}
        assert named == _requirement_names(own) | pulled, (name, named)


def test_toolchain_extras_say_the_python_they_need():
    """The compile extras need JAX ≥ 0.12, hence Python ≥ 3.12 (issue 49: pip refuses them on
    Python 3.11, which the library supports): their rows and the compile section say so."""
    import tomllib

    from recurrax.targets._compile import TOOLCHAIN_PYTHON

    needed = f"Python ≥ {'.'.join(map(str, TOOLCHAIN_PYTHON))}"
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    rows = {row[0].strip("`"): row[1] for row in _table_rows("extra")}
    for name in ("compile-cuda", "compile-tpu"):
        assert any(re.fullmatch(r"jax\[[^]]+\]>=0\.12", r) for r in extras[name]), extras[name]
        assert needed in rows[name], (name, rows[name])
    heading = "## Compiling for a GPU or TPU you do not have"
    section = README[README.index(heading):README.index("\n## ", README.index(heading) + 1)]
    assert needed in section and "3.11" in section


def test_g_gamma_shapes_in_the_tables_are_accepted():
    """The Semantics table's g_gamma shapes all run, dense and packed, and nothing else is listed."""
    import jax.numpy as jnp

    import recurrax

    row = next(row for row in _table_rows("argument") if row[0] == "`g_gamma`")
    B, T, H, K, S = 3, 3, 2, 4, 4
    sizes = {"H": H, "B": B, "S": S, "1": 1}
    dense = [tuple(sizes[d.strip()] for d in shape.split(",")) for shape in re.findall(r"`\[([^]]*)\]`", row[1])]
    packed = [tuple(sizes[d.strip()] for d in shape.split(",")) for shape in re.findall(r"`\[([^]]*)\]`", row[2])]
    assert set(dense) == {(H,), (1, H), (B, H)} and set(packed) == {(H,), (1, H), (S, H)}
    x = jnp.ones((B, T, H, K))
    for shape in dense:
        o, _ = recurrax.recurrent(x, x, x, g_gamma=-jnp.full(shape, 0.5))
        assert o.shape == (B, T, H, K)
    for shape in packed:
        _, state = recurrax.recurrent(x[0], x[0], x[0], g_gamma=-jnp.full(shape, 0.5), cu_seqlens=jnp.array([0, 1, 1, 2, T]))
        assert state.shape == (S, H, K, K)


@pytest.mark.parametrize("source", EXAMPLES, ids=[f"example{i}" for i in range(len(EXAMPLES))])
def test_readme_example_runs(source):
    with jax.enable_x64(False):  # as a user runs them: JAX's default precision
        exec(compile(source, "README.md", "exec"), {"__name__": "readme"})


NUMBER_WORDS = dict(zip(("one two three four five six seven eight nine ten eleven twelve thirteen fourteen "
                         "fifteen sixteen").split(), range(1, 17)))


def test_check_quick_counts_are_true():
    """'`recurrax check --quick` runs N of its [M] cases': N is the quick selection's size, and
    a total, if stated, is the number of cases (issue 31: 'twelve' when there were 13)."""
    from recurrax.tools import check

    claim = re.search(r"`recurrax check --quick` runs (\w+) of its (?:(\w+) )?cases", README)
    assert claim, "the README no longer says how many cases `recurrax check --quick` runs"
    assert NUMBER_WORDS[claim.group(1)] == len(check.QUICK)
    if claim.group(2):
        assert NUMBER_WORDS[claim.group(2)] == len(check.CASES)


def test_multi_device_examples_set_up_their_devices_and_fail_loudly():
    """A snippet that builds a mesh sets up 8 devices (simulated on a CPU) with one recipe and
    stops with a message where there are fewer, instead of skipping its body silently."""
    meshes = [source for source in EXAMPLES if "make_mesh(" in source or "Mesh(" in source]
    assert len(meshes) >= 3
    for source in meshes:
        assert 'jax.config.update("jax_num_cpu_devices", 8)' in source and "device_count() < 8" in source
        assert "if jax.device_count() >=" not in source and "if jax.device_count() %" not in source
