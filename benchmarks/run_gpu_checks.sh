#!/usr/bin/env bash
# The Triton kernels' GPU checks as one command (tests on CUDA, then the sampler's table): see benchmarks/gpu_kernels.py.
cd "$(dirname "$0")/.." && PYTHONUNBUFFERED=1 exec "${PYTHON:-$(if [ -x .venv/bin/python ]; then echo .venv/bin/python; else echo python3; fi)}" benchmarks/gpu_kernels.py "$@"
