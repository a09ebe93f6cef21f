"""Typed decodes are safe when two threads of a process meet a type for the first time at once.

msgspec publishes a Struct type's decoding plan before it has filled in its fields' plans; a thread
that decoded the type in that window died with SIGSEGV (a consumer whose two drain threads made their
first ``get`` at once). The check runs in a child process, so that a crash is a failed test and not a
dead test worker, and uses fresh struct types each round, since a type is cold only once per process.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

_TYPES = """
import msgspec

class Rows(msgspec.Struct, tag=True):
    n: int
    sizes: list[int]

class Segment(msgspec.Struct, tag=True):
    path: str
    offsets: list[int]

class Body(msgspec.Struct):
    version: int
    fields: dict[str, Rows | Segment]
    live: list[int] | None = None
"""

_CHILD = textwrap.dedent(
    """
    import sys, threading
    import msgspec
    from dataplane.server import checkpoint_files
    from dataplane.wire import protocol, requests

    # Switch threads as often as CPython allows: the window is a few microseconds wide.
    sys.setswitchinterval(1e-6)
    TYPES, ROUNDS = sys.argv[1], int(sys.argv[2])

    ENTRY_POINTS = {
        "requests.reply": requests.reply,
        "protocol.decode_body": lambda raw, cls: protocol.decode_body("op", raw, {"op": cls}),
        "checkpoint_files.decode_file": lambda raw, cls: checkpoint_files.decode_file(raw, "f", cls),
    }

    for name, decode in ENTRY_POINTS.items():
        for _ in range(ROUNDS):
            ns = {}
            exec(TYPES, ns)  # a new, cold Body type
            fields = {"a": ns["Rows"](2, [1, 2]), "b": ns["Segment"]("p", [0])}
            body = ns["Body"](checkpoint_files.VERSION, fields)
            raw = msgspec.msgpack.encode(body)
            start, got = threading.Barrier(2), []

            def first_decode():
                start.wait(timeout=10)
                got.append(decode(raw, ns["Body"]))

            threads = [threading.Thread(target=first_decode) for _ in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=10)
            assert got == [body, body], (name, got)
    print("ok")
    """
)


def test_two_threads_decoding_a_cold_type_at_once_do_not_crash() -> None:
    proc = subprocess.run(
        [sys.executable, "-X", "faulthandler", "-c", _CHILD, _TYPES, "100"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", (
        f"the child exited {proc.returncode}:\n{proc.stderr[-3000:]}"
    )
