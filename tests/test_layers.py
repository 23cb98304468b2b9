"""The packages' import graph, read from the source (docs/design.md, "Layers"): no module
imports itself back through others (an import circle), and each layer imports only the
layers below it: ``shardlang`` (the language) nothing of ``planner``, ``runtime`` or ``cli``;
``planner`` nothing of ``runtime``, ``cli`` or ``torch.distributed``; ``runtime`` nothing of
``cli``. Imports inside functions count (they are dependencies all the same); imports under
``if TYPE_CHECKING:`` do not (they never run). ``shardlang/__main__.py`` is the command's door
(``python -m shardlang``) and may import ``cli``.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("shardlang", "planner", "runtime", "cli")
FORBIDDEN = {
    "shardlang": ("planner", "runtime", "cli"),
    "planner": ("runtime", "cli", "torch.distributed"),
    "runtime": ("cli",),
}
DOORS = {"shardlang.__main__"}


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules ``name`` imports (the project's and others'), by full name."""
    tree = ast.parse(path.read_text(), str(path))
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _type_checking(node):
            skip |= {id(n) for child in node.body for n in ast.walk(child)}
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            out.add(base)
            # ``from pkg import module``: the module itself is what is imported
            out |= {f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in modules}
    return out


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: {m for m in _imports(name, path, modules) if m in modules} for name, path in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
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
                found.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circles() -> None:
    graph = _graph()
    # A package's __init__ re-exporting its modules is not a circle of theirs: leave the
    # edges from a package to its own submodules out.
    pruned = {m: {d for d in deps if not d.startswith(m + ".")} for m, deps in graph.items()}
    cycles = _cycles(pruned)
    assert not cycles, "import circles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_each_layer_imports_only_the_layers_below() -> None:
    modules = _modules()
    wrong = []
    for name, path in modules.items():
        layer = name.split(".")[0]
        if name in DOORS:
            continue
        for imported in sorted(_imports(name, path, modules)):
            if any(imported == f or imported.startswith(f + ".") for f in FORBIDDEN.get(layer, ())):
                wrong.append(f"{name} imports {imported}")
    assert not wrong, "\n".join(wrong)


@pytest.mark.slow
def test_every_module_imports_alone() -> None:
    """Each module imported first, before any other module of the project (they are dropped
    from ``sys.modules`` between two; torch stays loaded, which keeps this to seconds): an
    import circle that only some import orders hit fails here."""
    names = sorted(_modules())
    script = (
        "import importlib, sys\n"
        f"names = {names!r}\n"
        "failed = []\n"
        "for name in names:\n"
        "    for loaded in [m for m in sys.modules if m.split('.')[0] in {'shardlang', 'planner', 'runtime', 'cli'}]:\n"
        "        del sys.modules[loaded]\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except Exception as e:\n"
        "        failed.append(f'{name}: {type(e).__name__}: {e}')\n"
        "print('\\n'.join(failed))\n"
        "sys.exit(1 if failed else 0)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr


def test_python_dash_m_shardlang_runs_the_command() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "shardlang", "check", str(REPO / "cli" / "gpt2_small_dp2_tp2.shard")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "gpt2_small_dp2_tp2.shard: ok: 50 tensors" in done.stdout, done.stdout


def test_the_layers_picture_shows_the_import_graph() -> None:
    """docs/design/layers.dot (drawn in docs/design/layers.svg): its edges between the packages
    are the packages' imports (the command's door left out), its boxes inside runtime are
    runtime's subpackages, and the SVG was drawn from it (the same edges)."""
    import re

    dot = (REPO / "docs" / "design" / "layers.dot").read_text()
    drawn = set(re.findall(r"^\s*(\w+) -> (\w+)", dot, re.M))
    graph = _graph()
    imported = {
        (a.split(".")[0], b.split(".")[0])
        for a, bs in graph.items()
        for b in bs
        if a.split(".")[0] != b.split(".")[0] and a not in DOORS
    }
    assert drawn == imported, f"drawn but not imported: {drawn - imported}; imported but not drawn: {imported - drawn}"
    cluster = dot[dot.index("subgraph cluster_runtime") :]
    boxes = set(re.findall(r"^\s*(\w+) \[label=", cluster[: cluster.index("}")], re.M)) - {"runtime"}
    subpackages = {p.parent.name for p in (REPO / "runtime").glob("*/__init__.py")}
    assert boxes == subpackages, (boxes, subpackages)
    svg = (REPO / "docs" / "design" / "layers.svg").read_text()
    edges = set(re.findall(r"<title>(\w+)&#45;&gt;(\w+)</title>", svg))
    assert edges == drawn, "layers.svg is not drawn from layers.dot: dot -Tsvg layers.dot -o layers.svg"
