#!/usr/bin/env bash
# The GPU checks as one command: the engine's serving table with --serving (gpu_serving.py),
# the weight-only linears' table with --quant (gpu_quant.py), then the Triton sampler's table
# and tests/kernels on CUDA (gpu_kernels.py, which takes the other arguments). Numbers first:
# they are what the device time is for. The exit status is the first failure's.
cd "$(dirname "$0")/.." || exit 2
PY="${PYTHON:-$(if [ -x .venv/bin/python ]; then echo .venv/bin/python; else echo python3; fi)}"
export PYTHONUNBUFFERED=1
serving=0 quant=0 rest=()
for arg in "$@"; do
  case "$arg" in
    --serving) serving=1 ;;
    --quant) quant=1 ;;
    *) rest+=("$arg") ;;
  esac
done
status=0
if [ "$serving" = 1 ]; then "$PY" benchmarks/gpu_serving.py || status=${status/#0/$?}; fi
if [ "$quant" = 1 ]; then "$PY" benchmarks/gpu_quant.py || status=${status/#0/$?}; fi
"$PY" benchmarks/gpu_kernels.py "${rest[@]}" || status=${status/#0/$?}
exit "$status"
