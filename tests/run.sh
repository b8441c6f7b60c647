#!/usr/bin/env bash
# The test command: installs everything it needs into .venv, then lints and runs the suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
.venv/bin/ruff check .
.venv/bin/python -m pytest -q --durations=25 "$@"
