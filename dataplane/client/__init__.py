"""The client side: what runs in every process that puts or gets (drivers, workers).

``ops`` and ``stream_ops`` (each KV and streaming operation written once, sans-IO: a generator over
request batches, which opens no socket and maps no file; ``dataplane.api`` calls them directly),
``handle`` (this process's connection to one store: it drives the operations over a transport,
sync or async), ``sharding`` (which shard holds a key), ``memory`` (what an
operation needs of shared memory, passed in on its route) and ``mappings`` (the shard files this
process has mapped: the real ``memory``).

Rule: the client imports the codec, the wire, ``errors``, ``config``, ``meta`` and ``samplers``;
never the server side (it only talks to it over the wire).
"""
