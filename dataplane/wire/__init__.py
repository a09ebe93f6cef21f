"""What crosses between processes: frames, request bodies, authentication, shared memory, sockets.

``frames`` (a msgpack header plus raw buffers), ``protocol`` (the typed request bodies of every
shard and index operation), ``decoders`` (typed decoders, each built by one thread at a time, since
msgspec's first build of a type is not safe against a second thread), ``auth`` (one secret per
store, checked before any message), ``shm`` (the shared-memory contract between a shard and
same-host clients), ``requests`` (the calls an operation yields and the results it receives, with
no socket), ``unix`` (the same-host lane: those frames on a Unix stream socket, without zmq),
``policy`` (when a request ends: its deadline, the probe of a silent peer, late replies, dead
peers; sans-IO), ``sockets`` (what clients and servers share of sockets: framing, connecting to a
target, the errors naming it), ``transport`` (the client's blocking and asyncio request/reply
transports), ``liveness`` (whether a silent peer is dead) and ``placement`` (which shard holds a
key: the rule clients route by and shards find their rows of a checkpoint by).

Rule: the wire imports only ``errors``, ``config``, the codec and itself; never the client or the
server side, which both build on it.
"""
