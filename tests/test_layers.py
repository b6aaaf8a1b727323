"""The package's layers (docs/architecture.md): every import of every module of cod_fast, its
Triton kernels (cod_fast.kernels) and its benchmarks (cod_fast.bench), inside functions and
under TYPE_CHECKING too, goes to its own folder or a lower layer, and no imports form a cycle.

The layer order is read from the table in docs/architecture.md, so the drawing and this test
cannot drift apart. A string that names a module (`"cod_fast.envs.frozenlake:FrozenLake"` in the
environment registry, `"cod_fast.kernels.rows"` in the kernel dispatch) is an import too: it is
imported by name at run time; one that names a program (a module run with `python -m`, such as
the CLI a benchmark starts in its own process) is a command line, not an import.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SOURCES = {"cod_fast": ROOT / "cod_fast", "cod_fast.kernels": ROOT / "kernels"}
SOURCES["cod_fast.bench"] = ROOT / "bench"
EXTENSION = "cod_fast._cpp"
"""The compiled C++ kernels (csrc/), a module without source here: the ops layer's."""
MODULE_NAME = re.compile(r"cod_fast(?:\.\w+)+(?::\w+)?")


def layer_order() -> list[str]:
    """The layers, bottom first: the first column of docs/architecture.md's layer table (rows
    `| 0 | common/ | ... |`), one folder (or `cod_fast/__init__.py`) per row."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    rows = re.findall(r"^\| (\d+) \| `([\w./_]+)`", text, re.MULTILINE)
    assert rows, "docs/architecture.md has no layer table"
    assert [int(n) for n, _ in rows] == list(range(len(rows))), "layers numbered 0, 1, 2, ..."
    return [name.removesuffix("/") for _, name in rows]


def modules() -> dict[str, Path]:
    """Every module of the distribution by its installed name."""
    found = {}
    for package, folder in SOURCES.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([package, *parts])] = path
    return found


def imports(
    name: str, path: Path, known: set[str], programs: frozenset[str] = frozenset()
) -> set[str]:
    """The modules of `known` that module `name` (at `path`) imports, wherever in the file; a
    string naming one of `programs` is a command line, not an import."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([node.module] if node.module else []))
            # `from package import module` imports the module; `from module import name` the module
            targets += [
                f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names
            ]
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and MODULE_NAME.fullmatch(node.value)
            and node.value not in programs
        ):
            targets.append(node.value.partition(":")[0])
    found = set()
    for target in targets:
        while target and target not in known:
            target = target.rpartition(".")[0]
        if target and target != name:
            found.add(target)
    return found


def graph() -> dict[str, set[str]]:
    found = modules()
    known = set(found) | {EXTENSION}
    programs = frozenset(name for name, path in found.items() if _runs_as_program(path))
    edges = {name: imports(name, path, known, programs) for name, path in found.items()}
    edges[EXTENSION] = set()
    return edges


def _runs_as_program(path: Path) -> bool:
    """Whether `python -m` runs the module: it has a main block, or it is a package with a
    __main__.py."""
    if path.name == "__init__.py":
        return (path.parent / "__main__.py").is_file()
    return 'if __name__ == "__main__"' in path.read_text()


def layer_of(module: str, order: list[str]) -> int:
    """The layer of a module: its folder's (the kernels and the C++ extension are the ops
    layer's; the package's own __init__ is a row of the table)."""
    if module == "cod_fast":
        return order.index("cod_fast/__init__.py")
    folder = module.split(".")[1]
    folder = "ops" if folder in ("kernels", "_cpp") else folder
    if folder not in order:
        raise AssertionError(f"{module}: folder {folder}/ is not in docs/architecture.md's layers")
    return order.index(folder)


def upward(edges: dict[str, set[str]], order: list[str]) -> list[str]:
    """Every import of a higher layer, as 'importer -> imported'."""
    return sorted(
        f"{m} -> {t}"
        for m, targets in edges.items()
        for t in targets
        if layer_of(t, order) > layer_of(m, order)
    )


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_import_goes_up_a_layer():
    """0 upward imports: each module imports its own folder or lower layers only."""
    order = layer_order()
    edges = graph()
    assert len(edges) > 100  # the whole package was read
    assert upward(edges, order) == []


def test_no_import_cycles():
    """0 cycles among the modules, counting imports inside functions."""
    assert cycles(graph()) == []


def test_every_folder_has_a_layer_and_a_readme():
    """A new folder must take its place in the drawing, and say in a few lines what it holds."""
    order = layer_order()
    folders = {p.parent for p in (ROOT / "cod_fast").glob("*/__init__.py")}
    for folder in folders:
        assert folder.name in order, f"{folder.name}/ is not in docs/architecture.md's layers"
        assert (folder / "README.md").is_file(), f"cod_fast/{folder.name}/ has no README.md"
    flat = sorted(p.name for p in (ROOT / "cod_fast").glob("*.py") if p.name != "__init__.py")
    assert flat == [], f"modules outside the folders: {flat}"


def test_the_tests_mirror_the_folders():
    """Each folder of tests/ is a folder of the package (or bench/), so a module's tests are
    found where the module is."""
    order = layer_order()
    test_folders = {p.parent.name for p in (ROOT / "tests").glob("*/__init__.py")}
    assert test_folders, "tests/ has no folders"
    assert sorted(test_folders - set(order)) == []


@pytest.mark.parametrize(
    ("edges", "want_up", "want_cycles"),
    [
        ({"cod_fast.config.a": {"cod_fast.train.b"}, "cod_fast.train.b": set()}, 1, 0),
        ({"cod_fast.train.a": {"cod_fast.config.b"}, "cod_fast.config.b": set()}, 0, 0),
        (
            {"cod_fast.ops.a": {"cod_fast.ops.b"}, "cod_fast.ops.b": {"cod_fast.ops.c"}}
            | {"cod_fast.ops.c": {"cod_fast.ops.a"}},
            0,
            1,
        ),
    ],
)
def test_the_checks_find_what_they_look_for(edges, want_up, want_cycles):
    """The checks themselves: an upward import and a three-module cycle are reported."""
    order = layer_order()
    assert len(upward(edges, order)) == want_up
    assert len(cycles(edges)) == want_cycles


def test_an_import_inside_a_function_and_a_module_string_count(tmp_path):
    """Imports in a function body, relative imports and module-name strings are all edges; a
    program's name (a command line) is not."""
    source = tmp_path / "m.py"
    source.write_text(
        "def f():\n    from cod_fast.train import trainer\n"
        "from ..run import log\n"
        "KERNELS = {'triton': 'cod_fast.kernels.rows'}\n"
        "COMMAND = ['python', '-m', 'cod_fast.cli.app', 'train']\n"
    )
    known = {"cod_fast.train.trainer", "cod_fast.run.log", "cod_fast.kernels.rows", "cod_fast.run"}
    known.add("cod_fast.cli.app")
    found = imports("cod_fast.eval.m", source, known, frozenset({"cod_fast.cli.app"}))
    assert found == {"cod_fast.train.trainer", "cod_fast.run.log", "cod_fast.kernels.rows"}
