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

import typing as _typing

from dataplane import (
    _bridge_hook,  # noqa: F401 - installs __worker_bridge__ on metas
    _fork,  # noqa: F401 - no forked child waits on an import of its parent's threads
)
from dataplane import api as _api
from dataplane import checkpoint as _checkpoint
from dataplane import config as _config
from dataplane import errors as _errors
from dataplane import meta as _meta
from dataplane import samplers as _samplers
from dataplane import stream as _stream

# Each public name is written once, in the ``__all__`` of the module that defines it; this front
# door hands out those modules' ``__all__`` (a module's helpers for the rest of the package are
# imported by name, and left out of its ``__all__``).
from dataplane.api import *  # noqa: F403
from dataplane.checkpoint import *  # noqa: F403
from dataplane.config import *  # noqa: F403
from dataplane.errors import *  # noqa: F403
from dataplane.meta import *  # noqa: F403
from dataplane.samplers import *  # noqa: F403
from dataplane.stream import *  # noqa: F403

__all__: list[str] = []
__all__ += _api.__all__
__all__ += _checkpoint.__all__
__all__ += _config.__all__
__all__ += _errors.__all__
__all__ += _meta.__all__
__all__ += _samplers.__all__
__all__ += _stream.__all__

# StreamingDataset and StreamingDataLoader subclass torch's classes: imported on first use, so the
# store's own processes (shards, index), which import this package, never load torch. A type checker
# sees plain imports instead (and no module __getattr__, so a misspelt ``dp.name`` stays an error).
_LAZY = {"StreamingDataset": "dataplane.dataset", "StreamingDataLoader": "dataplane.dataloader"}

if _typing.TYPE_CHECKING:
    from dataplane.dataloader import StreamingDataLoader as StreamingDataLoader
    from dataplane.dataset import StreamingDataset as StreamingDataset
else:
    __all__ += list(_LAZY)

    def __getattr__(name: str) -> _typing.Any:
        if name in _LAZY:
            import importlib

            return getattr(importlib.import_module(_LAZY[name]), name)
        raise AttributeError(f"module 'dataplane' has no attribute {name!r}")


def __dir__() -> list[str]:
    """The public names (``__all__``), the lazy ones included; not the helpers this module imports."""
    return sorted(__all__)
