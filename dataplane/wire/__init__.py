"""The protocol: what crosses between processes, as values, with no socket and no Ray.

``frames`` (a msgpack header plus raw buffers, and the protocol version every message carries),
``protocol`` (the typed request and reply bodies of every shard and index operation), ``decoders``
(typed decoders, each built by one thread at a time, since msgspec's first build of a type is not
safe against a second thread), ``requests`` (the calls an operation yields and the results it
receives), ``policy`` (when a request ends: its deadline, the probe of a silent peer, late replies,
dead peers; sans-IO) and ``placement`` (which shard holds a key: the rule clients route by and
shards find their rows of a checkpoint by).

Rule: the wire imports only ``errors``, ``config``, the codec and itself; no sockets, no Ray, no
I/O: testable without a process. ``transport`` moves its messages.
"""
