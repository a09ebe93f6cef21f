"""One reader per setting: every ``DATAPLANE_*`` variable is parsed in ``dataplane.config``, and every
part of the data plane that depends on one asks it there, so no two parts can read a value apart."""

from __future__ import annotations

import ast
import pathlib

import pytest

from dataplane.codec.column_kinds import ValueEncoder
from dataplane.config import StoreConfig, env_flag

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "value, on",
    [("1", True), ("true", True), ("True", True), (" yes ", True), ("ON", True)]
    + [("0", False), ("false", False), ("No", False), ("off", False), ("", False)],
)
def test_allow_pickle_means_the_same_to_the_config_and_the_codec(monkeypatch, value: str, on: bool) -> None:
    """``=true`` once turned pickling on in the codec's encoder and left ``StoreConfig.allow_pickle``
    off (only "1" counted there): a process could write object columns it then refused to read."""
    monkeypatch.setenv("DATAPLANE_ALLOW_PICKLE", value)
    assert StoreConfig.from_options().allow_pickle is on
    assert ValueEncoder().allow_pickle is on


def test_an_unset_flag_is_off_and_a_value_that_is_no_flag_is_refused_by_name(monkeypatch) -> None:
    monkeypatch.delenv("DATAPLANE_ALLOW_PICKLE", raising=False)
    assert env_flag("DATAPLANE_ALLOW_PICKLE") is False and ValueEncoder().allow_pickle is False
    monkeypatch.setenv("DATAPLANE_ALLOW_PICKLE", "maybe")
    with pytest.raises(ValueError, match="DATAPLANE_ALLOW_PICKLE='maybe' is not a flag"):
        StoreConfig.from_options()
    with pytest.raises(ValueError, match="DATAPLANE_ALLOW_PICKLE='maybe' is not a flag"):
        _ = ValueEncoder().allow_pickle


def test_transport_variable_is_checked_for_every_reader(monkeypatch) -> None:
    monkeypatch.setenv("DATAPLANE_TRANSPORT", "carrier-pigeon")
    with pytest.raises(ValueError, match="DATAPLANE_TRANSPORT='carrier-pigeon'"):
        StoreConfig.from_options()
    monkeypatch.setenv("DATAPLANE_TRANSPORT", "zmq")
    assert StoreConfig.from_options().transport == "zmq"


def _is_os(node: ast.AST, name: str) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == name and getattr(node.value, "id", None) == "os"


def _variables_read(tree: ast.AST) -> list[tuple[int, str | None]]:
    """(line, variable) of every environment read: ``os.environ.<method>(name, ...)``,
    ``os.environ[name]``, ``os.getenv(name)``; variable None when it is not a literal (or the
    environment is used whole)."""
    found: list[tuple[int, str | None]] = []
    claimed: set[int] = set()

    def literal(node: ast.AST | None) -> str | None:
        return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None

    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            if _is_os(f, "getenv") or (isinstance(f, ast.Attribute) and _is_os(f.value, "environ")):
                found.append((node.lineno, literal(node.args[0] if node.args else None)))
                claimed.add(id(f.value if _is_os(f.value, "environ") else f))
        elif isinstance(node, ast.Subscript) and _is_os(node.value, "environ"):
            found.append((node.lineno, literal(node.slice)))
            claimed.add(id(node.value))
        elif isinstance(node, ast.ImportFrom) and node.module == "os":
            if any(alias.name in ("environ", "getenv") for alias in node.names):
                found.append((node.lineno, None))
    for node in ast.walk(tree):  # the environment used whole: passed on, copied, iterated
        if _is_os(node, "environ") and id(node) not in claimed:
            found.append((node.lineno, None))
    return found


def test_only_the_config_reads_dataplane_variables() -> None:
    """Outside ``dataplane.config`` the data plane reads only other systems' variables (Ray's, the
    worker group's), each by its literal name: a ``DATAPLANE_*`` name there would be a second reader."""
    offenders = []
    for path in sorted((ROOT / "dataplane").rglob("*.py")):
        if path.relative_to(ROOT).as_posix() == "dataplane/config.py":
            continue
        for lineno, name in _variables_read(ast.parse(path.read_text())):
            if name is None or name.startswith("DATAPLANE_"):
                offenders.append(f"{path.relative_to(ROOT)}:{lineno} reads {name or 'the environment'}")
    assert not offenders, "environment reads outside dataplane/config.py:\n" + "\n".join(offenders)
