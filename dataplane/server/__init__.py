"""The server side: what runs in the store's actors (the index and the shards).

``shard`` (a shard's rows and bytes, without I/O), ``segments`` (its shared-memory files),
``shard_actor`` (the Ray actor serving a shard), the index: ``index`` (``IndexCore``: partitions,
keys, readiness and the shard registry; its reads), ``index_records`` (its state), ``index_puts``
(puts and clears), ``index_streaming`` (consumers' takes, leases, acks) and ``index_actor`` (the Ray
actor and its request loop), ``streams`` (per-task consumption of a partition),
``dispatch`` (the op table and ``op_<name>`` dispatch both cores share), ``router`` (the zmq
ROUTER loop both actors serve through), and checkpoints: ``checkpoint_files`` (the format: names,
checksummed writes, checked reads), ``shard_checkpoint`` (a shard saves and loads its rows) and
``index_checkpoint`` (the index's metadata).

Rule: the server imports the codec, the wire, ``errors``, ``config`` and ``samplers``; never the
client side.
"""
