"""The architecture holds: every import in the package (lazy ones included) goes to its own
layer or one below (docs/design.md), no module imports itself again through others (imports
inside functions included), and only cgx2/config.py reads the environment."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "cgx2"

# One line a layer, as docs/design.md draws them: the formatter would put a module a line.
LAYERS = {
    "cgx2.checks": 0, "cgx2.config": 0, "cgx2.seeding": 0, "cgx2.launch": 0, "cgx2.extension": 0,
    "cgx2.scratch": 0, "cgx2.cpu_threads": 0,
    "cgx2.codecs": 1,
    "cgx2.comm": 2,
    "cgx2.collectives": 3,
    "cgx2.ops": 4,
    "cgx2.ddp": 5, "cgx2.fsdp": 5, "cgx2.backend": 5, "cgx2.dtensor": 5,
    "cgx2": 6, "cgx2.bench": 6, "cgx2.demo": 6,
}  # fmt: skip
"""Lower layers know nothing of higher ones. Entry points (5) may not import each other."""

CLIS = ("cgx2.bench", "cgx2.demo", "cgx2.launch", "cgx2.testing")
"""What may touch the environment besides config: the command-line tools set it up for the
processes they start (netlab: each host's), and launch fills torch's env:// variables from an
MPI launcher's."""


def _modules() -> dict[str, ast.Module]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = ast.parse(path.read_text(), str(path))
    return found


MODULES = _modules()


def _is_package(name: str) -> bool:
    return (PACKAGE.parent / name.replace(".", "/") / "__init__.py").exists()


def _layer(name: str) -> tuple[str, int]:
    """The layer unit (the longest LAYERS key that is ``name`` or a package of it)."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        unit = ".".join(parts[:n])
        if unit in LAYERS:
            return unit, LAYERS[unit]
    raise AssertionError(f"{name} is in no layer: add it to LAYERS")


def _imports(name: str, tree: ast.Module) -> list[str]:
    """Every cgx2 module ``name`` imports, relative imports resolved."""
    package = name if _is_package(name) else name.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] == "cgx2"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if module.split(".")[0] != "cgx2":
                continue
            for alias in node.names:  # "from . import x" may import a submodule
                sub = f"{module}.{alias.name}"
                found.append(sub if sub in MODULES else module)
    return found


def test_every_module_is_in_a_layer():
    for name in MODULES:
        _layer(name)


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_module_imports_from_a_layer_above_it(name):
    unit, layer = _layer(name)
    for imported in _imports(name, MODULES[name]):
        other, other_layer = _layer(imported)
        assert other_layer <= layer, f"{name} (layer {layer}) imports {imported} ({other_layer})"
        if layer == 5 and other_layer == 5:
            assert other == unit, f"entry point {name} imports another entry point, {imported}"


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles of ``graph`` (module: the modules it imports): its strongly connected
    components of more than one module, each sorted (Tarjan's algorithm, without recursion)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        while work:
            node, edges = work[-1]
            for other in edges:
                if other not in index:
                    index[other] = low[other] = len(index)
                    stack.append(other)
                    work.append((other, iter(sorted(graph.get(other, ())))))
                    break
                if other in stack:
                    low[node] = min(low[node], index[other])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        other = stack.pop()
                        component.append(other)
                        if other == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


KNOWN_CYCLES: list[list[str]] = []
"""Import cycles tolerated for now, each sorted (none: any cycle fails the test)."""


def test_no_import_cycles():
    """No module imports itself again through others, imports inside functions (which run
    later, hiding the cycle from the interpreter at import time) included."""
    graph = {name: set(_imports(name, tree)) - {name} for name, tree in MODULES.items()}
    cycles = [cycle for cycle in _cycles(graph) if cycle not in KNOWN_CYCLES]
    assert not cycles, f"import cycles (each a set of modules importing one another): {cycles}"


def _reads_environment(tree: ast.Module) -> list[int]:
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "environb"):
            if isinstance(node.value, ast.Name) and node.value.id == "os":
                lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.module == "os":
            if any(a.name in ("environ", "getenv") for a in node.names):
                lines.append(node.lineno)
    return lines


@pytest.mark.parametrize("name", sorted(MODULES))
def test_only_config_reads_the_environment(name):
    if name == "cgx2.config" or name.startswith(CLIS):
        return
    assert not _reads_environment(MODULES[name]), (
        f"{name} reads os.environ at lines {_reads_environment(MODULES[name])}: "
        "add the variable to cgx2/config.py"
    )


def test_the_checks_can_fail():
    """A layer violation and an environment read, written here, are caught."""
    bad = ast.parse("from ..ops import quantize\nimport os\nx = os.environ['A']\n")
    assert _imports("cgx2.codecs.fake", bad) == ["cgx2.ops"]
    assert _layer("cgx2.ops")[1] > _layer("cgx2.codecs.fake")[1]
    assert _reads_environment(bad) == [3]


def test_the_cycle_check_can_fail():
    """A cycle through an import inside a function, written here, is found; a chain is not."""
    lazy = ast.parse("def f():\n    from .b import g\n")
    assert _imports("cgx2.collectives.a", lazy) == ["cgx2.collectives.b"]
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"d"}}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []
