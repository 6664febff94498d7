import os

# Triton reads TRITON_INTERPRET when a kernel is decorated: set it before anything imports triton, so the
# kernel tests run the Triton kernels on the CPU whatever module the run imports first.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
