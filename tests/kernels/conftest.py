"""Without a GPU, Triton kernels run in Triton's CPU interpreter. The flag must be set before
``triton`` is first imported anywhere in the test process, so it is set at collection time."""

import os
from collections.abc import Iterator

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    """Kernel tests use small tensors and many ops: one thread is as fast, and far faster on a
    busy machine, where a second OpenMP thread waits for a core at every op."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
