"""The package's import graph: no cycles, and no import against the layering of docs/design.md.

Every import is read from the source (inside functions too, since a lazy import is still a
dependency), so this needs no process and imports nothing of partrain.
"""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "partrain"

# Each layer may import only from itself and the layers before it. Packages in one layer may not
# import each other. Keep in step with docs/design.md ("Layering").
LAYERS = (
    {"errors"},
    {"staging"},
    {"models"},
    {"config"},
    {"observe"},
    {"data", "parallel"},
    {"checkpoint"},
    {"interop", "plan"},
    {"launch"},
    {"train"},
    {"cli"},
    {"__main__"},
)


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The partrain modules `path` imports, anywhere in it."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            # `from partrain.x import y` imports partrain.x.y when y is a module
            names = [f"{node.module}.{alias.name}" for alias in node.names] + [node.module]
        else:
            continue
        for name in names:
            if name in modules:
                found.add(name)
    return found


def import_graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    modules = set(files)
    # A package's __init__ is imported with any of its modules; edges to a package are only
    # what its __init__ itself imports.
    return {name: _imports(path, modules) - {name} for name, path in files.items()}


def _part(module: str) -> str:
    """The package (or loose module) a module belongs to: partrain.config.keys -> config."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _layer(part: str) -> int:
    for i, layer in enumerate(LAYERS):
        if part in layer:
            return i
    raise AssertionError(f"partrain/{part} is in no layer of LAYERS: place it there and in "
                         "docs/design.md")


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle, as the list of modules around it, or None."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def test_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_every_import_follows_the_layering():
    wrong = []
    for module, imported in sorted(import_graph().items()):
        if module == "partrain":
            continue
        mine = _part(module)
        for other in sorted(imported):
            theirs = _part(other)
            if theirs in (mine, "__init__"):
                continue
            if _layer(theirs) > _layer(mine) or (_layer(theirs) == _layer(mine)):
                wrong.append(f"{module} imports {other} ({mine} may not import {theirs})")
    assert not wrong, "imports against the layering:\n" + "\n".join(wrong)


def test_the_walk_sees_imports_inside_functions():
    """The checks above would pass vacuously if the walk missed lazy imports."""
    graph = import_graph()
    assert "partrain.train.rank" in graph["partrain.train.__main__"]
    assert any(graph[m] for m in graph if m.startswith("partrain.launch."))


@pytest.mark.parametrize("graph, cycle", [
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, ["a", "b", "c", "a"]),
    ({"a": {"b"}, "b": set()}, None),
])
def test_find_cycle(graph, cycle):
    assert find_cycle(graph) == cycle


TORCH_FREE = """
import sys
from partrain.cli import main
sys.argv = ["partrain", *sys.argv[1:]]
try:
    main()
except SystemExit as e:
    assert e.code in (0, None), e.code
assert "torch" not in sys.modules, "torch was imported"
assert "deepspeed" not in sys.modules, "deepspeed was imported"
"""


@pytest.mark.parametrize("args", [
    ["--help"],
    ["plan", "parallel.tp=2", "parallel.pp=2", "parallel.zero_stage=1", "--json"],
    ["plan", "--search", "--gpus", "8", "--json"],
    ["show", "parallel.zero_stage=2", "launcher.device=cpu"],
])
def test_the_planner_and_the_front_door_import_no_torch(args):
    """`partrain --help`, `plan` and `show` stand alone: their formulas import no torch (seconds
    of start-up on a laptop, and a planner that runs where torch is not installed)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", TORCH_FREE, *args], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
