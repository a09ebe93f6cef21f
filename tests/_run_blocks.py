"""Run README code blocks in order in this one process, each as a fresh program (``tests/test_readme.py``).

Usage: ``python -m tests._run_blocks BLOCKS.json`` where the file holds ``[[line, code], ...]``. Each
block runs in a namespace of its own named ``__main__``; between blocks Ray is shut down, so every
block joins Ray itself as written (one process instead of one per block saves the imports). Prints
``=== block at line N`` before each block; a failing block's traceback ends the run with exit 1.
"""

from __future__ import annotations

import json
import sys


def main(path: str) -> int:
    with open(path) as f:
        blocks = json.load(f)
    for line, code in blocks:
        print(f"=== block at line {line}", flush=True)
        exec(compile(code, f"README.md:{line}", "exec"), {"__name__": "__main__"})
        import ray

        if ray.is_initialized():  # the next block starts from no Ray, as a program of its own would
            ray.shutdown()
    print("=== all blocks ran", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
