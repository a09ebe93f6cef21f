"""The store as a service: connect to Ray, start, find and stop the index and shard actors.

Runs in a driver or the ``rlplane store`` command (``dataplane.admin``), never in the store itself:
``connect`` (one meaning of ``address``) and ``launch`` (start / find / stop the actors).

Rule: the service imports the server side (the actor classes it starts), the wire, ``errors`` and
``config``; the public modules above (``api``, ``admin``) import it, never the other way round.
"""
