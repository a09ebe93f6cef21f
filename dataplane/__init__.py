"""dataplane: a sharded in-cluster batch store for RL post-training.

All real data (prompts, responses, log-probs, rewards, advantages) lives in storage
shards as columnar segments, addressed by ``KVBatchMeta``. The KV functions follow
TransferQueue's names, so code written against it moves over by changing one import::

    import dataplane as dp

    dp.init()
    meta = dp.kv_batch_put(keys=["a", "b"], partition_id="train", fields=td)
    td = dp.kv_batch_get_by_meta(meta)
    dp.close()
"""

__all__: list[str] = ["__version__"]

__version__ = "0.1.0"
