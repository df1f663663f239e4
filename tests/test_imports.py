"""No module of grpo_cli imports a module that imports it back, directly or through others, at module level or
inside a function: the import graph of src/grpo_cli has no cycle. And no import runs back up a floor: each
module sits on one of the floors of docs/architecture.md (entry points, the run, the step, the ground) and
imports only from its own floor or those below."""

from __future__ import annotations

import ast
from pathlib import Path

import grpo_cli

PACKAGE_DIR = Path(grpo_cli.__file__).resolve().parent


def module_name(file: Path) -> str:
    parts = file.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_names(tree: ast.AST, importer: str, is_package: bool) -> set[str]:
    """Every grpo_cli module an `import` or `from ... import` anywhere in `tree` names (a name imported from a
    package counts as its submodule where one exists; the caller keeps only real modules)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the importer's package
                base = importer.split(".")[: len(importer.split(".")) - node.level + is_package]
                source = ".".join([*base, *([node.module] if node.module else [])])
            else:
                source = node.module or ""
            names.add(source)
            names.update(f"{source}.{alias.name}" for alias in node.names)
    return {n for n in names if n == "grpo_cli" or n.startswith("grpo_cli.")}


def import_graph() -> dict[str, set[str]]:
    files = {module_name(f): f for f in sorted(PACKAGE_DIR.rglob("*.py"))}
    graph = {}
    for importer, file in files.items():
        targets = set()
        for name in imported_names(ast.parse(file.read_text()), importer, file.name == "__init__.py"):
            if name not in files:
                continue
            targets.add(name)
            # importing a.b.c runs the package a.b first, unless the importer is inside a.b (already running)
            parts = name.split(".")
            for i in range(1, len(parts)):
                package = ".".join(parts[:i])
                if not (importer == package or importer.startswith(package + ".")):
                    targets.add(package)
        graph[importer] = targets - {importer}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None."""
    state: dict[str, str] = {}  # "open" while on the current path, "done" after
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        path.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == "open":
                return [*path[path.index(target):], target]
            if target not in state and (cycle := visit(target)):
                return cycle
        path.pop()
        state[node] = "done"
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)):
            return cycle
    return None


def test_the_graph_sees_imports_inside_functions_and_parent_packages():
    graph = import_graph()
    assert "grpo_cli.config" in graph["grpo_cli.cli"]  # at module level
    assert "grpo_cli.report" in graph["grpo_cli.cli"]  # inside a function
    assert "grpo_cli.rollout" in graph["grpo_cli.evaluate"]
    # `from grpo_cli.rewards.parsing import ...` runs the package
    assert "grpo_cli.rewards" in graph["grpo_cli.evaluate"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


# The floors of docs/architecture.md ("The modules and what each owns"), by the name under grpo_cli; a package's
# modules share its floor, and "" is the package's own __init__. A module missing here fails the test below: a
# new module is placed on a floor, and the docs list it there.
ENTRY, RUN, STEP, GROUND = 3, 2, 1, 0
FLOOR_NAMES = {ENTRY: "entry points", RUN: "the run", STEP: "the step", GROUND: "the ground"}
FLOORS = {
    "cli": ENTRY, "train": ENTRY, "export": ENTRY, "report": ENTRY, "api": ENTRY,
    "run": RUN, "rundir": RUN, "checkpoint": RUN, "tracking": RUN, "sweep": RUN, "sweep_summary": RUN,
    "sweep_rerun": RUN, "sweep_stats": RUN, "config": RUN, "monitors": RUN,
    "trainer": STEP, "rollout": STEP, "algorithm": STEP, "dynamic_sampling": STEP, "calculator": STEP,
    "rewards": STEP, "data": STEP, "models": STEP, "adapter_fit": STEP, "precision": STEP, "optim": STEP,
    "evaluate": STEP, "distributed": STEP, "stopping": STEP, "prepack": STEP, "memory": STEP, "sandbox": STEP,
    "code_tasks": STEP,
    "": GROUND, "config_rules": GROUND, "schema": GROUND, "option_table": GROUND, "metrics": GROUND,
    "registry": GROUND, "errors": GROUND, "console": GROUND, "overrides": GROUND, "ranks": GROUND,
    "user_code": GROUND, "allocator": GROUND,
}


def placed_as(module: str) -> str:
    """The name FLOORS knows `module` by: grpo_cli.rollout.hf -> rollout, grpo_cli -> ""."""
    return module.split(".")[1] if "." in module else ""


def test_no_import_runs_back_up_a_floor():
    graph = import_graph()
    unplaced = sorted(m for m in graph if placed_as(m) not in FLOORS)
    assert not unplaced, f"put each on a floor in FLOORS and in docs/architecture.md's module list: {unplaced}"
    assert set(FLOORS) <= {placed_as(m) for m in graph}, "FLOORS names a module that is gone"
    upward = sorted(f"{importer} ({FLOOR_NAMES[FLOORS[placed_as(importer)]]}) -> {target} "
                    f"({FLOOR_NAMES[FLOORS[placed_as(target)]]})"
                    for importer, targets in graph.items() for target in targets
                    if FLOORS[placed_as(target)] > FLOORS[placed_as(importer)])
    assert not upward, "imports that run back up a floor: " + "; ".join(upward)
