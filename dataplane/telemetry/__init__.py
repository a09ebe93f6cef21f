"""The store's metrics inside each process: what is measured, how it is recorded, how it reaches Ray.

``catalog`` (every metric the store exports: name, kind, labels, meaning), ``recorder`` (the hot
path: counters and histogram buckets in plain dicts, and snapshots the servers publish), ``bounds``
(the label sets kept small: the largest partitions by name, the rest summed under ``"other"``) and
``export`` (a background thread that hands what was recorded to ``ray.util.metrics`` every few
seconds). ``dataplane.metrics`` is the public side: where to scrape them.

Rule: a leaf like ``config``: it imports only ``errors``, ``config`` and itself (``ray`` only inside
the exporter's thread), so every layer may record into it.
"""
