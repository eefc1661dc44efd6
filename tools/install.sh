#!/usr/bin/env bash
# Create .venv (if missing) and install megatron_chimera into it: torch==2.13.0 first, then the rest.
# Usage: bash tools/install.sh [--fresh]     (--fresh removes an existing .venv first)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ "${1:-}" = "--fresh" ]; then rm -rf .venv; fi
if [ ! -x .venv/bin/python ] || ! .venv/bin/python -c "import megatron_chimera, torch, transformers, safetensors, wandb" 2>/dev/null; then
  echo "[install] creating .venv (or completing it): torch==2.13.0, then megatron_chimera[test]"
  "$PYTHON" -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q torch==2.13.0
  .venv/bin/python -m pip install -q -e ".[test]"
fi
