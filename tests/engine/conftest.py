"""One torch thread for the engine tests: the suite runs two test processes on two cores, and
small models' matmuls gain nothing from a second thread (they lose a lot when cores are busy)."""

import pytest
import torch


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
