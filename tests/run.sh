#!/usr/bin/env bash
# The test command of the README: installs into .venv if needed, then runs the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/install.sh
export OMP_NUM_THREADS=1
exec .venv/bin/python -m pytest tests "$@"
