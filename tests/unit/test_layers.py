"""The package's shape: the layers of docs/architecture.md, read from the source.

Three rules of shape, checked on the files themselves (no import runs):

* the root package holds only ``__init__.py``, ``__main__.py``, the layer folders and
  the deprecated paths of moved modules (``placement.py`` and the like), each of which
  imports nothing but its new module;
* no import circle between files, counting imports inside functions (a lazy import
  hides a circle from Python, not from a reader) and under ``if TYPE_CHECKING:`` (they
  never run, but a file naming another's types depends on it as much);
* nothing outside a package imports its private names: a dotted path whose segment
  starts with ``_`` belongs to the package before that segment, and only files inside
  that package may name it. Tests and benchmarks follow the same rule.

And one rule of size, for every file of the package: no file over 700 lines, no function
body (its docstring aside) over 100.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "raggedfsdp"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, dotted name) of every ``raggedfsdp`` name the file imports, at any depth,
    those under ``if TYPE_CHECKING:`` included."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found += [(node.lineno, f"{node.module}.{a.name}") for a in node.names if a.name != "*"]
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            found.append((node.lineno, node.args[0].value))
    return [(line, name) for line, name in found if name.split(".")[0] == "raggedfsdp"]


MODULES = {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _target(name: str) -> str:
    """The file a dotted import lands in: the longest module prefix of ``name``."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in MODULES:
            return candidate
    raise AssertionError(f"{name} names no module of the package")


# The old path of each moved module that still imports (for one release) -> its new module.
MOVED = {
    "raggedfsdp.dbuffer": "raggedfsdp.fsdp.dbuffer",
    "raggedfsdp.placement": "raggedfsdp.tensor.placement",
    "raggedfsdp.profiling": "raggedfsdp.tools.profiling",
    "raggedfsdp.simulate": "raggedfsdp.tools.simulate",
}


def test_root_holds_only_entry_points_layer_folders_and_moved_paths():
    files = sorted(p.name for p in PACKAGE.iterdir() if p.is_file() and p.suffix == ".py")
    moved = [f"{old.rpartition('.')[2]}.py" for old in MOVED]
    assert files == sorted(["__init__.py", "__main__.py", *moved])
    for old, new in MOVED.items():
        path = PACKAGE / f"{old.rpartition('.')[2]}.py"
        text = path.read_text()
        assert _imports(path) == [] and f'NEW = "{new}"' in text, path.name
        assert "sys.modules[__name__] = importlib.import_module(NEW)" in text, path.name


def test_no_import_circle_between_files():
    graph = {
        mod: {_target(name) for _, name in _imports(path)} - {mod} for mod, path in MODULES.items()
    }
    # Tarjan's strongly connected components: any component of two or more is a circle.
    index, low, stack, on_stack, circles = {}, {}, [], set(), []

    def visit(v):
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
                circles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert circles == []


_PRIVATE = re.compile(r"^_[^_]")


def _violations(path: Path) -> list[str]:
    here = _module_name(path) if path.is_relative_to(PACKAGE) else ""
    here_package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    bad = []
    for line, name in _imports(path):
        parts = name.split(".")
        for i, part in enumerate(parts):
            if _PRIVATE.match(part):
                owner = ".".join(parts[:i])
                if owner in MODULES and MODULES[owner].name != "__init__.py":
                    owner = owner.rpartition(".")[0]  # a module's private name: its package's
                if not (here_package == owner or here_package.startswith(owner + ".")):
                    bad.append(f"{path.relative_to(ROOT)}:{line}: {name}")
                break
    return bad


def test_nothing_imports_another_packages_private_names():
    files = [
        *PACKAGE.rglob("*.py"),
        *(ROOT / "tests").rglob("*.py"),
        *(ROOT / "benchmarks").rglob("*.py"),
    ]
    bad = [v for path in sorted(files) for v in _violations(path)]
    assert bad == []


MAX_FILE_LINES = 700
MAX_BODY_LINES = 100


def _long_bodies(path: Path) -> list[str]:
    """Functions of ``path`` whose body (docstring excluded) spans over MAX_BODY_LINES."""
    long = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        body = node.body
        if ast.get_docstring(node) is not None:
            body = body[1:]
        if body and body[-1].end_lineno - body[0].lineno + 1 > MAX_BODY_LINES:
            long.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.name}")
    return long


def test_files_and_functions_stay_readable():
    files = sorted(PACKAGE.rglob("*.py"))
    too_long = [
        f"{p.relative_to(ROOT)}: {n} lines"
        for p in files
        if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES
    ]
    assert too_long == []
    assert [f for p in files for f in _long_bodies(p)] == []
