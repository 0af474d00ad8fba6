"""Lint and types are part of the test run (CI runs `make test`): ruff over the whole tree
with the rules in pyproject.toml, the formatter over the serving layer and the SDK, and mypy
over the SDK, which ships py.typed."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FORMATTED = ["gateway", "clients"]


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_ruff_finds_nothing():
    done = run("ruff", "check", ".")
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]


def test_serving_layer_and_sdk_are_ruff_formatted():
    done = run("ruff", "format", "--check", *FORMATTED)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]


def test_sdk_type_checks():
    done = run("mypy", "clients/specstream_client")
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]


def specstream_imports() -> dict[str, set[str]]:
    """Each specstream module's imports of other specstream modules: every import statement, at module
    level or inside a function, under TYPE_CHECKING or not. `from package import name` counts as an
    import of the submodule where name is one, else of the package."""
    files = {}
    for path in sorted((ROOT / "specstream").rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        edges = graph.setdefault(module, set())
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                edges.update(alias.name for alias in node.names if alias.name in files)
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "specstream":
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    edges.add(sub if sub in files else node.module)
        edges.discard(module)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of graph, as the modules along it, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        path.append(module)
        for dep in sorted(graph.get(module, ())):
            if state.get(dep) == 1:
                return path[path.index(dep) :] + [dep]
            if dep not in state and (cycle := visit(dep)):
                return cycle
        state[module] = 2
        path.pop()
        return None

    for module in sorted(graph):
        if module not in state and (cycle := visit(module)):
            return cycle
    return None


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_specstream_has_no_import_cycles():
    cycle = find_cycle(specstream_imports())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_packages_are_layered():
    """Between packages too (a top-level module counts as one): no package imports one that imports it
    back, however indirectly, so each package has a place in one order (docs/ARCHITECTURE.md)."""
    graph: dict[str, set[str]] = {}
    for module, deps in specstream_imports().items():
        graph.setdefault(".".join(module.split(".")[:2]), set()).update(".".join(d.split(".")[:2]) for d in deps)
    for package, deps in graph.items():
        deps.discard(package)
    cycle = find_cycle(graph)
    assert cycle is None, "packages import each other: " + " -> ".join(cycle or [])


def test_subpackages_import_nothing_on_their_own():
    """A subpackage's __init__ holds its docstring only, so importing one of its modules never drags in
    its siblings (and no cycle hides in a package's re-exports)."""
    graph = specstream_imports()
    packages = [m for m in graph if m.count(".") == 1 and (ROOT / m.replace(".", "/") / "__init__.py").exists()]
    heavy = [m for m in packages if graph[m]]
    assert len(packages) >= 6 and heavy == []


def test_modules_and_functions_read_in_one_sitting():
    """No module of the engine over 500 lines, no function over 80."""
    long_files, long_functions = [], []
    for path in (ROOT / "specstream").rglob("*.py"):
        text = path.read_text()
        if text.count("\n") > 500:
            long_files.append(f"{path.relative_to(ROOT)} ({text.count(chr(10))} lines)")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > 80:
                long_functions.append(f"{path.relative_to(ROOT)}:{node.name} ({node.end_lineno - node.lineno + 1})")
    assert long_files == [] and long_functions == []


def test_the_gpu_check_script_parses():
    """`make gpu-check` runs only where a GPU is lent; here at least its bash must parse."""
    done = subprocess.run(["bash", "-n", str(ROOT / "scripts" / "gpu_check.sh")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
