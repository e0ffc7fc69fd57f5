#!/usr/bin/env bash
# Every GPU claim in one command (scripts/gpu_check.py --help): on a machine with one CUDA GPU, after
#   TORCH_INDEX=https://download.pytorch.org/whl/cu128 bash scripts/setup.sh test
# or, where a Python with a CUDA torch and the project's requirements is already there (no network to set up
# .venv): PYTHON=python3 bash scripts/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -n "${PYTHON:-}" ]; then
  if ! command -v "$PYTHON" > /dev/null; then
    echo "error: PYTHON=$PYTHON is not a command" >&2
    exit 1
  fi
  if [ "$("$PYTHON" -c 'import sys; print(sys.version_info[0])' 2> /dev/null)" != 3 ]; then
    echo "error: PYTHON=$PYTHON is not a Python 3" >&2
    exit 1
  fi
elif [ ! -x .venv/bin/python ]; then
  echo "error: .venv is missing: set it up with TORCH_INDEX=https://download.pytorch.org/whl/cu128 bash scripts/setup.sh test (or name a Python that has CUDA torch: PYTHON=python3)" >&2
  exit 1
fi
exec "${PYTHON:-.venv/bin/python}" scripts/gpu_check.py "$@"
