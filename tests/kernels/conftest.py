"""Triton kernels run in Triton's CPU interpreter here (no GPU): the flag must be set before
``triton`` is first imported anywhere in the test process, so it is set at collection time."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
