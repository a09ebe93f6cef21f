"""Installs the worker bridge on the types that name rows: ``KVBatchMeta`` and ``StreamRequest``.

controlplane's ``@register`` hands a call to the ``__worker_bridge__`` of an argument's class (see
``controlplane.bridge``). The bridge (``dataplane.bridge``) imports torch and the KV API, so
the forwarder installed here imports it on the first bridged call: a process that only handles
metadata stays light, and ``meta`` / ``stream`` never import the bridge (the import graph keeps no
cycle). The package imports this module, so the hook is in place wherever a meta can exist.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dataplane.meta import KVBatchMeta
from dataplane.stream import StreamRequest

if TYPE_CHECKING:
    from dataplane.bridge import BridgedCall


class WorkerBridgeForwarder:
    """Forwards ``run`` / ``arun`` to ``dataplane.bridge.WorkerBridge``, imported on first use."""

    def run(self, call: BridgedCall) -> Any:
        from dataplane.bridge import WorkerBridge

        return WorkerBridge().run(call)

    async def arun(self, call: BridgedCall) -> Any:
        from dataplane.bridge import WorkerBridge

        return await WorkerBridge().arun(call)


KVBatchMeta.__worker_bridge__ = StreamRequest.__worker_bridge__ = WorkerBridgeForwarder()
