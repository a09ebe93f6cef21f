"""How the test clusters start a Ray worker process: Ray's ``setup_worker.py`` without its import of Ray.

A Ray node starts every Python worker as ``python setup_worker.py ARGS``: that script imports part of
Ray (about half a CPU-second), applies the worker's runtime-env context (its environment variables,
its interpreter) and execs ``python default_worker.py ...``, which imports Ray again. The suite starts
some 300 workers on 2 cores, so the session clusters use this script instead (``tests/conftest.py``
passes it as the node's ``setup_worker_path``): the same context applied with the standard library,
then the same worker: forked by the session's fork server (``server.py``, named by
``RLT_ZYGOTE``), which has imported what workers import, or else exec'd. The worker that runs is
Ray's own, with the same arguments and environment. A context this script does not handle (a command
prefix, another entry point, another language, an interpreter given as a command line) goes to Ray's
own script unchanged.
"""

from __future__ import annotations

import json
import os
import re
import sys

try:  # run as a script (what a raylet does), this directory is first on sys.path
    import forkserver_client as _zygote_client
except ImportError:  # imported as tests.forkserver.worker_start
    from tests.forkserver import forkserver_client as _zygote_client

CONTEXT = "--serialized-runtime-env-context"
LANGUAGE = "--language"


def split(argv: list[str]) -> tuple[dict, str, list[str]]:
    """The runtime-env context, the language and the worker's own arguments, as Ray's script reads them."""
    context, language, rest = "{}", "", []
    args = iter(argv)
    for arg in args:
        name, eq, value = arg.partition("=")
        if name in (CONTEXT, LANGUAGE):
            value = value if eq else next(args, "")
            if name == CONTEXT:
                context = value or "{}"
            else:
                language = value
        else:
            rest.append(arg)
    return json.loads(context), language, rest


def start(argv: list[str]) -> None:
    context, language, rest = split(argv)
    exe = context.get("py_executable") or sys.executable
    plain = (
        language == "PYTHON"
        and not context.get("command_prefix")
        and not context.get("override_worker_entrypoint")
        and not any(c.isspace() for c in exe)
    )
    if not plain:
        import importlib.util  # only here: every worker of the test clusters starts through this script

        ray_dir = importlib.util.find_spec("ray").submodule_search_locations[0]  # finds, does not import
        script = os.path.join(ray_dir, "_private", "workers", "setup_worker.py")
        os.execv(sys.executable, [sys.executable, script, *argv])
    for key, value in (context.get("env_vars") or {}).items():
        # As Ray does: ${X} from this environment, and an unset one replaced by nothing.
        os.environ[key] = re.sub(r"\$\{[A-Z0-9_]+\}", "", os.path.expandvars(value))
    zygote = os.environ.get(_zygote_client.ZYGOTE)
    if zygote and os.path.realpath(exe) == os.path.realpath(sys.executable):
        status = _zygote_client.request_worker(zygote, rest)
        if status is not None:
            sys.exit(status)
    os.execv(exe, [exe, *rest])


if __name__ == "__main__":
    start(sys.argv[1:])
