"""The package's shape (DESIGN.md, "Rules of the shape"), checked on the source, not by importing
it.

- no import cycles between the modules of ``mgtutorial/`` (deferred imports inside functions count:
  a cycle hidden in a function is still a cycle);
- no module imports another module's ``_private`` name;
- the engine (``runtime/``) and the shared pieces (``common/``) import no lesson subpackage;
- no module over 300 lines, no line over 100 characters; ``ruff check`` and ``ruff format --check``
  pass on the whole repository (the configuration is in pyproject.toml).
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "mgtutorial"
LESSONS = (
    "ddp",
    "pipeline",
    "scale",
    "article",
    "sharding",
    "tensor_parallel",
    "perf",
    "context_expert",
    "hello",
    "exercises",
    "workshop",
)
ENGINE = ("runtime", "common")
MAX_LINES = 300
MAX_COLUMNS = 100


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _absolute(module: str, node: ast.ImportFrom, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports(module: str) -> list[tuple[str, str, int]]:
    """(imported module, imported name or "", line) for every import in ``module``, deferred ones
    included; ``from pkg import sub`` counts as importing the submodule ``pkg.sub``."""
    path = MODULES[module]
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, "", node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            target = _absolute(module, node, path.name == "__init__.py")
            for a in node.names:
                sub = f"{target}.{a.name}"
                if sub in MODULES:
                    found.append((sub, "", node.lineno))
                else:
                    found.append((target, a.name, node.lineno))
    return [(m, n, line) for m, n, line in found if m.split(".")[0] == "mgtutorial"]


def graph() -> dict[str, set[str]]:
    edges = {}
    for module in MODULES:
        edges[module] = {m for m, _, _ in imports(module) if m in MODULES and m != module}
    return edges


def find_cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component with more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    sys.setrecursionlimit(10_000)
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_the_graph_sees_imports():
    # negative control: the checks below would pass on an empty graph
    edges = graph()
    assert "mgtutorial.runtime.runlog" in edges["mgtutorial.runtime.launcher"]
    assert "mgtutorial.ddp.trainer" in edges["mgtutorial.ddp"]
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycles():
    cycles = find_cycles(graph())
    assert not cycles, "import cycles (split the shared part into its own module):\n" + "\n".join(
        " <-> ".join(c) for c in cycles
    )


def test_no_private_names_imported_across_modules():
    bad = [
        f"{MODULES[m].relative_to(ROOT)}:{line}: {name} from {target}"
        for m in MODULES
        for target, name, line in imports(m)
        if name.startswith("_") and not name.startswith("__") and target != m
    ]
    assert not bad, "private names imported from another module:\n" + "\n".join(bad)


@pytest.mark.parametrize("layer", ENGINE)
def test_engine_imports_no_lesson(layer):
    lessons = tuple(f"mgtutorial.{name}" for name in LESSONS)
    bad = [
        f"{MODULES[m].relative_to(ROOT)}:{line}: imports {target}"
        for m in MODULES
        if m.startswith(f"mgtutorial.{layer}")
        for target, _, line in imports(m)
        if any(target == lesson or target.startswith(lesson + ".") for lesson in lessons)
    ]
    assert not bad, f"{layer}/ must not import a lesson:\n" + "\n".join(bad)


def test_module_sizes():
    long_files = {
        str(p.relative_to(ROOT)): n
        for p in MODULES.values()
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    wide = [
        f"{p.relative_to(ROOT)}:{i}"
        for p in MODULES.values()
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if len(line) > MAX_COLUMNS
    ]
    assert not long_files, f"modules over {MAX_LINES} lines (cut along ideas): {long_files}"
    assert not wide, f"lines over {MAX_COLUMNS} characters: {wide[:20]}"


def _ruff() -> list[str]:
    found = shutil.which("ruff", path=str(Path(sys.executable).parent))
    if found is None:
        pytest.skip("ruff is not installed (pip install -e '.[test]')")
    return [found]


def test_ruff_check():
    out = subprocess.run([*_ruff(), "check", "."], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]


def test_ruff_format():
    out = subprocess.run(
        [*_ruff(), "format", "--check", "."], cwd=ROOT, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
