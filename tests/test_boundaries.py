"""Explicit boundaries between specrl's modules (issue 51), checked on the source with ``ast``.

- No optional-hook probing: ``hasattr`` is not called in ``specrl/engine``, ``specrl/backends`` or
  ``specrl/spec`` (a drafter's optional hooks are no-ops of the ``Proposer`` base class, called
  unconditionally), and nothing there asks ``getattr(<...proposer>, "<name>", default)``.
- No cross-module private access: ``X._name`` (X not ``self``/``cls``/``super()``, ``_name`` not a
  dunder) where ``_name`` is a private name some specrl module defines and the accessing module
  does not, and no ``from specrl.<m> import _name`` from another module. Third-party privates
  (``os._exit``) are not specrl's and are not flagged; ``FOREIGN`` lists the few third-party
  names that a specrl module happens to define too.
- No import cycle between specrl modules, counting imports inside functions and under
  ``TYPE_CHECKING`` (a deferred import is still an arrow; see ``test_layering``).

Each check is a function returning its findings, one line each, so that its tests can run it on
a made-up tree as well as on specrl.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

from tests.test_layering import ROOT, _graph, _module_name, _modules

# The packages where a drafter's hooks are called: no ``hasattr`` at all there.
NO_HASATTR = ("specrl.engine", "specrl.backends", "specrl.spec")
SELF_NAMES = frozenset({"self", "cls"})
# Third-party names with a leading underscore that a specrl module defines as well: their uses
# are the third party's API, not a reach into that module.
FOREIGN = {
    "_version": "torch.Tensor's in-place version counter (backends.vllm has a member so named)",
    "_replace": "namedtuple's copy-with-changes method (backends.ray_ has a method so named)",
}
# Cross-module private imports left to the owners of the importing module (each to be made
# public there, then dropped from here): module -> names.
PENDING: dict[str, set[str]] = {}  # module -> private names it may still import (none)


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), str(path))


def _line(module: str, node: ast.AST, text: str) -> str:
    return f"{module}:{getattr(node, 'lineno', 0)}: {text}"


# --------------------------------------------------------------------------- hasattr


def probing(modules: dict[str, Path]) -> list[str]:
    """``hasattr`` calls in ``NO_HASATTR`` packages, and ``getattr(<...proposer>, "name",
    default)`` anywhere, one line each."""
    bad = []
    for module, path in sorted(modules.items()):
        banned = any(module == p or module.startswith(p + ".") for p in NO_HASATTR)
        for node in sorted(ast.walk(_parse(path)), key=lambda n: getattr(n, "lineno", 0)):
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
                continue
            if node.func.id == "hasattr" and banned:
                bad.append(_line(module, node, ast.unparse(node)))
            elif node.func.id == "getattr" and len(node.args) == 3:
                target = ast.unparse(node.args[0])
                if target.lower().endswith("proposer"):
                    bad.append(_line(module, node, ast.unparse(node)))
    return bad


# --------------------------------------------------------------------------- private names


def _is_self(node: ast.expr) -> bool:
    """``self``, ``cls``, ``super()`` or ``type(self)``: the object's own members."""
    if isinstance(node, ast.Name):
        return node.id in SELF_NAMES
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
        if node.func.id == "super":
            return True
        if node.func.id == "type" and len(node.args) == 1:
            return _is_self(node.args[0])
    return False


def _defined(tree: ast.Module) -> set[str]:
    """Private names a module defines: module-level and class-level functions, classes and
    assignments (``__slots__`` entries included), and ``self._x`` / ``cls._x`` assignments."""
    out: set[str] = set()

    def targets(node: ast.AST) -> Iterator[ast.expr]:
        if isinstance(node, ast.Assign):
            yield from node.targets
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            yield node.target

    def body(nodes: list[ast.stmt]) -> None:
        for node in nodes:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                out.add(node.name)
                if isinstance(node, ast.ClassDef):
                    body(node.body)
            for t in targets(node):
                for name in ast.walk(t):
                    if isinstance(name, ast.Name):
                        out.add(name.id)
                if isinstance(t, ast.Name) and t.id == "__slots__":
                    out.update(c.value for c in ast.walk(node) if isinstance(c, ast.Constant)
                               and isinstance(c.value, str))  # fmt: skip
            if isinstance(node, (ast.If, ast.Try)):  # e.g. ``if TYPE_CHECKING:`` blocks
                body([*node.body, *getattr(node, "orelse", [])])

    body(tree.body)
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.ctx, ast.Store)
            and _is_self(node.value)
        ):
            out.add(node.attr)
    return {n for n in out if _private(n)}


def private_access(
    modules: dict[str, Path], pending: dict[str, set[str]] | None = None
) -> list[str]:
    """Reads and writes of another specrl module's private names, one line each (``pending``:
    module -> private names it may still import)."""
    pending = pending or {}
    trees = {module: _parse(path) for module, path in modules.items()}
    defined = {module: _defined(tree) for module, tree in trees.items()}
    owners: dict[str, set[str]] = {}
    for module, names in defined.items():
        for name in names:
            owners.setdefault(name, set()).add(module)
    bad = []
    for module, tree in sorted(trees.items()):
        path = modules[module]
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _private(node.attr):
                if _is_self(node.value) or node.attr not in owners or node.attr in FOREIGN:
                    continue
                if module not in owners[node.attr]:
                    where = ", ".join(sorted(owners[node.attr]))
                    bad.append(_line(module, node, f"{ast.unparse(node)} ({where})"))
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, *([node.module] if node.module else [])])
                if base.split(".")[0] != "specrl" or base == module:
                    continue
                for alias in node.names:
                    if _private(alias.name) and alias.name not in pending.get(module, ()):
                        bad.append(_line(module, node, f"from {base} import {alias.name}"))
    return bad


# --------------------------------------------------------------------------- import cycles


def cycles(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle per strongly connected group of modules (``a -> b -> a``), one line
    each (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    group = []
                    while True:
                        top = stack.pop()
                        on_stack.discard(top)
                        group.append(top)
                        if top == node:
                            break
                    if len(group) > 1 or node in graph.get(node, ()):
                        groups.append(sorted(group))
            elif child not in index:
                index[child] = low[child] = counter
                counter += 1
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph.get(child, ())))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return [" -> ".join(_cycle_through(graph, group)) for group in sorted(groups)]


def _cycle_through(graph: dict[str, set[str]], group: list[str]) -> list[str]:
    """A shortest cycle from ``group[0]`` back to itself inside ``group`` (breadth first)."""
    start, members = group[0], set(group)
    came: dict[str, str] = {}
    todo = [start]
    while todo:
        nxt = []
        for node in todo:
            for child in sorted(graph.get(node, ())):
                if child not in members:
                    continue
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(came[path[-1]])
                    return [start, *path[::-1][1:], start]
                if child not in came:
                    came[child] = node
                    nxt.append(child)
        todo = nxt
    return [start, start]


# --------------------------------------------------------------------------- the checks


def test_no_hasattr_probing_of_drafters():
    bad = probing(_modules())
    assert not bad, "optional hooks probed (give them a no-op default instead):\n" + "\n".join(bad)


def test_no_module_reaches_into_another_modules_private_names():
    bad = private_access(_modules(), PENDING)
    assert not bad, "private names of another module used:\n" + "\n".join(bad)


def test_no_import_cycles_between_modules():
    found = cycles(_graph())
    assert not found, "import cycles between specrl modules:\n" + "\n".join(found)


# --------------------------------------------------------------------------- the checks' own tests


def _tree(tmp_path: Path, files: dict[str, str]) -> dict[str, Path]:
    """Write ``files`` (path under specrl/ -> source) and map their module names to paths."""
    out = {}
    for rel, text in files.items():
        path = tmp_path / "specrl" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        parts = list(path.relative_to(tmp_path).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def test_the_probing_check_flags_hasattr_and_defaulted_getattr(tmp_path):
    modules = _tree(tmp_path, {
        "engine/a.py": "def f(p):\n    return hasattr(p, 'bind')\n",
        "backends/b.py": "def g(self):\n    return getattr(self.proposer, 'head', None)\n",
        "pipelines/c.py": "def h(x):\n    return hasattr(x, 'save') or getattr(x, 'y', 1)\n",
    })  # fmt: skip
    assert probing(modules) == [
        "specrl.backends.b:2: getattr(self.proposer, 'head', None)",
        "specrl.engine.a:2: hasattr(p, 'bind')",
    ]


def test_the_private_check_flags_other_modules_names_only(tmp_path):
    modules = _tree(tmp_path, {
        "a.py": "class A:\n    _slot = 1\n    def __init__(self):\n        self._cache = None\n"
                "    def same(self, other):\n        return other._cache\n"
                "def _helper():\n    pass\n",
        "b.py": "import os\nfrom specrl.a import _helper\n"
                "def f(engine, w):\n    engine._cache = None\n    os._exit(0)\n"
                "    return w._version, engine.__dict__, super()._slot\n",
    })  # fmt: skip
    assert private_access(modules) == [
        "specrl.b:2: from specrl.a import _helper",
        "specrl.b:4: engine._cache (specrl.a)",
    ]
    assert _module_name(ROOT / "engine" / "__init__.py") == "specrl.engine"


def test_the_cycle_check_names_every_cycle():
    graph = {
        "specrl.a": {"specrl.b"},
        "specrl.b": {"specrl.c", "specrl.d"},
        "specrl.c": {"specrl.a"},
        "specrl.d": set(),
        "specrl.e": {"specrl.e"},
        "specrl.f": {"specrl.g"},
        "specrl.g": {"specrl.f"},
    }
    assert cycles(graph) == [
        "specrl.a -> specrl.b -> specrl.c -> specrl.a",
        "specrl.e -> specrl.e",
        "specrl.f -> specrl.g -> specrl.f",
    ]
