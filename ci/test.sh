#!/usr/bin/env bash
# Set up a virtual environment with mxdb and its test tools, start a PostgreSQL
# server when this machine can (root with apt, or one already running), and
# run the test suite.  Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."

python3 -m venv .venv
# shellcheck disable=SC1091
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q -e ".[dev]"
# CPU torch and transformers for the integration tests (no GPU stack needed).
if ! python -m pip install -q "torch==2.13.0" "transformers==5.24.0"; then
  if [ "${MXDB_REQUIRE_TORCH:-0}" = 1 ]; then
    echo "torch/transformers could not be installed and MXDB_REQUIRE_TORCH=1" >&2
    exit 1
  fi
  echo "torch/transformers not installed: the integration tests will be skipped" >&2
fi

if [ -z "${MXDB_TEST_PG_URL:-}" ] && [ "${MXDB_SKIP_PG:-0}" != 1 ]; then
  if url=$(bash ci/postgres.sh | tail -n1) && [ -n "$url" ]; then
    export MXDB_TEST_PG_URL="$url"
  else
    echo "PostgreSQL could not be started: its tests will be skipped" >&2
  fi
fi
echo "PostgreSQL tests: ${MXDB_TEST_PG_URL:-skipped}" >&2

set +e
python -m pytest -q -p no:cacheprovider "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: that is a failure" >&2
  exit 1
fi
exit "$rc"
