import socket
from pathlib import Path

import datasets
import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models gain nothing from more threads, and idle OpenMP threads slow a shared machine down."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def datasets_cache(tmp_path_factory) -> Path:
    """A datasets cache of the test module's own (subprocesses get it through HF_DATASETS_CACHE)."""
    cache = tmp_path_factory.mktemp("datasets-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(datasets.config, "HF_DATASETS_CACHE", str(cache))
        yield cache


@pytest.fixture
def free_port() -> int:
    """A local TCP port that nothing listens on, for the processes of a launch to meet at."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
