"""The package stays navigable: no import cycle, no module too long to read, and the default
send path borrows nothing from the batch-run op's module.

Read from the source with ``ast``: every import counts, module-level, inside a function or
under ``TYPE_CHECKING`` (a cycle hidden in a function still ties the two modules together).
"""

import ast
from collections.abc import Iterator
from pathlib import Path

from tests.paths import ROOT

PACKAGE = ROOT / "email_platform"
MAX_LINES = 600


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _imported_names(module: str, path: Path) -> Iterator[str]:
    """Every dotted name ``module`` imports; ``from a import b`` gives ``a.b`` when ``b`` is a
    module and ``a`` when it is a name defined in ``a``."""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                source = ".".join([*base, *([node.module] if node.module else [])])
            else:
                source = node.module or ""
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                yield submodule if submodule in MODULES else source


def _owner(name: str) -> str | None:
    """The email_platform module that defines ``name`` (``a.b.C`` -> ``a.b``)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def import_graph() -> dict[str, set[str]]:
    """Module -> the email_platform modules it imports. Importing ``a.b`` also runs ``a``'s
    ``__init__``, as every submodule import does: that implied edge is left out."""
    graph: dict[str, set[str]] = {}
    for module, path in MODULES.items():
        targets = {_owner(name) for name in _imported_names(module, path)}
        graph[module] = {t for t in targets if t is not None and t != module}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm,
    iterative: the graph has hundreds of modules)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
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
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
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


def test_the_graph_finds_imports_of_every_kind() -> None:
    """The reader itself: module-level, function-level, ``from package import module`` and a
    name from a package's ``__init__`` all make edges."""
    graph = import_graph()
    assert (
        "email_platform.publishing.publisher" in graph["email_platform"]
    )  # from x.publisher import f
    assert (
        "email_platform.publishing.guards" in graph["email_platform.publishing.publisher"]
    )  # from x import guards
    assert "email_platform.resources" in graph["email_platform.ops.send"]  # a name in __init__
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_module_of_the_package_imports_itself_back() -> None:
    """A cycle makes import order matter and hides which module owns what; two modules that
    need each other share something a third should own."""
    graph = import_graph()
    found = cycles(graph)
    described = [
        {module: sorted(graph[module] & set(component)) for module in component}
        for component in found
    ]
    assert described == []


def test_the_lane_worker_borrows_nothing_from_the_batch_op() -> None:
    """The default path (lane workers) and the batch runs share ``ops/send_step``; neither op
    module imports the other."""
    graph = import_graph()
    assert "email_platform.ops.send" not in graph["email_platform.ops.lane_worker"]
    assert "email_platform.ops.lane_worker" not in graph["email_platform.ops.send"]


def test_no_module_is_longer_than_a_reader_can_hold() -> None:
    lengths = {module: len(path.read_text().splitlines()) for module, path in MODULES.items()}
    assert {module: n for module, n in lengths.items() if n > MAX_LINES} == {}
