#!/usr/bin/env bash
# The GPU check, for the day a GPU machine is at hand (about 2 minutes on an H200; every step has a
# timeout, the whole stays under 8): the `gpu`-marked tests, then `bench.gpu`: a CUDA tensor put by one
# process and read onto the GPU by another, against a plain device-to-host-to-device copy of the same
# bytes (ratio printed). Record its output in bench/RESULTS.md, the latest figures in bench/README.md.
#
# Needs the project's venv with a CUDA build of torch==2.13.0 (`make install`, then the CUDA wheel for
# the machine), or PYTHON naming an interpreter that imports the project: on a machine whose image has
# CUDA PyTorch but no package index, `source .whl/use.sh` sets that up (scripts/gpu_bundle.sh packs it).
# Exits 2 when the interpreter cannot import the project, 3 when torch sees no CUDA device.
#
# Usage:   scripts/gpu_check.sh [bench.gpu args, e.g. --bytes 1G]
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
cd "$ROOT"

if ! "$PYTHON" -c "import dataplane, ray, torch" 2>/dev/null; then
  echo "gpu_check: $PYTHON cannot import dataplane, ray and torch: run \`make install\` first" >&2
  exit 2
fi
if ! "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_check: torch sees no CUDA device here (torch $("$PYTHON" -c 'import torch; print(torch.__version__)'))" >&2
  exit 3
fi
"$PYTHON" -c "import torch; print('device:', torch.cuda.get_device_name(0), '| torch', torch.__version__)"

status=0
echo "== gpu-marked tests"
timeout 240 "$PYTHON" -m pytest -q -m gpu -p no:cacheprovider tests || status=1
echo "== bench.gpu: store put + get into another process's GPU vs device->host->device"
timeout 240 "$PYTHON" -m bench.gpu --json bench/results/gpu.json "$@" || status=1
exit $status
