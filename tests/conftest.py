import os

# Triton reads TRITON_INTERPRET when a kernel is decorated: set it before anything imports triton, so the
# kernel tests run the Triton kernels on the CPU whatever module the run imports first.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

# under pytest-xdist (make test) the cores are shared by the worker processes
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // _WORKERS)))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True, scope="module")
def _fresh_dynamo():
    """Each test file starts with no compiled frames: the files a process runs before it (which pytest-xdist
    decides) cannot push a shared frame past Dynamo's recompile limit or turn a compile into a recompile."""
    torch._dynamo.reset()
