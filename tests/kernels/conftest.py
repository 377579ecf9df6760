"""Without a GPU, Triton kernels run in Triton's CPU interpreter. The flag must be set before
``triton`` is first imported anywhere in the test process, so it is set at collection time."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
