import os

import pytest
import torch

# The suite's models are tiny and CI has 2 cores: intra-op threads only contend with each other (and
# with the subprocesses some tests start, which inherit OMP_NUM_THREADS). One thread is faster and
# makes timings independent of the core count.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
