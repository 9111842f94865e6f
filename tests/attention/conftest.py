"""Make `prefixserve` importable from the source tree when it is not installed, and run
these tests' tiny tensor ops on one thread (see `one_thread`)."""

import importlib.util
import pathlib
import sys

import pytest
import torch

if importlib.util.find_spec("prefixserve") is None:
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "src"))


@pytest.fixture(autouse=True)
def one_thread():
    """The ops here are small: on a shared 2-core machine, intra-op threads spin against
    each other and other processes (measured: 87 s with 2 threads vs 5 s with one)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
