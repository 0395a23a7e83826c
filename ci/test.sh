#!/usr/bin/env bash
# The test command (README): on a fresh Linux machine, installs everything the CPU tests need,
# builds flexium, and runs them. CI (.ci/run) calls exactly this.
set -euo pipefail
cd "$(dirname "$0")/.."

venv="${FLEXIUM_TEST_VENV:-.venv}"
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
# shellcheck disable=SC1091
. "$venv/bin/activate"

echo "== installing build tools, torch (CPU) and test dependencies"
python -m pip install -q --upgrade pip
python -m pip install -q "torch==2.13.0"
python -m pip install -q "scikit-build-core>=0.10" "pybind11>=2.12"
echo "== building flexium"
python -m pip install -q --no-build-isolation ".[test]"

echo "== CPU tests"
python -m pytest -q tests/unit "$@"
