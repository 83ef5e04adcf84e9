#!/usr/bin/env bash
# The project's two commands (README Quickstart):
#   ./dev.sh demo [ARGS]   set up .venv and run the demo under the jobsup daemon
#   ./dev.sh test [ARGS]   set up .venv and run lint, type checks and the test suite
#                          (ARGS go to pytest: -m "not slow" runs the fast tier only)
# Setup is idempotent: the venv is (re)installed only when pyproject.toml,
# constraints.txt or requirements-interop.txt changed. Nothing needs to be installed by hand.
set -euo pipefail
cd "$(dirname "$0")"

find_python() {
    for candidate in "${PYTHON:-}" python3.11 python3; do
        [ -n "$candidate" ] || continue
        if command -v "$candidate" >/dev/null 2>&1 &&
            "$candidate" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
            echo "$candidate"
            return
        fi
    done
    echo "error: Python >= 3.11 is needed (set PYTHON=/path/to/python3.11)" >&2
    exit 1
}

setup_venv() {
    local stamp want
    want=$(cat pyproject.toml constraints.txt requirements-interop.txt | sha256sum | cut -d' ' -f1)
    stamp=.venv/.jobsup-setup
    if [ -x .venv/bin/python ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
        return
    fi
    [ -x .venv/bin/python ] || "$(find_python)" -m venv .venv
    echo "setting up .venv (pip install -e '.[dev,workers,postgresql]') ..." >&2
    # constraints.txt pins torch to the release whose CPU build pip finds locally
    .venv/bin/python -m pip install --quiet --disable-pip-version-check \
        -c constraints.txt -e '.[dev,workers,postgresql]'
    # SpecForge and speculators for the interop tests, without their dependencies: their
    # torch/transformers pins would replace ours (requirements-interop.txt says which)
    .venv/bin/python -m pip install --quiet --disable-pip-version-check --no-deps \
        -r requirements-interop.txt
    echo "$want" >"$stamp"
}

system_packages() {
    # promtool and amtool for the dashboard and alert-rule tests, libfaketime for the
    # clock-step tests, tmux for the live-table test, chromium for the status page's
    # browser tests, postgresql for the store, API and restart tests against PostgreSQL
    # (the tests start their own server from its binaries), slurm-wlm and munge for the
    # SLURM backend's one-node cluster (tests/slurm_cluster.py) (Debian packages)
    command -v promtool >/dev/null 2>&1 && command -v amtool >/dev/null 2>&1 &&
        dpkg -s libfaketime >/dev/null 2>&1 && command -v tmux >/dev/null 2>&1 &&
        command -v chromium >/dev/null 2>&1 &&
        compgen -G '/usr/lib/postgresql/*/bin/postgres' >/dev/null &&
        dpkg -s slurm-wlm munge >/dev/null 2>&1 && return
    local sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    echo "installing Debian packages prometheus, prometheus-alertmanager, libfaketime," \
        "tmux, chromium, postgresql, slurm-wlm, munge ..." >&2
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends \
        prometheus prometheus-alertmanager libfaketime tmux chromium postgresql slurm-wlm \
        munge >/dev/null
}

cmd=${1:-}
[ $# -gt 0 ] && shift
case "$cmd" in
demo)
    setup_venv
    exec .venv/bin/jobsup demo "$@"
    ;;
test)
    setup_venv
    system_packages
    .venv/bin/ruff check .
    .venv/bin/mypy
    set +e
    # 3 workers, one test file each at a time: most tests wait on real processes; the
    # files start longest first (tests/file_order.py), not by their number of tests
    .venv/bin/pytest -n 3 --dist loadfile --no-loadscope-reorder "$@"
    rc=$?
    set -e
    if [ "$rc" -eq 5 ]; then
        echo "error: pytest collected no tests; that is a failure here" >&2
        exit 1
    fi
    exit "$rc"
    ;;
*)
    echo "usage: ./dev.sh demo [ARGS] | ./dev.sh test [PYTEST ARGS]" >&2
    exit 2
    ;;
esac
