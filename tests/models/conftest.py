"""The model tests run at tiny sizes, where a second intra-op thread only adds synchronisation:
under a loaded 2-core machine the spinning threads made this directory 40x slower. One thread
per test, restored afterwards so other directories keep their setting."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
