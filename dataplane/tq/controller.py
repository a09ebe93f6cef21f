"""TransferQueue's ``transfer_queue.controller`` module. The controller of this store is started (or
found) by ``tq.init()``; its actor is ``dataplane._tq_controller.Controller``, kept outside this
package so that its process does not import tensordict."""

from __future__ import annotations

from dataplane.tq._unsupported import unsupported

# TransferQueue's controller class: this store's controller is started by ``tq.init()``.
TransferQueueController = unsupported("TransferQueueController")

__all__ = ["TransferQueueController"]
