"""The import graph of services/, shared/ and console/ keeps the shape the code is built to.

Every import statement counts, wherever it is: at the top, inside a function, under
`if TYPE_CHECKING:`. A type-only import is still a dependency a reader has to follow, and
a circle of them is a circle all the same. The rules:

- no import cycle anywhere in the tree;
- shared/ is the bottom layer: it never imports services/ or console/;
- no serving process (services/{gateway,conductor,kvmanager,prefill,decode,worker}) imports
  a tool (services/tools/: bench, sim, chaos);
- tools import services only through public names: no `_private` name and no `_private`
  module of another package.

The graph is read with `ast`, without importing anything, so it runs in a second.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("services", "shared", "console")
SERVING = tuple(
    f"services.{name}" for name in ("gateway", "conductor", "kvmanager", "prefill", "decode")
) + ("services.worker",)
TOOLS = "services.tools"


@dataclass(frozen=True)
class Edge:
    """One import: `source` imports `target` (a module of the tree) at `line`; `names` are
    what a `from target import ...` took from it that are not modules themselves."""

    source: str
    target: str
    line: int
    names: tuple[str, ...] = ()


@dataclass
class Graph:
    modules: dict[str, Path] = field(default_factory=dict)
    edges: list[Edge] = field(default_factory=list)
    trees: dict[str, ast.Module] = field(default_factory=dict)

    def targets(self) -> dict[str, set[str]]:
        out: dict[str, set[str]] = {m: set() for m in self.modules}
        for e in self.edges:
            out[e.source].add(e.target)
        return out


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def in_tree(name: str, modules: dict[str, Path]) -> str | None:
    """The deepest module of the tree that `name` is or lies in (None: outside the tree)."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in modules:
            return candidate
        parts.pop()
    return None


def resolve_from(node: ast.ImportFrom, module: str, package: bool) -> str:
    """The absolute module a `from X import ...` names (relative levels resolved)."""
    if not node.level:
        return node.module or ""
    base = module.split(".") if package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(module: str, tree: ast.Module, package: bool, modules: dict[str, Path]):
    """Every edge from `module` into the tree, one per imported module."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = in_tree(alias.name, modules)
                if target:
                    yield Edge(module, target, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            base = resolve_from(node, module, package)
            names: list[str] = []
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if sub in modules:  # `from pkg import module`: an edge to that module
                    yield Edge(module, sub, node.lineno)
                else:
                    names.append(alias.name)
            target = in_tree(base, modules)
            if names and target:
                yield Edge(module, target, node.lineno, tuple(names))


def read_graph(root: Path = ROOT, packages: tuple[str, ...] = PACKAGES) -> Graph:
    graph = Graph()
    paths = sorted(p for pkg in packages for p in (root / pkg).rglob("*.py"))
    graph.modules = {module_name(p, root): p for p in paths}
    for name, path in graph.modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        graph.trees[name] = tree
        edges = imports_of(name, tree, is_package(path), graph.modules)
        graph.edges += [e for e in edges if e.target != name]
    return graph


# -- the checks, pure over a graph -------------------------------------------------------


def cycles(targets: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module, each sorted (Tarjan's
    algorithm, iterative): every module in one reaches every other, so each is a circle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    counter = 0
    for start in sorted(targets):
        if start in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(start, iter(sorted(targets[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(targets.get(child, ())))))
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
                    components.append(sorted(component))
    return sorted(components)


def one_cycle(component: list[str], targets: dict[str, set[str]]) -> list[str]:
    """A shortest path from the component's first module back to itself (breadth first)."""
    members = set(component)
    start = component[0]
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(targets[node] & members):
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return [*reversed(path), start]
                if child not in previous:
                    previous[child] = node
                    following.append(child)
        frontier = following
    raise AssertionError(f"no cycle through {start}")  # a component always has one


def layer_breaches(graph: Graph) -> list[str]:
    return [
        f"{e.source} (line {e.line}) imports {e.target}"
        for e in graph.edges
        if e.source.split(".")[0] == "shared" and e.target.split(".")[0] in ("services", "console")
    ]


def within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def serving_imports_tools(graph: Graph) -> list[str]:
    return [
        f"{e.source} (line {e.line}) imports the tool {e.target}"
        for e in graph.edges
        if any(within(e.source, s) for s in SERVING) and within(e.target, TOOLS)
    ]


def private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_module(name: str) -> bool:
    return any(private(part) for part in name.split("."))


def tools_reach_private(graph: Graph) -> list[str]:
    found = []
    for e in graph.edges:
        if not within(e.source, TOOLS) or within(e.target, TOOLS):
            continue
        if not within(e.target, "services"):
            continue
        if private_module(e.target):
            found.append(f"{e.source} (line {e.line}) imports the private module {e.target}")
        found += [
            f"{e.source} (line {e.line}) imports {e.target}.{n}" for n in e.names if private(n)
        ]
    found += tools_reach_private_attributes(graph)
    return found


def tools_reach_private_attributes(graph: Graph) -> list[str]:
    """`from services.x import mod` then `mod._name`: private all the same."""
    found = []
    for source, tree in graph.trees.items():
        if not within(source, TOOLS):
            continue
        bound: dict[str, str] = {}  # local name -> a services module outside the tools
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname and within(alias.name, "services"):
                        bound[alias.asname] = alias.name
            elif isinstance(node, ast.ImportFrom):
                base = resolve_from(node, source, is_package(graph.modules[source]))
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    if sub in graph.modules:
                        bound[alias.asname or alias.name] = sub
        bound = {k: v for k, v in bound.items() if not within(v, TOOLS)}
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in bound
                and private(node.attr)
            ):
                found.append(
                    f"{source} (line {node.lineno}) uses {bound[node.value.id]}.{node.attr}"
                )
    return found


# -- the tree -------------------------------------------------------------------------------

GRAPH = read_graph()


def test_the_walk_sees_the_tree():
    assert len(GRAPH.modules) > 100
    assert "services.gateway.app" in GRAPH.modules and "shared.messages" in GRAPH.modules
    assert len(GRAPH.edges) > 300


def test_no_import_cycle():
    targets = GRAPH.targets()
    found = [
        f"{' -> '.join(one_cycle(c, targets))} (a circle of {len(c)}: {', '.join(c)})"
        for c in cycles(targets)
    ]
    assert not found, "import cycles:\n" + "\n".join(found)


def test_shared_never_imports_services_or_console():
    found = layer_breaches(GRAPH)
    assert not found, "\n".join(found)


def test_no_serving_process_imports_a_tool():
    found = serving_imports_tools(GRAPH)
    assert not found, "\n".join(found)


def test_tools_import_services_through_public_names_only():
    found = tools_reach_private(GRAPH)
    assert not found, "\n".join(found)


# -- the checks catch what they are for (a made-up tree) -----------------------------------


def made_up_tree(tmp_path: Path, files: dict[str, str]) -> Graph:
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return read_graph(tmp_path)


def test_the_checks_find_each_breach(tmp_path):
    graph = made_up_tree(
        tmp_path,
        {
            "shared/__init__.py": "",
            "shared/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
            "    from services.gateway import app\n",
            "services/__init__.py": "",
            "services/gateway/__init__.py": "",
            "services/gateway/app.py": "def f():\n    from . import runs\n",
            "services/gateway/runs.py": "from .app import f\nfrom ..tools.sim import run\n",
            "services/kvmanager/__init__.py": "",
            "services/kvmanager/pool.py": "def _capacity(): ...\n",
            "services/kvmanager/_impl.py": "",
            "services/tools/__init__.py": "",
            "services/tools/sim/__init__.py": "",
            "services/tools/sim/run.py": "from services.kvmanager.pool import _capacity\n"
            "from services.kvmanager import _impl, pool\nx = pool._runs\n",
            "console/__init__.py": "",
        },
    )
    assert cycles(graph.targets()) == [["services.gateway.app", "services.gateway.runs"]]
    assert one_cycle(["services.gateway.app", "services.gateway.runs"], graph.targets()) == [
        "services.gateway.app",
        "services.gateway.runs",
        "services.gateway.app",
    ]
    assert layer_breaches(graph) == ["shared.a (line 3) imports services.gateway.app"]
    assert serving_imports_tools(graph) == [
        "services.gateway.runs (line 2) imports the tool services.tools.sim.run"
    ]
    assert sorted(tools_reach_private(graph)) == [
        "services.tools.sim.run (line 1) imports services.kvmanager.pool._capacity",
        "services.tools.sim.run (line 2) imports the private module services.kvmanager._impl",
        "services.tools.sim.run (line 3) uses services.kvmanager.pool._runs",
    ]
