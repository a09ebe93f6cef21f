"""Start, inspect and stop the store as a service (filled in by the store issue)."""

from __future__ import annotations

import argparse


def cli(args: argparse.Namespace) -> int:
    raise SystemExit(f"rlplane store {args.store_action}: the store service is not built yet")
