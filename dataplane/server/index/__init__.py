"""The index service: which keys exist in which partition, which fields each holds, their tags, what
each consumer task took, and the shard registry. It never receives row bytes.

``core`` (``IndexCore``: the state and the reads that resolve metadata), ``records`` (its state),
``puts`` (puts, commits and clears), ``streaming`` (consumers' takes, leases, acks), ``streams``
(per-task consumption of one partition), ``ready`` (a partition's ready keys, indexed by group),
``checkpoint`` (its metadata saved and loaded) and ``actor`` (the Ray actor and its request loop,
which parks calls that wait for rows). Plain classes except ``actor``: tested without Ray.
"""
