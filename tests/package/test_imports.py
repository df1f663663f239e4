"""No module of grpo_cli imports a module that imports it back, directly or through others, at module level or
inside a function: the import graph of src/grpo_cli has no cycle. And no import runs back up a floor: the floors
are the packages of src/grpo_cli/, each of which says in its docstring what it may import."""

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
            if name not in files or importer.startswith(name + "."):  # its own package: already running
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
    assert "grpo_cli.config.compose" in graph["grpo_cli.commands.cli"]  # at module level
    assert "grpo_cli.commands.report" in graph["grpo_cli.commands.cli"]  # inside a function
    assert "grpo_cli.rollout" in graph["grpo_cli.step.evaluate"]
    # `from grpo_cli.rewards.parsing import ...` runs the package
    assert "grpo_cli.rewards" in graph["grpo_cli.step.evaluate"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


# The floors are the folders: each package of src/grpo_cli/ says in its docstring which packages it may import
# ("May import: a, b, c."), and it may import only those and itself. A module at the top of src/grpo_cli/ is the
# package's own __init__ (imports none of grpo_cli's) or an alias of a few lines that keeps a name users type.
ALIAS_MAX_LINES = 5


def packages() -> dict[str, set[str]]:
    """Each package of src/grpo_cli/ and the packages its docstring says it may import."""
    allowed = {}
    for init in sorted(PACKAGE_DIR.glob("*/__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        lines = [line for line in " ".join(doc.split()).split(". ") if line.startswith("May import:")]
        assert lines, f"{init.relative_to(PACKAGE_DIR)}: its docstring says nothing of the form 'May import: a, b.'"
        names = lines[0].removeprefix("May import:").split("(")[0].strip().rstrip(".")  # (a note) ends the list
        allowed[init.parent.name] = set() if names.startswith("nothing") else {
            n.strip().split()[0].rstrip(",") for n in names.split(",") if n.strip()}
    return allowed


def package_of(module: str) -> str:
    """grpo_cli.rollout.hf -> rollout; a module at the top (grpo_cli, grpo_cli.train) -> ""."""
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (PACKAGE_DIR / parts[-1]).is_dir() else ""


def test_every_folder_of_code_is_a_package_with_its_floor():
    folders = {f.parent.name for f in PACKAGE_DIR.glob("*/*.py")}
    allowed = packages()
    assert folders == set(allowed), f"folders of code without an __init__.py: {folders - set(allowed)}"
    unknown = {p: names - set(allowed) for p, names in allowed.items() if names - set(allowed)}
    assert not unknown, f"'May import:' names what is not a package: {unknown}"
    cycle = find_cycle(allowed)
    assert cycle is None, "the packages' 'May import:' lines go round: " + " -> ".join(cycle)


def test_the_top_holds_packages_and_short_aliases_only():
    for file in PACKAGE_DIR.glob("*.py"):
        if file.name == "__init__.py":
            assert not imported_names(ast.parse(file.read_text()), "grpo_cli", True), "grpo_cli/__init__.py imports"
            continue
        lines = [line for line in file.read_text().splitlines() if line.strip()]
        assert len(lines) <= ALIAS_MAX_LINES + 2, f"{file.name}: a module at the top is an alias of a few lines"


def test_no_import_runs_back_up_a_floor():
    allowed = packages()
    upward = sorted(f"{importer} -> {target}" for importer, targets in import_graph().items()
                    for target in targets
                    if package_of(importer) and target != "grpo_cli" and package_of(target) != package_of(importer)
                    and package_of(target) not in allowed[package_of(importer)])
    assert not upward, "imports its package's docstring does not allow ('May import:'): " + "; ".join(upward)
