"""Runs the benchmarks in bench/ by name."""

from __future__ import annotations

import argparse


def cli(args: argparse.Namespace) -> int:
    raise SystemExit(f"rlplane bench {args.which}: no benchmarks are built yet")
