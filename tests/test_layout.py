"""The package's layout: no import circles among recurrax's modules (issue 48: below sits the
shared core, above it the operations, then the models and tools; nothing imports upwards).

An import is an edge from the importing module to each recurrax module it names (`from . import
x` names the submodule x, not the package); a module's own parent packages are not edges (a
submodule runs inside its package's import). Imports under `if TYPE_CHECKING:` count too: a
circle of annotations is still a circle of design.
"""

from __future__ import annotations

import ast
from pathlib import Path

import recurrax

PACKAGE = Path(recurrax.__file__).parent


def modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = ("recurrax", *path.relative_to(PACKAGE).with_suffix("").parts)
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imported(name: str, path: Path, known: dict) -> set[str]:
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    edges = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else [])) if node.level else node.module or ""
            submodules = {f"{target}.{alias.name}" for alias in node.names} & known.keys()
            edges |= submodules or {target}
        elif isinstance(node, ast.Import):
            edges |= {alias.name for alias in node.names}
    return {e for e in edges if e in known and e != name and not name.startswith(e + ".")}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_circle_finder_finds_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_no_import_circles_in_the_package():
    known = modules()
    graph = {name: imported(name, path, known) for name, path in known.items()}
    assert len(graph) > 100 and graph["recurrax.parallel"]  # the scan saw the package
    found = circles(graph)
    assert not found, "import circles: " + "; ".join(
        " ⇄ ".join(f"{m} → {sorted(graph[m] & set(c))}" for m in c) for c in found)


FLOORS = (
    ("recurrax._core",),
    ("recurrax.kernels",),
    ("recurrax.recurrence", "recurrax.delta"),
)
"""The package's floors, bottom up: what both operations share, the kernels, the operations.
Above them sit the public modules, the models (`nn`), `targets` and the tools."""


def floor_of(module: str) -> int:
    """The floor of a module (len(FLOORS) for everything above the operations)."""
    for level, packages in enumerate(FLOORS):
        if any(module == p or module.startswith(p + ".") for p in packages):
            return level
    return len(FLOORS)


def test_the_floor_finder():
    assert floor_of("recurrax._core.finite") == 0 and floor_of("recurrax.kernels.tpu._recurrent_forward") == 1
    assert floor_of("recurrax.delta._api") == floor_of("recurrax.recurrence._chunk._algorithm") == 2
    assert floor_of("recurrax.parallel") == floor_of("recurrax.nn._mixers") == 3


def test_nothing_imports_a_floor_above_its_own():
    """The core imports neither the kernels nor an operation; the kernels import no operation
    (each operation's rule for non-finite inputs, which the kernels' drivers apply, is in the
    core); the operations import neither each other's modules above the core nor the models."""
    known = modules()
    upward = sorted(f"{name} → {target}" for name, path in known.items() for target in imported(name, path, known)
                    if floor_of(target) > floor_of(name))
    assert not upward, "imports of a floor above: " + "; ".join(upward)
