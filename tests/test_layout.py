"""The package layout and the dependency direction from DESIGN.md."""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent

# package -> packages it must never import. workers sits on top (its CLI also
# dispatches to bench), so it may import anything.
FORBIDDEN = {
    "dataplane": {"controlplane", "workers", "bench"},
    "controlplane": {"dataplane", "workers", "bench"},
}


def _imported_top_levels(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_dependency_direction(package: str) -> None:
    offenders = []
    for path in sorted((ROOT / package).rglob("*.py")):
        bad = _imported_top_levels(path) & FORBIDDEN[package]
        if bad:
            offenders.append(f"{path.relative_to(ROOT)} imports {sorted(bad)}")
    assert not offenders, "dependency direction broken:\n" + "\n".join(offenders)


def test_packages_import() -> None:
    import controlplane
    import dataplane
    import workers

    for mod in (dataplane, controlplane, workers):
        assert mod.__all__, f"{mod.__name__} has an empty __all__"
