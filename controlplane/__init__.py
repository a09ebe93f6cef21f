"""controlplane: a thin single controller in the style of verl's ``single_controller``.

One driver drives many Ray workers with plain method calls; it passes only what the
caller hands it (in this project: metadata) and never imports ``dataplane``.
"""

__all__: list[str] = ["__version__"]

__version__ = "0.1.0"
