#!/usr/bin/env bash
# The test command of the README: installs into .venv if needed, then runs the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/install.sh
export OMP_NUM_THREADS=1
# Every rank is a fresh interpreter: compile the package once, so none recompiles it where
# PYTHONDONTWRITEBYTECODE is set (it is on some CI images; about 0.6 s a process otherwise).
.venv/bin/python -m compileall -q megatron_chimera tools tests > /dev/null
exec .venv/bin/python -m pytest tests "$@"
