import pytest
import torch


@pytest.fixture
def one_thread():
    """Tiny tensors: one thread is faster than two, and leaves the other core to other work."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
