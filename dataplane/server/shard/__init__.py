"""A storage shard: the rows of the keys that hash to it, as columnar segments in shared memory (and
in its heap for rows put inline).

``core`` (``ShardCore``: reservations, commits, reads; no I/O), ``segments`` (its shared-memory
files), ``host_memory`` (what the store's shards on one host may allocate together), ``checkpoint``
(a shard saves and loads its rows) and ``actor`` (the Ray actor, its request loop and its link to
the index).
"""
