#!/usr/bin/env bash
# Sets up layerbus in ./.venv (idempotent; about a minute the first time on a fresh machine).
#
#   ./setup.sh            layerbus and its dependencies
#   ./setup.sh --test     the same plus the test dependencies (pytest, psycopg)
#
# torch: a plain `torch` requirement pulls a multi-GB CUDA build on Linux, so torch is installed
# first and on its own. By default that is the CPU build pinned below. To use your own build (for
# example a CUDA one), install it into .venv before running this script, or set LAYERBUS_TORCH to a
# pip requirement (LAYERBUS_TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128");
# an already importable torch is never replaced.
set -euo pipefail
cd "$(dirname "$0")"

PYTHON=${PYTHON:-python3}
EXTRAS=""
[ "${1:-}" = "--test" ] && EXTRAS="[test]"

if [ ! -x .venv/bin/python ]; then
    echo "setup: creating .venv with $($PYTHON --version)" >&2
    "$PYTHON" -m venv .venv
fi
PIP=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)

if .venv/bin/python -c "import torch" 2>/dev/null; then
    echo "setup: keeping torch $(.venv/bin/python -c 'import torch; print(torch.__version__)')" >&2
else
    TORCH_SPEC=${LAYERBUS_TORCH:-torch==2.13.0}
    echo "setup: installing $TORCH_SPEC (set LAYERBUS_TORCH to choose another build)" >&2
    # shellcheck disable=SC2086  # the spec may carry pip options such as --index-url
    "${PIP[@]}" $TORCH_SPEC
fi

echo "setup: installing layerbus$EXTRAS" >&2
"${PIP[@]}" -e ".$EXTRAS"
echo "setup: done; the CLI is .venv/bin/layerbus" >&2
