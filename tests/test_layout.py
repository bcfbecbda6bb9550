"""The package's layout: folders for the layers, imports that only go down, no cycle.

The import graph is read with ``ast`` from the source (module-level and function-level
imports; ``if TYPE_CHECKING:`` blocks are left out, since they never run). Importing
``a.b.c`` counts as an edge to ``a.b.c`` only, not to the packages Python runs on the way.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Mapping, Optional

PACKAGE = Path(__file__).resolve().parent.parent / "queen_sync"
MAX_TOP_LEVEL_FILES = 15

# Each folder (or foundation module) may import only from ranks below or equal to its own.
# Equal rank is allowed inside one folder; the cycle check keeps those acyclic.
RANKS = {
    "foundation": 0,   # _errors _durations _clock _metrics _ops _results _version
    "_notebook": 0,    # renderers and cell bookkeeping (they read the client registry only)
    "_process": 0,
    "_engines": 2,
    "_handle": 3,
    "_client": 4,
    "_default": 5,
    "_front": 6,
    "testing": 7,
    "face": 8,         # __init__ and __main__
}
FOUNDATION = {"_errors", "_durations", "_clock", "_metrics", "_ops", "_results", "_version"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement that runs (anywhere), skipping ``if TYPE_CHECKING`` bodies."""
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for branch in node.orelse:
                visit(branch)
            return
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def _resolve(importer: str, is_package: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = importer.split(".")
    if not is_package:
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def edges() -> dict[str, set[str]]:
    known = modules()
    graph: dict[str, set[str]] = {name: set() for name in known}
    for name, path in known.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        for node in _imports(tree):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = _resolve(name, path.name == "__init__.py", node)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                           for a in node.names]
            graph[name].update(t for t in targets if t in known and t != name)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> Optional[list[str]]:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> Optional[list[str]]:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt):], nxt]
            if nxt not in state and (cycle := visit(nxt)) is not None:
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)) is not None:
            return cycle
    return None


def layer_of(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1 or parts[1] in ("__main__",):
        return "face"
    top = parts[1]
    return "foundation" if top in FOUNDATION else top


class TestTheImportGraph:
    def test_it_has_no_cycle(self) -> None:
        cycle = find_cycle(edges())
        assert cycle is None, "import cycle: " + " -> ".join(cycle or [])

    def test_imports_only_go_down_the_layers(self) -> None:
        upward = [
            f"{a} ({layer_of(a)}) imports {b} ({layer_of(b)})"
            for a, targets in edges().items() for b in sorted(targets)
            if RANKS[layer_of(b)] > RANKS[layer_of(a)]
        ]
        assert not upward, "\n".join(upward)

    def test_the_walk_sees_function_level_imports_and_skips_type_checking_ones(self) -> None:
        graph = edges()
        assert "queen_sync._engines.sqlite" in graph["queen_sync._engines"], (
            "the engine chooser imports each engine inside a function")
        assert "queen_sync._client" not in graph["queen_sync._handle.lock"], (
            "the lock names the client only for types")

    def test_a_cycle_is_found_when_there_is_one(self) -> None:
        assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
        assert find_cycle({"a": {"b"}, "b": set()}) is None


class TestTheFolders:
    def test_at_most_fifteen_files_sit_directly_in_the_package(self) -> None:
        files = sorted(p.name for p in PACKAGE.iterdir() if p.is_file())
        assert len(files) <= MAX_TOP_LEVEL_FILES, files

    def test_every_module_belongs_to_a_known_layer(self) -> None:
        unknown = sorted(m for m in modules() if layer_of(m) not in RANKS)
        assert not unknown, f"give these a layer in RANKS: {unknown}"


# ---- private members stay in the module that defines them ------------------------------------

# (module, attribute) -> why that module may touch another module's private member.
REACH_IN_ALLOWED: dict[tuple[str, str], str] = {
    ("queen_sync.testing._core", "_token"): (
        "paused() freezes a handle from outside, as a stopped process would be frozen: it "
        "reads the token the handle still believes in, whatever its local deadline"),
    ("queen_sync.testing._core", "_client"): (
        "paused() takes the handle off its client's renewer and puts it back after"),
}


def _is_private(attr: str) -> bool:
    return attr.startswith("_") and not (attr.startswith("__") and attr.endswith("__"))


def defined_names(tree: ast.AST) -> set[str]:
    """What a module defines: functions, classes, names it binds, ``self.x``/``cls.x`` it sets."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
              and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
            names.add(node.attr)
    return names


def reach_ins(trees: Mapping[str, ast.AST]) -> list[tuple[str, int, str]]:
    """``x._name`` (x not ``self``/``cls``) where ``_name`` is defined in another module only.

    Judged by name, not by type: a private name the module defines itself is taken as its
    own. That misses a reach-in whose name collides with one of the module's own members,
    and never flags one that is not there.
    """
    defined = {name: defined_names(tree) for name, tree in trees.items()}
    found = []
    for name, tree in trees.items():
        elsewhere = set().union(*(d for other, d in defined.items() if other != name))
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and _is_private(node.attr)):
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            if node.attr in elsewhere and node.attr not in defined[name]:
                found.append((name, node.lineno, ast.unparse(node)))
    return sorted(found)


def _package_trees() -> dict[str, ast.AST]:
    return {name: ast.parse(path.read_text(encoding="utf-8"), str(path))
            for name, path in modules().items()}


class TestPrivateMembers:
    def test_no_module_reaches_into_another_modules_private_members(self) -> None:
        found = [f"{module}:{line}: {text}" for module, line, text in reach_ins(_package_trees())
                 if (module, text.rsplit(".", 1)[1]) not in REACH_IN_ALLOWED]
        assert not found, ("use the owner's interface (or allow-list it with a reason):\n"
                           + "\n".join(found))

    def test_every_allowed_reach_in_still_happens(self) -> None:
        seen = {(module, text.rsplit(".", 1)[1])
                for module, _, text in reach_ins(_package_trees())}
        stale = sorted(set(REACH_IN_ALLOWED) - seen)
        assert not stale, f"allow-list entries nothing needs any more: {stale}"

    def test_a_reach_in_is_found_and_own_members_are_not(self) -> None:
        trees = {
            "a": ast.parse("class A:\n    def __init__(self):\n        self._x = 1\n"
                           "    def peek(self, other):\n        return other._x\n"),
            "b": ast.parse("def f(a):\n    return a._x, a.__class__, a._unknown\n"),
        }
        assert reach_ins(trees) == [("b", 2, "a._x")], (
            "only b's use of a's private member is a reach-in")
