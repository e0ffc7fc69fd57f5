"""The project's import graph, read from the source (every import statement, those inside functions included): no
cycle, no library module that imports a command-line module, and no module that assigns to another module's
attributes when it is imported."""
import ast
from pathlib import Path

from conftest import REPO

COMMAND_LINES = {"generate", "generate_args", "cli"}  # the command line's modules (scripts/ are command lines too)


def project_modules() -> dict[str, Path]:
    """Module name -> file: the repository's top-level modules and scripts/ (as scripts.NAME)."""
    found = {p.stem: p for p in REPO.glob("*.py")}
    found |= {f"scripts.{p.stem}": p for p in (REPO / "scripts").glob("*.py") if p.stem != "__init__"}
    return found


def imports_of(path: Path, modules: dict) -> set[str]:
    """The project modules `path` imports anywhere in its code."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        out |= {n for n in names if n in modules}
    return out


def graph() -> dict[str, set[str]]:
    modules = project_modules()
    return {name: imports_of(path, modules) - {name} for name, path in modules.items()}


def cycle(g: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of g (a list of modules, the first repeated at the end), or None."""
    state, stack = {}, []

    def visit(n):
        state[n] = "open"
        stack.append(n)
        for m in sorted(g.get(n, ())):
            if state.get(m) == "open":
                return stack[stack.index(m):] + [m]
            if m not in state and (found := visit(m)):
                return found
        stack.pop()
        state[n] = "done"
        return None
    for n in sorted(g):
        if n not in state and (found := visit(n)):
            return found
    return None


def test_the_cycle_finder_finds_one():
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_no_import_cycle():
    assert cycle(graph()) is None, " -> ".join(cycle(graph()))


def test_no_library_module_imports_a_command_line_module():
    g = graph()
    library = [m for m in g if m not in COMMAND_LINES and not m.startswith("scripts.")]
    wrong = {m: sorted(n for n in g[m] if n in COMMAND_LINES or n.startswith("scripts.")) for m in library}
    assert not {m: n for m, n in wrong.items() if n}


def test_no_module_assigns_another_modules_attribute_at_import():
    """A module's top-level statements (outside functions and classes) never write `other.attr = ...`."""
    modules = project_modules()
    imported = set(modules) | {"torch", "nn", "F"}
    found = []
    for name, path in modules.items():
        for node in ast.parse(path.read_text()).body:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, ast.AugAssign | ast.AnnAssign) else []
            for t in targets:
                while isinstance(t, ast.Attribute):
                    if isinstance(t.value, ast.Name) and t.value.id in imported:
                        found.append(f"{name}: {ast.unparse(t)}")
                    t = t.value
    assert not found


def reachable(g: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for m in g.get(todo.pop(), ()):
            if m not in seen:
                seen.add(m)
                todo.append(m)
    return seen


def test_the_command_line_frame_does_not_load_the_model_stack():
    """cli.py (every command's frame: one-line errors, logs, torchrun's ranks) reaches no module of the model."""
    assert not reachable(graph(), "cli") & {"model", "engine", "loading", "tp", "policies", "cache", "runtime"}
    assert "ranks" in reachable(graph(), "cli")


def test_library_modules_import_project_modules_at_the_top():
    """No project import hidden inside a library function (the way around a cycle that should not exist)."""
    modules = project_modules()
    found = []
    for name, path in modules.items():
        if name.startswith("scripts.") or name in COMMAND_LINES:
            continue
        for fn in ast.walk(ast.parse(path.read_text())):
            if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                found += [f"{name}.{fn.name}: {ast.unparse(node)}" for node in ast.walk(fn)
                          if isinstance(node, ast.Import | ast.ImportFrom) and imports_of_node(node, modules)]
    assert not found, found


def imports_of_node(node, modules) -> set[str]:
    names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
        [node.module] if node.level == 0 and node.module else [])
    return {n for n in names if n in modules}
