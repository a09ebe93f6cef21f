"""The package layout: the dependency direction between the packages (ARCHITECTURE.md, "Packages and
layers"), no import cycles between packages or modules, each public name written once, no module
hidden by a name of its package, and the data plane's layers (each ``dataplane`` subpackage's
docstring states its rule).
"""

from __future__ import annotations

import ast
import functools
import importlib
import pathlib
import types

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent

# The top-level packages, bottom to top, and what each may import (lazy imports included). The
# store and the controller stand alone and never import each other; workers is where they meet;
# bench measures all three; rlplane, the command line, runs everything. Every other edge is
# forbidden, so no two packages can import each other, directly or around a loop.
ALLOWED = {
    "dataplane": set(),
    "controlplane": set(),
    "workers": {"dataplane", "controlplane"},
    "bench": {"dataplane", "controlplane", "workers"},
    "rlplane": {"dataplane", "controlplane", "workers", "bench"},
}
PACKAGES = tuple(ALLOWED)


@functools.cache
def _tree(path: pathlib.Path) -> ast.Module:
    """A source file's syntax tree, parsed once per process (several tests here, and
    tests/dataplane/test_ops.py, walk every module)."""
    return ast.parse(path.read_text(), filename=str(path))


def _imported_top_levels(path: pathlib.Path) -> set[str]:
    tree = _tree(path)
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("package", PACKAGES)
def test_dependency_direction(package: str) -> None:
    forbidden = set(PACKAGES) - ALLOWED[package] - {package}
    offenders = []
    for path in sorted((ROOT / package).rglob("*.py")):
        bad = _imported_top_levels(path) & forbidden
        if bad:
            offenders.append(f"{path.relative_to(ROOT)} imports {sorted(bad)}")
    assert not offenders, f"{package} may import only {sorted(ALLOWED[package])}:\n" + "\n".join(offenders)


def test_allowed_directions_form_no_cycle() -> None:
    """The rule itself: a package may import only packages listed before it, so none is reachable
    from itself."""
    for i, package in enumerate(PACKAGES):
        assert ALLOWED[package] <= set(PACKAGES[:i]), f"{package} may import a package above it"
    assert _cycles({p: set(deps) for p, deps in ALLOWED.items()}) == []


def test_packages_import() -> None:
    for name in ("dataplane", "controlplane", "workers", "rlplane"):  # bench has no public names
        mod = importlib.import_module(name)
        assert mod.__all__, f"{mod.__name__} has an empty __all__"
        assert len(set(mod.__all__)) == len(mod.__all__), f"{name}.__all__ lists a name twice"
        missing = [n for n in mod.__all__ if not hasattr(mod, n)]
        assert not missing, f"{name}.__all__ names what it lacks: {missing}"


def _literal_all(tree: ast.Module) -> set[str]:
    """The names a module's ``__all__`` spells out as strings (``= [...]`` or ``+= [...]``)."""
    names: set[str] = set()
    for node in tree.body:
        target = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target", None)
        if isinstance(target, ast.Name) and target.id == "__all__" and node.value is not None:
            for elt in ast.walk(node.value):
                if isinstance(elt, ast.Constant) and isinstance(elt.value, str):
                    names.add(elt.value)
    return names


# TransferQueue's module layout, mirrored: transfer_queue.storage.simple_storage shows the error too.
REPEATS_OF_TRANSFERQUEUE = {"dataplane.tq.storage.simple_storage.__all__ repeats StorageKeyNotFoundError"}


def test_each_public_name_is_written_once() -> None:
    """No ``__all__`` spells out a name it imports from a module whose ``__all__`` spells it too: a
    package front door adds its modules' ``__all__`` instead of typing their names again."""
    modules = _all_modules()
    trees = {name: _tree(path) for name, path in modules.items()}
    listed = {name: _literal_all(tree) for name, tree in trees.items()}
    offenders = []
    for name, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in listed:
                for alias in node.names:
                    shown = alias.asname or alias.name
                    if shown == alias.name and shown in listed[name] and shown in listed[node.module]:
                        offenders.append(f"{name}.__all__ repeats {shown}")
    offenders = [o for o in offenders if o not in REPEATS_OF_TRANSFERQUEUE]
    assert not offenders, "\n".join(offenders)


def test_no_module_is_hidden_by_a_name_of_its_package() -> None:
    """``package.name`` is the module ``package/name.py`` (or the subpackage) whenever the package
    has such an attribute: never a function or class of the same name, which would be one thing
    before the module is imported and another after."""
    offenders = []
    for name, path in _all_modules().items():
        if path.name != "__init__.py":
            continue
        package = importlib.import_module(name)
        submodules = {p.stem for p in path.parent.glob("*.py")} | {
            p.parent.name for p in path.parent.glob("*/__init__.py")
        }
        for sub in sorted(submodules - {"__init__", "__main__"}):
            value = getattr(package, sub, None)
            if value is not None and not isinstance(value, types.ModuleType):
                offenders.append(f"{name}.{sub} is a {type(value).__name__}, and {name}/{sub} a module")
    assert not offenders, "\n".join(offenders)


# ---- the module graph: no cycles, and the data plane's layers -----------------------------------

# dataplane layer -> what its modules may import (besides the standard library and third parties).
# The public modules at the top (api, stream, dataset, tq, ...) may import any layer.
_BASE = {"dataplane.errors", "dataplane.config", "dataplane.codec"}
LAYERS = {
    "dataplane.codec": {"dataplane.errors", "dataplane.config", "dataplane.codec"},
    # the pure protocol: values only (no sockets, no Ray: THIRD_PARTY_FORBIDDEN below)
    "dataplane.wire": _BASE | {"dataplane.wire"},
    # how bytes move: sockets, the Unix lane, auth, shared memory, liveness (no Ray)
    "dataplane.transport": _BASE | {"dataplane.wire", "dataplane.transport"},
    "dataplane.client": _BASE
    | {
        "dataplane.meta",
        "dataplane.samplers",
        "dataplane.wire",
        "dataplane.transport",
        "dataplane.telemetry",
        "dataplane.client",
    },
    # the server's two services stand side by side: the index and the shard never import each other
    # (SIDE_BY_SIDE); what both use is the server package's own modules
    "dataplane.server": _BASE
    | {
        "dataplane._units",
        "dataplane.samplers",
        "dataplane.wire",
        "dataplane.transport",
        "dataplane.telemetry",
        "dataplane.server",
    },
    "dataplane.service": _BASE
    | {"dataplane.wire", "dataplane.transport", "dataplane.server", "dataplane.service"},
    # leaves: everything else stands on them
    "dataplane._units": set(),
    "dataplane.errors": set(),
    "dataplane.config": {"dataplane.errors"},
    "dataplane.samplers": {"dataplane.errors"},
    "dataplane.meta": {"dataplane.errors", "dataplane.codec"},
    # the metrics' hot path: every process records into it (ray only inside its exporter thread)
    "dataplane.telemetry": {"dataplane.errors", "dataplane.config", "dataplane.telemetry"},
}
SIDE_BY_SIDE = ("dataplane.server.index", "dataplane.server.shard")
# Third-party modules a layer must not import, at the top or in a function.
THIRD_PARTY_FORBIDDEN = {
    "dataplane.wire": {"zmq", "socket", "ray", "selectors", "asyncio"},
    "dataplane.transport": {"ray"},
}


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _all_modules() -> dict[str, pathlib.Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    """Ids of the nodes inside ``if TYPE_CHECKING:`` blocks (imports for annotations only)."""
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return skip


def import_graph() -> dict[str, set[str]]:
    """module -> the project modules it imports, at the top or inside a function alike.

    ``from pkg import name`` counts as importing ``pkg.name`` when that is a module, else ``pkg``.
    The parents a dotted import runs implicitly (``pkg/__init__``) are not counted: they are the
    package's front door, not a dependency of the importing module. A copy: the graph is built once
    per process.
    """
    return {module: set(deps) for module, deps in _import_graph().items()}


@functools.cache
def _import_graph() -> dict[str, set[str]]:
    modules = _all_modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = _tree(path)
        skip = _type_checking_nodes(tree)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps: set[str] = set()
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name in modules)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    if full in modules:
                        deps.add(full)
                    elif base in modules:
                        deps.add(base)
        deps.discard(name)
        graph[name] = deps
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
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
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles() -> None:
    """No two modules import each other, directly or around a loop (lazy imports included)."""
    graph = import_graph()
    # the package front doors import their own modules: edges *into* them are not cycles to fix
    fronts = {name for name, path in _all_modules().items() if path.name == "__init__.py"}
    trimmed = {m: {d for d in deps if d not in fronts} for m, deps in graph.items()}
    cycles = _cycles(trimmed)
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_cycle_detector_sees_a_cycle() -> None:
    """The detector itself: a loop of three modules is found, a chain is not."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def _layer_of(module: str) -> str | None:
    return max(
        (layer for layer in LAYERS if module == layer or module.startswith(layer + ".")),
        key=len,
        default=None,
    )


def test_dataplane_layers() -> None:
    """Each data-plane layer imports only the layers below it (see each subpackage's docstring)."""
    offenders = []
    for module, deps in sorted(import_graph().items()):
        layer = _layer_of(module)
        if layer is None:
            continue
        for dep in sorted(deps):
            if dep.startswith("dataplane") and (_layer_of(dep) or dep) not in LAYERS[layer] | {layer}:
                offenders.append(f"{module} imports {dep}")
    assert not offenders, "layering broken:\n" + "\n".join(offenders)


def test_the_index_and_the_shard_never_import_each_other() -> None:
    offenders = []
    for module, deps in sorted(import_graph().items()):
        for side in SIDE_BY_SIDE:
            other = next(o for o in SIDE_BY_SIDE if o != side)
            if module == side or module.startswith(side + "."):
                offenders += [
                    f"{module} imports {d}" for d in deps if d == other or d.startswith(other + ".")
                ]
    assert not offenders, "\n".join(offenders)


def _third_party_imports(path: pathlib.Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_the_protocol_has_no_sockets_and_the_transport_no_ray() -> None:
    offenders = []
    for module, path in sorted(_all_modules().items()):
        for layer, banned in THIRD_PARTY_FORBIDDEN.items():
            if module == layer or module.startswith(layer + "."):
                offenders += [f"{module} imports {b}" for b in sorted(_third_party_imports(path) & banned)]
    assert not offenders, "\n".join(offenders)


def test_architecture_md_names_every_data_plane_module() -> None:
    """ARCHITECTURE.md's table of the data plane's layers names each module (``tq/`` as one)."""
    text = (ROOT / "ARCHITECTURE.md").read_text()
    table = text[text.index("| layer | modules | rule |") :]
    table = table[: table.index("\n\n")]
    missing = []
    for name, path in sorted(_all_modules().items()):
        parts = name.split(".")
        if parts[0] != "dataplane" or len(parts) < 2 or parts[1] == "tq":
            continue
        leaf = parts[-1] if path.name != "__init__.py" else f"{parts[-1]}/"
        if f"`{leaf}`" not in table and f"`{leaf}/`" not in table and f"{leaf}/` (" not in table:
            missing.append(name)
    assert not missing, f"ARCHITECTURE.md's layer table does not name: {missing}"
