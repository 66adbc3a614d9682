"""Import layering: dependencies between specrl's parts point one way (README, "Architecture").

``LAYERS`` orders specrl's units top to bottom; a module may import its own unit and units of
lower layers only (never a unit of its own layer or above), and every unit has a layer.

Every module's imports are read with ``ast`` (including imports inside functions and under
``TYPE_CHECKING``: a deferred import is still an arrow). A *unit* is a top-level module or
package of specrl (``specrl/<unit>``); a *CLI module* is ``specrl/cli.py``, ``specrl/cli_*.py``
(its command groups and shared helpers) or ``specrl/<unit>/cli.py``.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import specrl

ROOT = Path(specrl.__file__).parent


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The specrl modules ``name`` imports anywhere in its file."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, *([node.module] if node.module else [])])
            for alias in node.names:  # ``from specrl import cli`` imports the module specrl.cli
                sub = f"{base}.{alias.name}"
                out.add(sub if sub in known else base)
    return {m for m in out if m.split(".")[0] == "specrl"}


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {name: _imports(name, path, set(mods)) for name, path in mods.items()}


def _unit(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def _is_cli(module: str) -> bool:
    parts = module.split(".")
    top_level = len(parts) == 2 and parts[1].startswith("cli_")  # specrl/cli_<group>.py
    return (parts[-1] == "cli" and len(parts) in (2, 3)) or top_level


# Top to bottom: cli -> pipelines -> backends -> engine -> spec -> models/sampling -> config, with
# every other unit placed where its imports put it. The simulator (sim) sits above the engine's
# path, so that nothing on it imports the simulator (``test_the_simulator_stands_apart``); the
# step-cost model it shares with the speculation controller (costmodel) sits below both.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("cli",),
    ("cli_generate", "cli_bench", "cli_export"),
    ("cli_options", "cli_bench_gpu"),
    ("bench_grpo",),
    ("gpubench",),
    ("pipelines", "bench", "sim"),
    ("backends",),
    ("rollout_plan",),
    ("drafters",),
    ("engine", "rl", "envs", "rewards"),
    ("spec",),
    ("cli_util", "rollout_types"),
    ("models", "sampling"),
    ("kernels",),
    ("costmodel",),
    ("config",),
    (
        "config_training",
        "config_task",
        "config_drafter",
        "config_commands",
        "config_bench",
        "config_gpubench",
    ),
    ("registry",),
    ("settings", "paths", "fsutil", "jsonl_prompts", "malloc"),
    ("errors",),
)


def _layer_of(layers: tuple[tuple[str, ...], ...]) -> dict[str, int]:
    return {unit: depth for depth, units in enumerate(layers) for unit in units}


def _against_the_order(
    graph: dict[str, set[str]], layers: tuple[tuple[str, ...], ...]
) -> list[str]:
    """Imports of a unit in the importer's own layer or above it, one line each."""
    depth = _layer_of(layers)
    bad = []
    for module, targets in sorted(graph.items()):
        for target in sorted(targets):
            a, b = _unit(module), _unit(target)
            if a and b and a != b and depth[b] <= depth[a]:
                bad.append(f"{module} -> {target} ({a} is layer {depth[a]}, {b} is {depth[b]})")
    return bad


def test_every_unit_has_a_layer():
    units = {_unit(m) for m in _modules()} - {None}
    placed = _layer_of(LAYERS)
    assert len(placed) == sum(map(len, LAYERS)), "a unit is in two layers"
    assert units <= set(placed), f"units without a layer in LAYERS: {sorted(units - set(placed))}"


def test_imports_point_down_the_layers():
    bad = _against_the_order(_graph(), LAYERS)
    assert not bad, "imports against the layer order:\n" + "\n".join(bad)


def test_the_order_check_flags_upward_and_sideways_imports():
    graph = {
        "specrl.engine.a": {"specrl.backends.b", "specrl.spec.c"},  # up, down
        "specrl.rl.d": {"specrl.envs.e"},  # sideways: the same layer
        "specrl.spec.c": {"specrl.spec.f"},  # its own unit
    }
    layers = (("backends",), ("engine", "rl", "envs"), ("spec",))
    assert _against_the_order(graph, layers) == [
        "specrl.engine.a -> specrl.backends.b (engine is layer 1, backends is 0)",
        "specrl.rl.d -> specrl.envs.e (rl is layer 1, envs is 1)",
    ]


def test_the_simulator_stands_apart():
    """The simulator sits in the top layers, so that the order check refuses an import of it
    anywhere on the engine's path (backends and every layer below: engine, spec, models, ...;
    function-level imports included); the step-cost model it shares with the speculation
    controller (``costmodel``) sits below both. (What the simulator itself loads, the cost model
    and leaves only, no torch: tests/sim/test_sim_scenarios.py.)"""
    depth = _layer_of(LAYERS)
    assert depth["sim"] <= depth["backends"], "sim must sit above the engine's path in LAYERS"
    assert depth["costmodel"] > max(depth["sim"], depth["spec"]), "costmodel must sit below both"


def test_the_speculation_controller_loads_nothing_of_the_simulator():
    """What the import scan cannot see: a fresh interpreter that imports the controller and
    prices a step with it (its base hardware profile read, its cost model fitted) has loaded no
    module of ``specrl.sim`` (``importlib.resources`` on ``specrl.sim`` would import it)."""
    code = (
        "import sys; from specrl.costmodel.fit import Record\n"
        "from specrl.spec.controller import TargetCost\n"
        "from specrl.costmodel.specs import load_model\n"
        "recs = [Record(b, t, 64.0, 0.01 * b * t, 'decode' if t == 1 else 'verify')\n"
        "        for b in (1, 8) for t in (1, 4)]\n"
        "assert TargetCost(load_model('smollm2-135m'), recs).predict(4, 3, 100.0) > 0\n"
        "print(sorted(m for m in sys.modules if m.startswith('specrl.sim')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT.parent, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"the controller loads the simulator: {out.stdout[:300]}"


# The bottom layer: each leaf and the only specrl modules it may import (other leaves below it).
LEAVES = {
    "specrl.settings": {"specrl.errors"},
    "specrl.config_training": {"specrl.settings"},
    "specrl.config_task": {"specrl.settings"},
    "specrl.config_drafter": {"specrl.settings", "specrl.errors"},
    "specrl.config_commands": {"specrl.settings", "specrl.errors"},
    "specrl.config_bench": {"specrl.settings", "specrl.errors"},
    "specrl.config_gpubench": {"specrl.settings", "specrl.errors"},
    "specrl.config": {"specrl.settings", "specrl.config_training", "specrl.config_task"},
    "specrl.paths": set(),
    "specrl.fsutil": set(),
    "specrl.errors": set(),
    "specrl.registry": {"specrl.errors"},
    "specrl.jsonl_prompts": set(),
}


def test_leaf_modules_import_nothing_from_specrl_but_leaves():
    graph = _graph()
    for leaf, allowed in LEAVES.items():
        extra = graph[leaf] - allowed
        assert not extra, f"{leaf} must be a leaf, imports {sorted(extra)}"


def test_no_cycles_between_units():
    arrows: dict[tuple[str, str], list[str]] = {}
    for module, targets in _graph().items():
        for target in targets:
            a, b = _unit(module), _unit(target)
            if a and b and a != b:
                arrows.setdefault((a, b), []).append(f"{module} -> {target}")
    succ: dict[str, set[str]] = {}
    for a, b in arrows:
        succ.setdefault(a, set()).add(b)

    def path(start: str, goal: str) -> list[str] | None:
        todo, came = [start], {start: start}
        while todo:
            node = todo.pop()
            if node == goal:
                out = [goal]
                while out[-1] != start:
                    out.append(came[out[-1]])
                return out[::-1]
            for nxt in succ.get(node, ()):
                if nxt not in came:
                    came[nxt] = node
                    todo.append(nxt)
        return None

    cycles = []
    for (a, b), why in sorted(arrows.items()):
        back = path(b, a)
        if back is not None:
            cycles.append(f"{' -> '.join([a, *back])} (first arrow: {sorted(why)[0]})")
    assert not cycles, "import cycles between specrl units:\n" + "\n".join(cycles)


def test_library_code_never_imports_a_cli_module():
    bad = {
        (module, target)
        for module, targets in _graph().items()
        for target in targets
        if _is_cli(target) and not _is_cli(module)
    }
    assert not bad, f"library modules import CLI modules: {sorted(bad)}"


def test_the_scan_sees_function_level_and_relative_imports(tmp_path):
    src = tmp_path / "specrl" / "pkg" / "mod.py"
    src.parent.mkdir(parents=True)
    src.write_text(
        "def f():\n    from specrl.cli import app\n    from . import sibling\n"
        "    from ..other import thing\n    import specrl.sim.cli\n"
    )
    known = {"specrl.cli", "specrl.pkg.sibling", "specrl.other", "specrl.sim.cli"}
    assert _imports("specrl.pkg.mod", src, known) == known
    assert _is_cli("specrl.cli") and _is_cli("specrl.sim.cli") and not _is_cli("specrl.clix")
    assert _is_cli("specrl.cli_bench") and not _is_cli("specrl.sim.cli_x")


def test_the_reward_library_never_imports_torch():
    """Reward functions run in worker processes that must start light: ``specrl.rewards`` (its
    built-ins run once, math-verify included) imports no torch, in a fresh interpreter."""
    code = (
        "import sys; import specrl.rewards as r; from specrl.rewards import pool\n"
        "assert r.math(['p'], ['Answer: 2'], answer=[2]) == [1.0]\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT.parent, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"specrl.rewards imports torch: {out.stdout[:200]}"
