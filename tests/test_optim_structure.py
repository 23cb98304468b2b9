"""The sharded optimizers' package as docs/design.md draws it: modules that import each other
without a circle, and ``ShardedOptimizer`` a small facade over them. (That every module is under
600 lines, this package's included, is test_module_length.py's check.)"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import runtime.optim
from runtime.optim import ShardedOptimizer

PACKAGE = Path(runtime.optim.__file__).parent


def _imports(path: Path) -> set[str]:
    """The ``runtime.optim`` modules a module imports, at any depth, but not those imported
    for type checking only (``if TYPE_CHECKING:``)."""
    tree = ast.parse(path.read_text())
    typing_only = {
        id(node)
        for branch in ast.walk(tree)
        if isinstance(branch, ast.If) and ast.unparse(branch.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")
        for statement in branch.body
        for node in ast.walk(statement)
    }
    found = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "runtime.optim":
                found |= {f"runtime.optim.{a.name}" for a in node.names if (PACKAGE / f"{a.name}.py").exists()}
            elif node.module.startswith("runtime.optim."):
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("runtime.optim.")}
    return found


def test_the_optimizer_modules_import_each_other_without_a_circle() -> None:
    graph = {f"runtime.optim.{p.stem}": _imports(p) for p in PACKAGE.glob("*.py") if p.stem != "__init__"}
    done: set[str] = set()

    def visit(module: str, path: tuple[str, ...]) -> None:
        assert module not in path, f"import circle: {' -> '.join((*path[path.index(module) :], module))}"
        if module in done:
            return
        for imported in sorted(graph.get(module, ())):
            visit(imported, (*path, module))
        done.add(module)

    for module in sorted(graph):
        visit(module, ())


def test_the_optimizer_is_a_facade() -> None:
    lines = len(inspect.getsource(ShardedOptimizer).splitlines())
    assert lines <= 350, f"ShardedOptimizer is {lines} lines"
