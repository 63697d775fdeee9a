import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models gain nothing from more threads, and idle OpenMP threads slow a shared machine down."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
