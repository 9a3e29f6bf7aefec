# Two commands on a fresh machine:
#   make run    set up (first time: builds llama-cpp-python, 5-15 min on 2 cores) and run
#               the default workload on the bundled model
#   make test   set up and run the whole test suite (real model tests included)
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.edgeprefill-installed
WORKLOAD ?= workloads/assistant_plus_indexer.yaml
POLICY ?= static:64
RUN_ARGS ?=

.PHONY: setup run test clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) $(BIN)/pip install -e '.[llamacpp,report,test]'
	touch $@

run: setup
	$(BIN)/edgeprefill run --backend llamacpp $(WORKLOAD) --policy $(POLICY) $(RUN_ARGS)

test: setup
	$(BIN)/ruff check .
	$(BIN)/python -m pytest

clean:
	rm -rf $(VENV) results .pytest_cache
