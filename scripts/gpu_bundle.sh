#!/usr/bin/env bash
# Packs what scripts/gpu_check.sh needs beyond a CUDA machine's own Python stack (PyTorch, NumPy,
# pyarrow, psutil, pytest), for a GPU machine that cannot reach a package index: the project's pinned
# Ray, tensordict, pyzmq, msgspec and isal, and the few packages they need that such images lack, as
# wheels for CPython PY (3.12) on x86-64. Ray's wheel (79 MB) is carried unpacked and trimmed of what no
# check uses (Java jars, RLlib, Serve, Tune, Train, Data, the dashboard's web client), xz-compressed:
# about 30 MB in all. Run here, where pip reaches an index; copy DIR to the GPU machine; there:
#
#     source DIR/use.sh && scripts/gpu_check.sh
#
# Usage:   scripts/gpu_bundle.sh [DIR (.whl)] [PY (3.12)]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DIR="${1:-$ROOT/.whl}"
PY="${2:-3.12}"
pin() { grep -oE "\"$1==[^\"]+\"" "$ROOT/pyproject.toml" | head -1 | tr -d '"'; }

mkdir -p "$DIR"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
for req in "$(pin ray)" "$(pin tensordict)" "$(pin pyzmq)" "$(pin msgspec)" "$(pin isal)" \
  jsonschema jsonschema-specifications referencing rpds-py pyvers; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PY" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_26_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$work" "$req" 2>&1 | grep -v '^WARNING: Location' || true
done
ray_whl=("$work"/ray-*.whl)
mkdir "$work/ray"
python3 -m zipfile -e "${ray_whl[0]}" "$work/ray"
chmod -R u+rwX,go+rX "$work/ray" && find "$work/ray/ray/core/src" -type f -exec chmod +x {} +
rm -rf "$work/ray/ray/"{jars,rllib,llm,serve,tune,train,data,dashboard/client/build} "${ray_whl[0]}"
tar -C "$work/ray" -cf - . | xz -T0 -6 >"$DIR/ray.tar.xz"
mv "$work"/*.whl "$DIR/"
cat >"$DIR/use.sh" <<'USE'
# Sourced on the GPU machine: unpacks the bundle beside it into /tmp/site and puts it, then the
# checkout, first on PYTHONPATH; scripts/gpu_check.sh then runs with the machine's python3.
_bundle="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
mkdir -p /tmp/site && tar -xJf "$_bundle/ray.tar.xz" -C /tmp/site &&
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$_bundle"/*.whl &&
  export PYTHONPATH="/tmp/site:$(cd "$_bundle/.." && pwd)${PYTHONPATH:+:$PYTHONPATH}" PYTHON=python3
USE
du -sh "$DIR"
