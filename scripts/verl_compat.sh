#!/usr/bin/env bash
# Run verl's own CPU tests of `single_controller`, unchanged, against controlplane.
#
# verl 0.9.1 is installed without its dependencies into a temporary target; its
# `verl/single_controller` package is replaced there by a shim that re-exports controlplane's
# names, while `verl.protocol` (DataProto, DataProtoFuture, DataProtoConfig) stays verl's own.
# The one missing import of verl.protocol (transformers) is stubbed. Nothing is installed into
# the project's environment. Not part of CI: it needs PyPI (or VERL_WHEEL pointing at a wheel).
#
# Usage:   scripts/verl_compat.sh [extra pytest args]
# Env:     PYTHON (default .venv/bin/python), VERL_VERSION (0.9.1), VERL_WHEEL (a local wheel),
#          KEEP_TMP=1 keeps the temp dir for inspection, VERBOSE=1 prints pytest's whole output.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
VERL_VERSION="${VERL_VERSION:-0.9.1}"
TMP="$(mktemp -d -t verl_compat.XXXXXX)"
if [[ "${KEEP_TMP:-0}" != "1" ]]; then trap 'rm -rf "$TMP"' EXIT; else echo "temp dir: $TMP"; fi

TARGET="$TMP/site"
STUBS="$TMP/stubs"
mkdir -p "$TARGET" "$STUBS"

# 1. verl without dependencies, into a private target.
if [[ -n "${VERL_WHEEL:-}" ]]; then
  "$PYTHON" -m pip install --quiet --no-deps --target "$TARGET" "$VERL_WHEEL"
else
  "$PYTHON" -m pip install --quiet --no-deps --target "$TARGET" "verl==$VERL_VERSION"
fi

# verl.protocol imports omegaconf at module level (its only hard import besides torch/numpy).
"$PYTHON" -m pip install --quiet --target "$TARGET" "omegaconf>=2.3,<2.4"

# 2. stub modules verl.protocol imports but never uses on these paths.
cat > "$STUBS/transformers.py" <<'PY'
"""Stub: verl.utils.torch_functional imports names from transformers at module level."""
def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return type(name, (), {})
PY

# 3. verl.single_controller -> controlplane.
SC="$TARGET/verl/single_controller"
rm -rf "$SC"
mkdir -p "$SC/base" "$SC/ray"
cat > "$SC/__init__.py" <<'PY'
from verl.single_controller.base import *  # noqa: F401,F403
from verl.single_controller.base import __all__  # noqa: F401
PY
cat > "$SC/base/__init__.py" <<'PY'
from controlplane import ClassWithInitArgs, ResourcePool, Worker, WorkerGroup

__all__ = ["Worker", "WorkerGroup", "ClassWithInitArgs", "ResourcePool"]
PY
cat > "$SC/base/worker.py" <<'PY'
from controlplane.worker import *  # noqa: F401,F403
from controlplane.worker import Worker  # noqa: F401
PY
cat > "$SC/base/worker_group.py" <<'PY'
from controlplane import ClassWithInitArgs, ResourcePool, WorkerGroup  # noqa: F401
PY
cat > "$SC/base/decorator.py" <<'PY'
from controlplane.decorator import *  # noqa: F401,F403
from controlplane.decorator import MAGIC_ATTR, Dispatch, Execute, register  # noqa: F401
from controlplane.dispatch import make_nd_compute_dispatch_fn

# verl's name for the same function (its DataProto / TensorDict flavour).
make_nd_compute_dataproto_dispatch_fn = make_nd_compute_dispatch_fn
PY
cat > "$SC/ray/base.py" <<'PY'
import controlplane as _cp
from controlplane import *  # noqa: F401,F403

# Names verl has in ray/base.py that controlplane may or may not provide yet.
for _name in ("create_colocated_worker_raw_cls", "create_colocated_worker_cls_fused"):
    for _mod in ("controlplane", "controlplane.fused", "controlplane.colocate"):
        try:
            globals()[_name] = getattr(__import__(_mod, fromlist=[_name]), _name)
            break
        except (ImportError, AttributeError):
            continue
del _cp
PY
cat > "$SC/ray/__init__.py" <<'PY'
from verl.single_controller.ray.base import *  # noqa: F401,F403
PY

# 4. verl's CPU tests of single_controller, copied unchanged.
mkdir -p "$TMP/run/tests"
cp -r "$TARGET/tests/single_controller" "$TMP/run/tests/"
touch "$TMP/run/tests/__init__.py"
# Every CPU test of tests/single_controller except test_ray_utils_on_cpu.py, which tests
# verl.utils.ray_utils (not the single_controller API); the others need GPUs.
TESTS=(
  tests/single_controller/test_auto_padding_on_cpu.py
  tests/single_controller/test_decorator_on_cpu.py
  tests/single_controller/test_fused_workers_on_cpu.py
  tests/single_controller/test_get_set_dispatch_collect_cpu.py
  tests/single_controller/test_ray_local_envs_on_cpu.py
)

# RAY_ADDRESS=local: every ray.init() in verl's tests starts its own local instance instead of
# attaching to another Ray running on this machine (e.g. the project's own test session).
cd "$TMP/run"
# One pytest process per file, as verl's CI does: a failing test skips its ray.shutdown(), which
# would otherwise fail every later test of the session with "called ray.init twice".
status=0
for test in "${TESTS[@]}"; do
  log="$TMP/$(basename "$test" .py).log"
  set +e
  env PYTHONPATH="$STUBS:$TARGET:$ROOT${PYTHONPATH:+:$PYTHONPATH}" RAY_ADDRESS=local \
    RAY_USAGE_STATS_ENABLED=0 RAY_DEDUP_LOGS=0 \
    "$PYTHON" -m pytest -p no:cacheprovider --rootdir "$TMP/run" -q -rA "$test" "$@" >"$log" 2>&1
  rc=$?
  set -e
  [[ $rc -eq 0 ]] || status=1
  if [[ "${VERBOSE:-0}" == "1" ]]; then cat "$log"; else
    grep -E "^(PASSED|FAILED|ERROR) |^E   |[0-9]+ (passed|failed|error)" "$log" | cut -c1-240 || true
  fi
done
passed=$(cat "$TMP"/*.log | grep -c "^PASSED " || true)
failed=$(cat "$TMP"/*.log | grep -cE "^(FAILED|ERROR) " || true)
echo "verl $VERL_VERSION single_controller CPU tests against controlplane: $passed passed, $failed failed"
exit "$status"
