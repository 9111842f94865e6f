"""Shared fixtures: the real embedded model, its tokenizer, real prompts, and the transformers
reference outputs (computed once per session)."""

from __future__ import annotations

import os
import sys

# The Triton interpreter multiplies tiles with numpy, i.e. OpenBLAS, and the deterministic-mode
# tests (test_linear, test_triton_cells) need a row's bits not to depend on its place in the
# tile, as on the GPU's matrix units. OpenBLAS's Haswell sgemm kernel (detected on AMD Zen, and
# pinned by OPENBLAS_CORETYPE=Haswell on some of these machines) sums the rows of a register
# block in different orders: a row alone and the same row 7th in a tile differ in the last bit.
# Its Sandybridge kernel (AVX: any x86-64 CPU of the last decade) does not, nor does SkylakeX.
# OpenBLAS reads this once, when numpy first loads it. A GPU run of the kernel tests
# (PREFIXSERVE_TRITON_TEST_DEVICE=cuda) multiplies on the GPU, and on the lent GPU's image numpy
# is already loaded when this file runs (by start-up code of the image, not traced further).
assert "numpy" not in sys.modules or os.environ.get("PREFIXSERVE_TRITON_TEST_DEVICE", "cpu") != "cpu", \
    "numpy loaded before tests/conftest.py: OPENBLAS_CORETYPE is too late"
os.environ["OPENBLAS_CORETYPE"] = "Sandybridge"

import pytest  # noqa: E402
import torch  # noqa: E402

from prefixserve import LLM  # noqa: E402

# `make test` runs the tests in pytest-xdist workers (two on CI's two cores): each worker takes
# its share of torch's threads (as a tensor-parallel worker does), so that two workers' GEMMs do
# not oversubscribe the cores.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    torch.set_num_threads(max(1, torch.get_num_threads() // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups (`--dist loadgroup`)
def pytest_collection_modifyitems(items):
    """A module's tests run on one worker, in order, so its module-scoped servers and engines are
    built once; the Ray tests all run on one worker, one at a time (each starts a local cluster)."""
    for item in items:
        module = item.nodeid.split("::")[0]
        item.add_marker(pytest.mark.xdist_group("serve_ray" if module.startswith("tests/serve_ray/") else module))


@pytest.fixture(scope="session")
def make_llm():
    """LLM instances on the embedded model, cached by their arguments (each load is seconds)."""
    cache = {}

    def make(**kwargs):
        kwargs.setdefault("kv_cache_memory", 256 << 20)
        key = tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in kwargs.items()))
        if key not in cache:
            if len(cache) >= 6:
                cache.pop(next(iter(cache)))
            cache[key] = LLM(**kwargs)
        return cache[key]
    return make


@pytest.fixture(scope="session")
def tokenizer(make_llm):
    return make_llm().get_tokenizer()


@pytest.fixture(scope="session")
def sharegpt_questions():
    from prefixserve.bench.datasets import sharegpt_conversations
    return [q for q, _ in sharegpt_conversations(64, seed=0)]

