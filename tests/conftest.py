import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

cuda_available = False
try:
    import torch

    cuda_available = torch.cuda.is_available()
except Exception:  # pragma: no cover
    pass


@pytest.fixture(scope="module")
def one_intra_op_thread():
    """1 intra-op thread for a module (a test may set more, as the ops' determinism tests do): small
    tensors on a shared 2-core machine, where extra threads only contend. The ops test modules use it."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


def pytest_collection_modifyitems(config, items):
    skip_cuda = pytest.mark.skip(reason="needs a CUDA GPU (run `make gpu-check` on the GPU machine)")
    for item in items:
        if "cuda" in item.keywords and not cuda_available:
            item.add_marker(skip_cuda)
