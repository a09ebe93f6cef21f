"""workers: where the data plane and the control plane meet.

The ``tqbridge`` wrapper, engine workers on a small torch model, and a GRPO trainer
whose driver handles metadata only.
"""

__all__: list[str] = ["__version__"]

__version__ = "0.1.0"
