"""The client side: what runs in every process that puts or gets (drivers, workers).

``ops`` and ``stream_ops`` (each KV and streaming operation written once, sans-IO: a generator over
request batches), ``engine`` (runs them over a transport, sync or async), ``handle`` (this
process's connection to one store), ``sharding`` (which shard holds a key) and ``mappings``
(the shard files this process has mapped).

Rule: the client imports the codec, the wire, ``errors``, ``config``, ``meta`` and ``samplers``;
never the server side (it only talks to it over the wire).
"""
