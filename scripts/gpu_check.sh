#!/usr/bin/env bash
# The GPU check, for the day a GPU machine is at hand (about 3 minutes on an H100; every step has a
# timeout): the `gpu`-marked tests (the demo on the GPU among them), then `bench.gpu`: a CUDA tensor
# put by one process and read onto the GPU by another, at 16 MiB, 256 MiB and 1 GiB, against the pinned-buffer
# floor, the naive copy and a device-to-device copy of the same bytes, in one run (one table printed;
# bench/results/gpu.json written). Record the table in bench/README.md "GPU round trip", with the
# machine, and commit bench/results/gpu.json.
#
# Needs the project's venv with a CUDA build of torch==2.13.0 (`make install`, then the CUDA wheel for
# the machine), or PYTHON naming an interpreter that imports the project: on a machine whose image has
# CUDA PyTorch but no package index, `source .whl/use.sh` sets that up (scripts/gpu_bundle.sh packs it).
# Exits 2 when the interpreter cannot import the project, 3 when torch sees no CUDA device, 1 when a
# step failed. With OUT set (a folder), the log and gpu.json are copied there too.
#
# Usage:   scripts/gpu_check.sh [bench.gpu args, e.g. --repeats 3]
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
cd "$ROOT"
if [ -n "${OUT:-}" ]; then mkdir -p "$OUT" && exec > >(tee "$OUT/gpu_check.log") 2>&1; fi

if ! "$PYTHON" -c "import dataplane, ray, torch" 2>/dev/null; then
  echo "gpu_check: $PYTHON cannot import dataplane, ray and torch: run \`make install\` first" >&2
  exit 2
fi
"$PYTHON" -c "import sys, torch, ray; print('python', sys.version.split()[0], '| torch', torch.__version__, '| CUDA', torch.version.cuda, '| ray', ray.__version__)"
if ! "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_check: torch sees no CUDA device here" >&2
  exit 3
fi
"$PYTHON" -c "import torch; print('device:', torch.cuda.get_device_name(0), '| devices:', torch.cuda.device_count())"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || true

status=0
echo "== gpu-marked tests"
timeout 200 "$PYTHON" -m pytest -q -m gpu -p no:cacheprovider tests/dataplane/test_api.py \
  tests/dataplane/test_columns.py tests/dataplane/test_pinning.py tests/dataplane/test_device_columns.py \
  tests/workers/test_trainer.py || status=1
echo "== bench.gpu: store put + get into another process's GPU vs pinned floor, naive copy, device-to-device"
mkdir -p bench/results
timeout 240 "$PYTHON" -m bench.gpu --json bench/results/gpu.json "$@" || status=1
if [ -n "${OUT:-}" ] && [ -f bench/results/gpu.json ]; then cp bench/results/gpu.json "$OUT/"; fi
echo "gpu_check: exit status $status"
exit $status
