"""Benchmarks: store throughput and controller-bypass figures, as ratios measured in one run."""
