#!/usr/bin/env bash
# A quick subset of the suite under the conditions a user's machine may have and CI's full run has
# not: RAY_TMPDIR set, RAY_ADDRESS set with another `ray start` cluster running, the fork server
# switched off (workers started the stock way), and a user that is not root. Each run is the same
# subset, on the same two xdist workers `make test` uses. Run by .ci/run after `make test`.
#
#   scripts/test_envs.sh            # every condition
#   scripts/test_envs.sh tmpdir     # one of: tmpdir, address, stock, user
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
SUBSET=(tests/forkserver tests/dataplane/test_delivery.py tests/dataplane/test_service.py
        tests/controlplane/test_detached.py)
PYTEST=(-m pytest -q -n 2 --dist loadfile -p no:cacheprovider -o addopts= "${SUBSET[@]}")

run() {  # run NAME [VAR=VALUE ...]: the subset with those variables
    local name=$1; shift
    echo "== $name: $*"
    env "$@" "$PY" "${PYTEST[@]}"
}

tmpdir() {
    local dir; dir=$(mktemp -d /tmp/rlt-user-tmp-XXXX)
    run "RAY_TMPDIR set (both workers share it)" RAY_TMPDIR="$dir"
    rm -rf "$dir"
}

address() {
    # Another cluster on this machine, started as a user starts one, and named by RAY_ADDRESS: the
    # suite must neither join it nor trip over its files and ports.
    local dir token=~/.ray/auth_token had_token=0; dir=$(mktemp -d /tmp/rlt-other-XXXX)
    [ -e "$token" ] && had_token=1  # `ray start` writes one, as it does for a user
    RAY_TMPDIR="$dir" .venv/bin/ray start --head --num-cpus 1 --include-dashboard=false \
        --disable-usage-stats >/dev/null
    local status=0
    run "RAY_ADDRESS set, another ray start cluster running" RAY_ADDRESS=127.0.0.1:6379 || status=$?
    RAY_TMPDIR="$dir" .venv/bin/ray stop --force >/dev/null 2>&1 || true
    rm -rf "$dir"
    [ $had_token = 1 ] || rm -f "$token"
    return $status
}

stock() {
    run "fork server off (RLT_FORK_SERVER=0)" RLT_FORK_SERVER=0
}

user() {
    # As a user that is not root. Its interpreter is the system's (the venv's may sit under root's
    # home), in a venv of its own that reads this venv's packages; the tree stays where it is, and
    # what the user may not write there (bytecode caches) it goes without, as on a shared checkout.
    if [ "$(id -u)" != 0 ]; then
        run "as $(id -un)"
        return
    fi
    local who=nobody dir site closed status=0
    site=$("$PY" -c "import sysconfig; print(sysconfig.get_path('purelib'))")
    # The user reads this tree and its venv where they are: a directory above them closed to other
    # users (a checkout under `mktemp -d`, mode 700) would leave it without pytest; say which one.
    closed=$(setpriv --reuid="$who" --regid="$(id -g "$who")" --clear-groups sh -c \
        'p=$1; c=; while [ "$p" != / ]; do [ -r "$p" ] && [ -x "$p" ] || c=$p; p=$(dirname "$p"); done; echo "$c"' \
        _ "$(realpath "$site")")
    if [ -n "$closed" ]; then
        echo "== as $who: cannot run: $closed is closed to other users, so $who cannot read this" \
            "checkout's venv ($site); open it (chmod o+rx) or clone the tree under a readable directory"
        return 1
    fi
    dir=$(mktemp -d /tmp/rlt-user-XXXX)
    /usr/bin/python3.11 -m venv --without-pip "$dir/venv"
    echo "import site; site.addsitedir('$site')" > "$dir/venv/lib/python3.11/site-packages/rlt.pth"
    mkdir -p "$dir/home"
    chown -R "$who" "$dir"
    echo "== as $who (uid $(id -u $who))"
    setpriv --reuid="$who" --regid="$(id -g "$who")" --clear-groups \
        env HOME="$dir/home" PATH="$dir/venv/bin:$PATH" "$dir/venv/bin/python" "${PYTEST[@]}" || status=$?
    rm -rf "$dir"
    return $status
}

for condition in "${@:-tmpdir address stock user}"; do
    for c in $condition; do "$c"; done
done
