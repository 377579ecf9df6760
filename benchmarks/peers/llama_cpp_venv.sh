#!/usr/bin/env bash
# Builds the llama.cpp peer for benchmarks/bench_quant.py in its OWN venv
# (.cache/peers/llama-cpp-venv), never the project's: llama-cpp-python compiles llama.cpp from
# source with cmake (about 10-15 minutes on 2 cores). Idempotent: exits at once when the venv
# already imports llama_cpp.
#
#     bash benchmarks/peers/llama_cpp_venv.sh
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
venv="$repo/.cache/peers/llama-cpp-venv"
if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c "import llama_cpp" 2>/dev/null; then
    echo "llama-cpp-python already in $venv"
    exit 0
fi
mkdir -p "$(dirname "$venv")"
python3 -m venv "$venv"
"$venv/bin/pip" install --quiet --upgrade pip
# A CPU build for this machine's own instruction set; two compile jobs on a 2-core machine.
export CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=ON}"
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-2}"
"$venv/bin/pip" install --no-cache-dir --verbose llama-cpp-python
"$venv/bin/python" -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__)"
