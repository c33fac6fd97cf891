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


def pytest_collection_modifyitems(config, items):
    skip_cuda = pytest.mark.skip(reason="needs a CUDA GPU (run `make gpu-check` on the GPU machine)")
    for item in items:
        if "cuda" in item.keywords and not cuda_available:
            item.add_marker(skip_cuda)
