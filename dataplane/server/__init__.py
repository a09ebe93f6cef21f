"""The server side: what runs in the store's actors, the index and the shards.

``index/`` is the index service (partitions, keys, readiness, consumption, leases; metadata only),
``shard/`` a storage shard (its rows, their memory, its checkpoint files). What both use stays here:
``dispatch`` (the op table and ``op_<name>`` dispatch both cores share), ``router`` (the request
loop both actors serve through: zmq ROUTER sockets and the Unix lane) and ``checkpoint_files`` (the
checkpoint format: names, checksummed writes, checked reads).

Rule: the server imports the codec, the wire, the transport, ``errors``, ``config``, ``samplers`` and
``telemetry``; never the client side; the index and the shard never import each other.
"""
