"""``PingIndex``: an index core with one toy op of the tests' own, ``ping``, answered at once with an
empty reply, reading no state.

The store has no such op (a client that only wants an answer asks ``stats``). The transport tests
(``test_unix_lane.py``, ``test_policy.py``) want a request whose reply is empty, and that differs from
the ``stats`` their servers hold back or close the connection on.
"""

from __future__ import annotations

import msgspec

from dataplane.server.index.core import IndexCore
from dataplane.wire import protocol as _protocol


class Ping(msgspec.Struct, forbid_unknown_fields=True):
    pass


class PingIndex(IndexCore):
    OPS = {**_protocol.INDEX_OPS, "ping": Ping}
    REPLIES = {**_protocol.INDEX_REPLIES, "ping": _protocol.Done}

    def op_ping(self, body: Ping) -> _protocol.Done:
        return _protocol.Done()
