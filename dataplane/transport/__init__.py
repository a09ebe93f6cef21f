"""How bytes move between the store's processes and hosts.

``sockets`` (what clients and servers share of sockets: framing, connecting to a target, the errors
naming it), ``clients`` (the client's blocking and asyncio request/reply transports), ``unix`` (the
same-host lane: the wire's frames on a Unix stream socket, without zmq), ``auth`` (one secret per
store, checked before any message; CURVE between hosts when asked), ``shm`` (the shared-memory
contract between a shard and the clients that map it), ``pinning`` (those mappings registered
with CUDA, within a cap, and which copy a device tensor takes), ``locality`` (which same-host shortcut a
peer allows: its kernel and namespaces) and ``liveness`` (whether a silent peer is dead: ``/proc``
where the pid namespace is shared, else a check the caller passes in, Ray's in practice).

Rule: the transport imports ``errors``, ``config``, the codec, the wire and itself; never the
client or the server side, nor Ray (``service.liveness`` holds the Ray check).
"""
