#!/usr/bin/env bash
# Run verl 0.9.1's TransferQueue code and TransferQueue 0.1.11's own tests of its public classes,
# unchanged, against `dataplane.tq` and, for comparison, against the real TransferQueue 0.1.11.
#
# What runs (each file in its own pytest process, as both projects' CIs do):
#   * TransferQueue 0.1.11's tests of its public classes, from its released wheel: metadata,
#     samplers, streaming dataset, the KV interface, the low-level lifecycle, checkpoints.
#   * verl's CPU tests of its TransferQueue code (the v1 ReplayBuffer, trainer_base's replay-buffer
#     wiring, the tqbridge event loop), taken from verl's git history (VERL_GIT at VERL_TESTS_REV:
#     the newest main commit mirrored; verl's wheel ships none).
#   * this project's drivers of verl 0.9.1's code (scripts/tq_compat/): tqbridge on sync and async
#     worker methods across a verl RayWorkerGroup (verl's own single_controller, unchanged), the
#     reads of trainer_base.py on the layouts TransferQueue returns, and its submit / re-issue
#     sequence around a checkpoint.
# verl 0.9.1 and TransferQueue 0.1.11 are installed --no-deps into a temporary target; verl's heavy
# imports that these paths never use (transformers, datasets, ...) are stubbed. For the
# `dataplane` run, `transfer_queue` is a shim package that only maps names and submodules onto
# `dataplane.tq`; for the `transferqueue` run it is the real package. Nothing is installed into the
# project's environment. Not part of CI: it needs PyPI and takes minutes (`make compat`).
#
# Usage:   scripts/tq_compat.sh [extra pytest args]
# Env:     PYTHON (default .venv/bin/python); IMPLS ("dataplane transferqueue" by default, or one);
#          VERL_GIT (a verl git dir; default the local mirror), VERL_TESTS_REV (commit of verl's tests);
#          FILES (space-separated subset of the test files below, by basename);
#          TQ_COMPAT_DIR (reuse this dir for the installs; default a temp dir removed at exit);
#          VERBOSE=1 prints pytest's whole output; PER_FILE_TIMEOUT (s, default 1500).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
IMPLS="${IMPLS:-dataplane transferqueue}"
VERL_VERSION=0.9.1
TQ_VERSION=0.1.11
VERL_GIT="${VERL_GIT:-/work/.mirror/verl-project+verl/repo}"
VERL_TESTS_REV="${VERL_TESTS_REV:-1dda039b9c6311889a9c9a26040677e1254814f9}"
PER_FILE_TIMEOUT="${PER_FILE_TIMEOUT:-1500}"
# TransferQueue's tests need more CPUs than a small machine has (a controller and two storage units
# of one CPU each): each Ray they start advertises 16, however many cores there are.
RAY_RESOURCES="${RAY_OVERRIDE_RESOURCES:-{\"CPU\": 16\}}"

if [[ -n "${TQ_COMPAT_DIR:-}" ]]; then
  TMP="$TQ_COMPAT_DIR"
  mkdir -p "$TMP"
else
  TMP="$(mktemp -d -t tq_compat.XXXXXX)"
  trap 'rm -rf "$TMP"' EXIT
fi
PKGS="$TMP/pkgs"        # verl (no deps) and small real dependencies
REAL="$TMP/real"        # the real transfer_queue package
SHIM="$TMP/shim"        # transfer_queue -> dataplane.tq
STUBS="$TMP/stubs"      # modules verl imports but these paths never use
RUN="$TMP/run"
pip_target() { "$PYTHON" -m pip install --quiet --disable-pip-version-check --target "$@" 2>&1 | grep -v WARNING || true; }

# 1. verl and TransferQueue without their dependencies; the few small dependencies the tested
#    paths really use; pytest plugins TransferQueue's tests use.
if [[ ! -f "$TMP/.installed" ]]; then
  rm -rf "$PKGS" "$REAL" "$TMP/wheels"
  mkdir -p "$PKGS" "$REAL" "$TMP/wheels"
  "$PYTHON" -m pip download --quiet --disable-pip-version-check --no-deps -d "$TMP/wheels" \
    "verl==$VERL_VERSION" "transferqueue==$TQ_VERSION" 2>&1 | grep -v WARNING || true
  pip_target "$TMP/verl_site" --no-deps "$TMP"/wheels/verl-*.whl
  mv "$TMP/verl_site/verl" "$PKGS/"
  pip_target "$TMP/tq_site" --no-deps "$TMP"/wheels/transferqueue-*.whl
  mv "$TMP/tq_site/transfer_queue" "$REAL/"
  mkdir -p "$TMP/tq_tests" && cp -r "$TMP/tq_site/tests/." "$TMP/tq_tests/"
  rm -rf "$TMP/verl_site" "$TMP/tq_site"
  pip_target "$PKGS" "omegaconf>=2.3,<2.4" "prometheus_client>=0.20" pydantic pillow codetiming cachetools pandas
  pip_target "$PKGS" --no-deps hydra-core pytest-asyncio pytest-mock
  # what the project's environment has already (torch is built against its numpy): use that one
  rm -rf "$PKGS"/numpy "$PKGS"/numpy-* "$PKGS"/numpy.libs
  touch "$TMP/.installed"
fi

# 2. stubs: a module whose every attribute is an empty class (verl imports names from these at
#    module level; the paths run here never call them). Version 0.0.0, so that code probing for
#    them (pyarrow looks for pandas) finds them too old to use.
rm -rf "$STUBS" && mkdir -p "$STUBS"
for mod in transformers transformers.utils transformers.modeling_outputs transformers.trainer_pt_utils \
  transformers.modeling_flash_attention_utils transformers.modeling_utils transformers.dynamic_module_utils \
  datasets orjson uvicorn fastapi regex aiohttp accelerate torchdata torchdata.stateful_dataloader \
  peft peft.utils peft.utils.save_and_load; do
  d="$STUBS/${mod//.//}"
  mkdir -p "$d"
  cat > "$d/__init__.py" <<'PY'
__version__ = "0.0.0"


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return type(name, (), {})
PY
done

# 3. the shim: `transfer_queue` and each of its submodules are dataplane.tq's, under both names
#    (one module object each, so classes and module state are shared).
rm -rf "$SHIM" && mkdir -p "$SHIM/transfer_queue"
cat > "$SHIM/transfer_queue/__init__.py" <<'PY'
"""transfer_queue -> dataplane.tq: names and submodules only."""
import importlib
import pkgutil
import sys

import dataplane.tq as _tq

for _info in pkgutil.walk_packages(_tq.__path__, "dataplane.tq."):
    _mod = importlib.import_module(_info.name)
    sys.modules["transfer_queue" + _info.name[len("dataplane.tq"):]] = _mod
sys.modules["transfer_queue"] = _tq
PY

# 4. the test files, unchanged.
rm -rf "$RUN" && mkdir -p "$RUN/tests/e2e" "$RUN/tests/verl" "$RUN/tests/own"
for f in test_metadata.py test_samplers.py test_streaming_dataset.py; do cp "$TMP/tq_tests/$f" "$RUN/tests/"; done
for f in test_kv_interface_e2e.py test_e2e_lifecycle_consistency.py test_checkpoint_e2e.py; do
  cp "$TMP/tq_tests/e2e/$f" "$RUN/tests/e2e/"
done
# verl's test of the re-issue sequence (test_reissue_inflight_on_cpu.py) is not here: every version
# of it reads trainer_base._tq_supports_checkpoint, which 0.9.1 does not have (it does not import);
# scripts/tq_compat/test_verl_trainer_reissue.py drives 0.9.1's methods instead. Nor is
# test_separate_async_step_switch_on_cpu.py: written for a later trainer, 14 of its 23 tests fail on
# 0.9.1 whichever queue is under it.
VERL_TESTS=(
  tests/utils/test_transferqueue_utils_on_cpu.py
  tests/trainer/ppo/v1/test_replay_buffer_on_cpu.py
  tests/trainer/ppo/v1/test_trainer_base_on_cpu.py
  tests/trainer/ppo/v1/test_agent_loop_tq_on_cpu.py
)
if git -C "$VERL_GIT" cat-file -e "$VERL_TESTS_REV^{commit}" 2>/dev/null; then
  for f in "${VERL_TESTS[@]}"; do git -C "$VERL_GIT" show "$VERL_TESTS_REV:$f" > "$RUN/tests/verl/$(basename "$f")"; done
else
  echo "verl's tests: no commit $VERL_TESTS_REV in $VERL_GIT; running without them" >&2
fi
cp "$ROOT"/scripts/tq_compat/test_*.py "$ROOT"/scripts/tq_compat/conftest.py "$RUN/tests/own/"
# a package, so that Ray workers import the worker classes defined there (tests.own.<file>)
touch "$RUN/tests/__init__.py" "$RUN/tests/own/__init__.py"

ALL=()
while IFS= read -r f; do ALL+=("${f#"$RUN"/}"); done < <(find "$RUN/tests" -name 'test_*.py' | sort)
if [[ -n "${FILES:-}" ]]; then
  SEL=()
  for f in "${ALL[@]}"; do for want in $FILES; do [[ "$(basename "$f")" == "$want" ]] && SEL+=("$f"); done; done
  ALL=("${SEL[@]}")
fi

# 5. run every file once per implementation. RAY_ADDRESS=local: each test's ray.init() starts its
#    own Ray instead of joining another one on this machine.
cd "$RUN"
summary=()
status=0
for impl in $IMPLS; do
  case "$impl" in
    dataplane) TQPATH="$SHIM:$ROOT" ;;
    transferqueue) TQPATH="$REAL" ;;
    *) echo "unknown implementation $impl (dataplane | transferqueue)" >&2; exit 2 ;;
  esac
  mkdir -p "$TMP/logs/$impl"
  passed=0 failed=0 skipped=0 broken=0
  for test in "${ALL[@]}"; do
    log="$TMP/logs/$impl/$(basename "$test" .py).log"
    set +e
    env PYTHONPATH="$STUBS:$TQPATH:$PKGS:$RUN${PYTHONPATH:+:$PYTHONPATH}" RAY_ADDRESS=local \
      RAY_USAGE_STATS_ENABLED=0 RAY_DEDUP_LOGS=0 TQ_COMPAT_IMPL="$impl" \
      RAY_OVERRIDE_RESOURCES="$RAY_RESOURCES" \
      timeout "$PER_FILE_TIMEOUT" "$PYTHON" -m pytest -p no:cacheprovider --rootdir "$RUN" -q -rA \
      -o timeout=240 "$test" "$@" >"$log" 2>&1
    rc=$?
    set -e
    p=$(grep -c "^PASSED " "$log" || true)
    f=$(grep -cE "^(FAILED|ERROR) " "$log" || true)
    s=$(grep -c "^SKIPPED " "$log" || true)
    b=0
    if grep -qE "^ERROR collecting|ImportError while importing|errors? during collection" "$log"; then b=1; fi
    note=""
    if [[ $b -eq 1 ]]; then note="  DOES NOT IMPORT"; fi
    if ! grep -qE "[0-9]+ (passed|failed|error|skipped).* in [0-9.]+s|no tests ran" "$log"; then
      f=$((f + 1)) # it died before pytest's summary (timeout, crash): one failure at least
      note="  DIED (exit $rc)"
    fi
    passed=$((passed + p)) failed=$((failed + f)) skipped=$((skipped + s)) broken=$((broken + b))
    printf '%-14s %-48s %4d passed %4d failed %3d skipped%s\n' "$impl" "$(basename "$test")" "$p" "$f" "$s" "$note"
    if [[ "${VERBOSE:-0}" == "1" ]]; then cat "$log"; else
      grep -E "^(FAILED|ERROR) " "$log" | cut -c1-220 || true
    fi
  done
  summary+=("$impl: $passed passed, $failed failed, $skipped skipped, $broken files do not import")
  [[ "$impl" == dataplane && ( $failed -gt 0 || $broken -gt 0 ) ]] && status=1
done
echo "logs: $TMP/logs"
for line in "${summary[@]}"; do echo "$line"; done
exit "$status"
