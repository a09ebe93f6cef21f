"""The codec: one field of a batch of rows <-> one byte buffer (plus offsets), and back.

Pure functions over tensors, arrays and bytes: no sockets, no processes, no store state. Both sides
use it: clients encode puts and decode gets, shards only check the shapes a put declares.

Rule: the codec imports nothing of the data plane but ``errors``, ``config`` and itself.
"""
