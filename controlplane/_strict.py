"""Refusing unknown keyword arguments with an error that names them (and suggests a fix)."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def unknown_kwargs_error(owner: str, unknown: Iterable[str], known: Iterable[str]) -> TypeError:
    """A ``TypeError`` naming every unknown keyword, with the closest known name for each typo.

    Example:
        >>> str(unknown_kwargs_error("RayWorkerGroup()", ["call_timout_s"], ["call_timeout_s"]))
        "RayWorkerGroup() got unexpected keyword argument(s) ['call_timout_s'] (did you mean ..."
    """
    unknown = sorted(unknown)
    known = sorted(known)
    hints = []
    for name in unknown:
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
        if close:
            hint = f"did you mean {close[0]!r}?"
            hints.append(hint if len(unknown) == 1 else f"{name!r}: {hint}")
    suffix = f" ({'; '.join(hints)})" if hints else ""
    return TypeError(f"{owner} got unexpected keyword argument(s) {unknown}{suffix}")


def init_parameter_names(cls: type) -> set[str]:
    """Keyword names the ``__init__`` methods along ``cls``'s MRO accept (for suggestions)."""
    import inspect

    names: set[str] = set()
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        try:
            params = inspect.signature(init).parameters.values()
        except (TypeError, ValueError):  # a builtin without a signature
            continue
        names |= {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    names.discard("self")
    return names
