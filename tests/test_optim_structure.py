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


DESIGN = Path(__file__).resolve().parent.parent / "docs" / "design.md"


def _defined(path: Path) -> tuple[dict[str, set[str]], set[str]]:
    """The classes of a module with the names their bodies define, and its other top-level names."""
    tree = ast.parse(path.read_text())
    classes: dict[str, set[str]] = {}
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            classes[node.name] = {
                target.id if isinstance(target, ast.Name) else getattr(target, "name", "")
                for item in node.body
                for target in (
                    [item]
                    if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef)
                    else [item.target] if isinstance(item, ast.AnnAssign)
                    else item.targets if isinstance(item, ast.Assign)
                    else []
                )
            }  # fmt: skip
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
    return classes, names


def test_the_design_pages_walk_names_what_the_code_defines() -> None:
    """Every object, method and function docs/design.md's tables name as a stop's owner is
    defined in the files its row names: a renamed or moved stop fails here, not in a reader."""
    import re

    checked, missing = 0, []
    for line in DESIGN.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        if not line.startswith("| ") or len(cells) < 3 or not cells[-1].startswith("`runtime/"):
            continue
        files = [Path(__file__).resolve().parent.parent / f for f in re.findall(r"`([\w/]+\.py)`", cells[-1])]
        found = [_defined(f) for f in files]
        classes = {name: members for c, _ in found for name, members in c.items()}
        names = {n for _, ns in found for n in ns}
        members = {m for ms in classes.values() for m in ms}
        owner = cells[2] if cells[0].isdigit() else cells[0]  # a stop's owner, or the object itself
        for token in re.findall(r"`([A-Za-z_][\w.]*)(?:\(|`)", owner):
            head, _, attr = token.partition(".")
            if attr:
                ok = head in classes and attr in classes[head]
            elif head[0].isupper():
                ok = head in classes or head in names
            else:
                ok = head in names or head in members
            checked += 1
            if not ok:
                missing.append(f"{token} (row: {cells[0]}; files: {', '.join(f.name for f in files)})")
    assert checked >= 30, f"only {checked} names read from {DESIGN}: did the tables change form?"
    assert not missing, "docs/design.md names what its files do not define:\n" + "\n".join(missing)
