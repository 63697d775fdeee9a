import os
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

import datasets
import pytest
import torch

# pytest-xdist runs one process per core: each must compute on one thread (and so must the commands the tests start,
# through OMP_NUM_THREADS), or their OpenMP threads outnumber the cores and wait on each other. On two busy cores that
# made a 10 s test take 150 s
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
_threads_per_worker = max(1, (os.cpu_count() or 1) // _workers)
os.environ["OMP_NUM_THREADS"] = str(_threads_per_worker)
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")  # no pool of compiler processes beside the workers
torch.set_num_threads(_threads_per_worker)


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


@pytest.fixture
def lock_held_elsewhere() -> Callable[[Path], AbstractContextManager[int]]:
    """`with lock_held_elsewhere(lock) as pid:` another live process holds the lock file `lock` (as a second attnres
    process would) until the block ends."""

    @contextmanager
    def held(lock: Path) -> Iterator[int]:
        holder = (
            "import pathlib, sys\n"
            "from attnres.folders import lock_held\n"
            "with lock_held(pathlib.Path(sys.argv[1])) as owner:\n"
            "    print(owner, flush=True)\n"
            "    sys.stdin.read()\n"
        )
        process = subprocess.Popen(
            [sys.executable, "-c", holder, str(lock)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        try:
            assert process.stdout.readline().strip() == "None", "the lock was not free"
            yield process.pid
        finally:
            process.stdin.close()  # the holder reads to the end, releases the lock and exits
            process.wait(timeout=60)

    return held


@pytest.fixture
def fla_reference(monkeypatch) -> Callable:
    """The `fla` backend with flash-linear-attention's own reference op, `fla.ops.attnres.naive.naive_attnres`, in
    place of its Triton kernel (which needs a GPU), on whatever device: what the backend hands fla and reads back is
    checked against an implementation the project did not write. Loaded from its file, as importing `fla.ops` loads
    Triton. -> the reference op"""
    import importlib.util

    from attnres import depth_mix_backends

    package = importlib.util.find_spec("fla")
    assert package is not None, "the test extras install fla-core, whose reference op this fixture loads"
    path = Path(package.submodule_search_locations[0]) / "ops" / "attnres" / "naive.py"
    spec = importlib.util.spec_from_file_location("fla_attnres_naive", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(depth_mix_backends, "fused_attnres_for", lambda device: module.naive_attnres)
    return module.naive_attnres
