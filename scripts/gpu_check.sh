#!/usr/bin/env bash
# Every GPU claim in one command (scripts/gpu_check.py --help): on a machine with one CUDA GPU, after
#   TORCH_INDEX=https://download.pytorch.org/whl/cu128 bash scripts/setup.sh test
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  echo "error: .venv is missing: set it up with TORCH_INDEX=https://download.pytorch.org/whl/cu128 bash scripts/setup.sh test" >&2
  exit 1
fi
exec .venv/bin/python scripts/gpu_check.py "$@"
