"""A TransferQueue 0.1.11-compatible front: ``import dataplane.tq as tq`` replaces ``import
transfer_queue as tq``, with its public names, submodules (``sampler``, ``dataloader``,
``metadata``, ``interface``, ``client``), keywords, layouts and error contract, on this store.

    import dataplane.tq as tq

    tq.init()                                   # or tq.init(conf): a dict or OmegaConf config
    meta = tq.kv_batch_put(keys=["a", "b"], partition_id="train", fields=td, tags=[{}, {}])
    td = tq.kv_batch_get(keys=["a", "b"], partition_id="train", select_fields=["prompt"])
    client = tq.get_client()                    # get_meta / put / get_data on BatchMeta
    tq.kv_clear(keys=["a", "b"], partition_id="train")
    tq.close()

verl 0.9.1's TransferQueue code (``tqbridge``, the v1 trainers and ``ReplayBuffer``) and
TransferQueue's own tests of its public classes run unchanged on it (``scripts/tq_compat.sh``).

As in TransferQueue:

* **Layout.** Reads return tensor fields as jagged nested tensors, even when the rows share a
  shape (``layout="dense"`` on a read returns the store's ``[B, ...]`` instead; ``dp.*`` reads are
  always dense where rows agree).
* **Metadata.** ``BatchMeta`` (integer ``global_indexes``, ``partition_ids``, ``field_schema``,
  ``production_status``, ``custom_meta``, ``select_samples``, ``chunk(chunks=...)``, ``concat``,
  ``union``, ...) and ``KVBatchMeta`` (``partition_id=None``, ``fields`` as a str, TransferQueue's
  messages) with TransferQueue's constructors; global indexes are handed out per key by the
  ``TransferQueueController`` actor and never reused.
* **Attach.** Any process of the Ray cluster may call any function without ``init()``: the first
  call attaches (to the store and the controller, with the config every process shares).
* **Client.** ``get_client()`` has every public method of TransferQueue's client, sync and
  ``async_``, with its signatures.
* **A field's dtype may differ between puts** (TransferQueue 0.1.11's tutorial 02 writes
  ``attention_mask`` as float32, then as int64 for other keys): each row reads back with its own
  dtype, and rows of several dtypes read together come back as TransferQueue packs them (a strided
  nested tensor of the first row's dtype). The store keeps one type per column: the rows of another
  dtype are kept in a hidden field ``__tq_rows__:<name>``, and the field itself holds empty rows in
  their place, which is what ``dp.*`` reads see (``dataplane/tq/_mixed.py``). Fields of 0-dim rows (a
  ``[B]`` tensor) keep one dtype: another raises ``SchemaError`` naming the dtype to write; and a
  field keeps its kind (tensors, strings, JSON-like values), as ``SchemaMismatchError`` says.

Better than TransferQueue, without breaking its users:

* **A missing key raises** ``KeyNotFoundError`` (a ``ValueError`` and ``KeyError``, also
  ``tq.StorageKeyNotFoundError``) naming the key; TransferQueue drops missing keys silently when at
  least one key exists, so a batch shrinks without a sign. A selected field that no requested key
  holds is left out of a ``kv_batch_get`` as in TransferQueue (verl's trainers ask for optional
  fields so); one that only some of the keys hold raises ``FieldNotFoundError`` (TransferQueue
  drops it too).
* **No client-shipped code runs anywhere**: ``data_parser`` raises ``NotImplementedError``
  (transform the data before the put), and the sampler in the config is shared as a name and
  parameters, never as code (a sampler class of your own is passed per call instead:
  ``get_meta(..., sampling_config={"sampler": ...})``; it runs in the calling process).
* **Nothing is unpickled unless the reading process opted in** (``DATAPLANE_ALLOW_PICKLE=1``);
  numpy byte-string and object arrays travel as bytes / str per row, without pickle.
* **Tags merge** (``set_custom_meta``, ``put``): TransferQueue replaces each row's dict, so two
  writers lose each other's tags.
* **Global indexes are never reused**, so a stale ``BatchMeta`` never reads another row.
* **Every wait has a deadline**: a non-polling ``get_meta`` waits 5 s (``sampling_config
  ["timeout_s"]``) then raises ``GetMetaTimeoutError``; controller calls time out after 60 s.
* **``close()``** stops the store and controller only in the process that started them; in
  TransferQueue any caller kills the shared controller.

Raising ``NotImplementedError`` (no equivalent here), each naming what to use instead:

* ``data_parser=`` of ``kv_put``, ``kv_batch_put``, ``put`` and their ``async_`` forms;
* ``TransferQueueController`` (the class: ``tq.init()`` starts the controller),
  ``ZMQServerInfo``, ``ZMQMessage``, ``ZMQRequestType``, ``process_zmq_server_info``,
  ``SimpleStorageUnit``, ``AsyncSimpleStorageManager``: TransferQueue's zmq protocol and storage
  machinery (``storage.StorageUnitData``, its in-memory container, is here as TransferQueue has
  it, but for its ``save_checkpoint`` / ``load_checkpoint``: TransferQueue pickles the table);
* the client's ``save_controller_checkpoint`` / ``load_controller_checkpoint`` (and ``async_``
  forms): the store saves everything as one checkpoint, use ``tq.save_checkpoint`` /
  ``tq.load_checkpoint`` (the client's ``save_storage_checkpoint`` / ``load_storage_checkpoint``);
* ``StreamingDataLoader(num_workers>0)``: use ``num_workers=0``, or ``dataplane.StreamingDataset
  (prefetch=...)`` (TransferQueue's tutorial 06 runs with ``num_workers=0``).

A sampler object in the config (``tq.init({"controller": {"sampler": MySampler()}})``, TransferQueue's
tutorial 05) raises ``ValueError`` naming the fix: pass it per call, ``get_meta(...,
sampling_config={"sampler": MySampler()})`` (see "No client-shipped code runs anywhere" above).

**Checkpoints.** ``tq.save_checkpoint`` writes the store's checkpoint (``dataplane.save_checkpoint``:
no pickle in it) with TransferQueue's ``metadata.json`` and ``simple_storage/storage_unit_info.json``
beside it; TransferQueue's pickles (``controller_state.pkl``, ``simple_storage/su_<n>_<id>.pkl``)
are not written, their content is in the store's files. A checkpoint loads into a store of any
number of shards.

The config: ``backend.SimpleStorage.num_data_storage_units`` sets the number of shards;
``controller.polling_mode`` and ``controller.sampler`` apply to ``get_meta`` in every process.
Capacity is bytes here (``StoreConfig.capacity_bytes``), not a sample count; every other key is
ignored with one warning naming them. A ``TransferQueueController`` actor answers TransferQueue's
introspection calls (``list_partitions``, ``clear_partition``, ``get_partition_snapshot``) in the
``transfer_queue`` namespace and in the caller's.
"""

from __future__ import annotations

from dataplane.tq import _unsupported
from dataplane.tq import client as _client
from dataplane.tq import controller as _controller
from dataplane.tq import dataloader as _dataloader
from dataplane.tq import interface as _interface
from dataplane.tq import metadata as _metadata
from dataplane.tq import sampler as _sampler
from dataplane.tq import storage as _storage

# Each public name is written once, in the ``__all__`` of the module that defines it.
from dataplane.tq.client import *  # noqa: F403
from dataplane.tq.controller import *  # noqa: F403
from dataplane.tq.dataloader import *  # noqa: F403
from dataplane.tq.interface import *  # noqa: F403
from dataplane.tq.metadata import *  # noqa: F403
from dataplane.tq.sampler import *  # noqa: F403
from dataplane.tq.storage import *  # noqa: F403

__version__ = "0.1.11"  # the TransferQueue release whose interface this follows


ZMQServerInfo = _unsupported.unsupported("ZMQServerInfo")
ZMQMessage = _unsupported.unsupported("ZMQMessage")
ZMQRequestType = _unsupported.unsupported("ZMQRequestType")
SimpleStorageUnit = _unsupported.unsupported("SimpleStorageUnit")
AsyncSimpleStorageManager = _unsupported.unsupported("AsyncSimpleStorageManager")
process_zmq_server_info = _unsupported.unsupported_function("process_zmq_server_info")

# TransferQueue's machinery: importable, NotImplementedError when used.
__all__ = [
    "ZMQServerInfo",
    "ZMQMessage",
    "ZMQRequestType",
    "SimpleStorageUnit",
    "AsyncSimpleStorageManager",
    "process_zmq_server_info",
]
__all__ += _client.__all__
__all__ += _controller.__all__
__all__ += _dataloader.__all__
__all__ += _interface.__all__
__all__ += _metadata.__all__
__all__ += _sampler.__all__
__all__ += _storage.__all__
