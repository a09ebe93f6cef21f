"""The demo trainer (a placeholder until the GRPO trainer lands): a Ray round trip."""

from __future__ import annotations

import argparse


def cli(args: argparse.Namespace) -> int:
    import ray
    import torch

    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    try:

        @ray.remote(num_cpus=0.1)
        def double(x: torch.Tensor) -> torch.Tensor:
            return x * 2

        x = torch.arange(4.0)
        y = ray.get(double.remote(x))
        print(f"ray round trip: {x.tolist()} -> {y.tolist()}")
    finally:
        ray.shutdown()
    return 0
