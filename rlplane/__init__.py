"""rlplane: the distribution's own package, at the top of the others.

It holds the ``rlplane`` command (:mod:`rlplane.cli`) and the distribution's version. Everything it
runs lives below it: ``dataplane`` (the batch store), ``controlplane`` (the single controller),
``workers`` (where the two meet: the bridge, the engine workers, the demo trainer) and ``bench``
(the benchmarks). None of those imports ``rlplane`` (``tests/test_layout.py``).

Example:
    >>> import rlplane
    >>> rlplane.__version__.count(".") >= 1  # e.g. "0.1.0"
    True
"""

from importlib import metadata as _metadata


def _version() -> str:
    """The installed distribution's version; for a checkout never installed, its pyproject's."""
    try:
        return _metadata.version("rlplane")
    except _metadata.PackageNotFoundError:
        import pathlib
        import tomllib

        pyproject = pathlib.Path(__file__).resolve().parent.parent / "pyproject.toml"
        return str(tomllib.loads(pyproject.read_text())["project"]["version"])


__version__ = _version()

__all__ = ["__version__"]
