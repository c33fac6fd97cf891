# fastcoll: `make test` and `make bench` set everything up on a fresh machine.
PYTHON ?= python3
VENV   ?= .venv
VPY    := $(VENV)/bin/python
TORCH_CPU  := torch==2.13.0
TORCH_CUDA := torch==2.14.1
# The documentation site (`make docs`); none of them depends on torch.
DOCS_DEPS := mkdocs==1.6.1 mkdocs-material==9.8.2 "mkdocstrings[python]==1.0.8" mkdocstrings-python==2.0.11
DEPS   := numpy pybind11 ninja "setuptools>=77" wheel pytest pytest-timeout hypothesis expecttest rich matplotlib ruff==0.17.6 \
  $(DOCS_DEPS)
EXTRAS := mmengine==0.10.7 pytorch-lightning==2.6.6 lightning==2.6.6
# Hugging Face, for tests/test_integrations_hf.py: installed beside the pinned CPU torch, on a line of their own
# so that a failure skips only those tests.
HF_EXTRAS := accelerate==1.15.0 transformers==5.24.0 huggingface_hub==2.4.0
CSRC   := $(shell find csrc -name '*.cpp' -o -name '*.cu' -o -name '*.h' -o -name '*.cuh')
# The CUDA build check: a second environment with a CUDA build of torch.
CUDA_VENV ?= $(HOME)/.cache/fastcoll/cuda-venv
CUDA_HOME ?= /usr/local/cuda
PYTEST_ARGS ?=

.PHONY: all setup build test lint docs test-oldest-torch test-torch-ddp-suite torch-optim-sources test-torch-optim-suite test-torch-zero-suite bench bench-full bench-quick results \
  gpu-wheels gpu-check cmake-test \
  cuda-build-check clean

all: test

$(VENV)/.deps-stamp: Makefile
	test -x $(VPY) || $(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q $(TORCH_CPU) $(DEPS)
	$(VPY) -m pip install -q $(TORCH_CPU) $(EXTRAS) || echo "fastcoll: optional framework packages did not install; their tests will skip"
	$(VPY) -m pip install -q $(TORCH_CPU) $(HF_EXTRAS) || echo "fastcoll: accelerate/transformers did not install; their tests will skip"
	touch $@

setup: $(VENV)/.deps-stamp

$(VENV)/.build-stamp: $(VENV)/.deps-stamp setup.py pyproject.toml $(CSRC)
	$(VPY) -m pip install -q --no-build-isolation --no-deps -e .
	$(VPY) -c "import fastcoll, json; i = fastcoll.build_info(); print(json.dumps(i, indent=1)); assert i['extension'], 'extension not built'"
	touch $@

build: $(VENV)/.build-stamp

test: build
	OMP_NUM_THREADS=1 $(VPY) -m pytest -q $(PYTEST_ARGS)

# The documentation site (mkdocs.yml, docs/) into site/, warnings as errors (a docstring whose Args do not
# match its signature fails too). The API reference is read from the sources by mkdocstrings (griffe's static
# analysis), so the extension need not be built; PYTHONPATH puts this tree's fastcoll first all the same.
# NO_MKDOCS_2_WARNING: mkdocs-material's banner about its successor, printed on every build.
docs: setup
	NO_MKDOCS_2_WARNING=1 PYTHONPATH=$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} $(VENV)/bin/mkdocs build --strict

# PyTorch's own DDP tests (torch.testing._internal.distributed.distributed_test, _DistTestBase: the 11 that
# build a DDP and run on CPU with gloo and 2 ranks) run twice, with torch DDP and with fastcoll.DDP substituted
# for it, then a table of both results (tests/torch_suite/run.py; README, "PyTorch's own DDP tests"). About
# 11 minutes on a busy 2-core machine (each test spawns two ranks that import torch), so not part of `make test`.
# SUITE_ARGS: e.g. `--only fastcoll test_ddp_logging_data_cpu`.
SUITE_ARGS ?=
test-torch-ddp-suite: build
	PYTHONPATH=$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} OMP_NUM_THREADS=1 $(VPY) tests/torch_suite/run.py $(SUITE_ARGS)

# PyTorch's own optimizer tests (test/test_optim.py's optim_db-driven TestOptimRenewed, test/optim/test_lrscheduler.py)
# with every optimizer wrapped in fastcoll.ShardedOptimizer over a fastcoll.DDP (tests/torch_suite/optim_adapter.py):
# plain torch first, then world size 1 and 2 (gloo) x grads "full"/"sharded"; report in
# tests/torch_suite/OPTIM_RESULTS.md and optim_results.json. The test files are pytorch/pytorch's, downloaded
# unmodified at the pinned torch's tag into tests/torch_suite/upstream/ (not in git; BSD-3-Clause, their LICENSE
# beside them); TORCH_TESTS_DIR=<a pytorch checkout> uses one you have. Long (see OPTIM_RESULTS.md for the last
# run's minutes), so not part of `make test`. OPTIM_SUITE_ARGS: e.g. `--configs plain,ws2-sharded --only Adam_`.
TORCH_TESTS_TAG   ?= v$(patsubst torch==%,%,$(TORCH_CPU))
TORCH_TESTS_DIR   ?= tests/torch_suite/upstream
TORCH_TESTS_FILES := test/test_optim.py test/optim/test_lrscheduler.py test/optim/test_optim.py test/optim/test_swa_utils.py \
  test/distributed/optim/test_zero_redundancy_optimizer.py LICENSE
OPTIM_SUITE_ARGS  ?=
# Each file that is absent is downloaded (a failure is reported, and the runners skip or stub what is missing).
torch-optim-sources:
	@for f in $(TORCH_TESTS_FILES); do \
	  test -f $(TORCH_TESTS_DIR)/$$f && continue; \
	  if curl -fsSL --create-dirs -o $(TORCH_TESTS_DIR)/$$f https://raw.githubusercontent.com/pytorch/pytorch/$(TORCH_TESTS_TAG)/$$f; then \
	    echo "$$f: pytorch/pytorch $(TORCH_TESTS_TAG), unmodified (BSD-3-Clause, see LICENSE)" >> $(TORCH_TESTS_DIR)/SOURCE; \
	  else echo "fastcoll: could not download $$f at $(TORCH_TESTS_TAG)" >&2; fi; \
	done

# PyTorch's ZeroRedundancyOptimizer tests (test/distributed/optim/test_zero_redundancy_optimizer.py, the 12 that run
# on CPU, one also at 4 ranks) with torch's ZeRO, then with fastcoll.ShardedOptimizer in its place in both grads
# modes (tests/torch_suite/zero_suite.py): report in tests/torch_suite/ZERO_RESULTS.md; exits 1 when a result is
# not the expected one. About 7 minutes on a busy 2-core machine. ZERO_SUITE_ARGS: e.g. `--configs full test_zero_grad`.
ZERO_SUITE_ARGS ?=
ZERO_SUITE = PYTHONPATH=$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} OMP_NUM_THREADS=1 FASTCOLL_ZERO_SOURCES=$(TORCH_TESTS_DIR) \
  $(VPY) tests/torch_suite/zero_suite.py --md tests/torch_suite/ZERO_RESULTS.md --json tests/torch_suite/zero_results.json
test-torch-zero-suite: build torch-optim-sources
	$(ZERO_SUITE) $(ZERO_SUITE_ARGS)

test-torch-optim-suite: build torch-optim-sources
	PYTHONPATH=$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} OMP_NUM_THREADS=1 $(VPY) tests/torch_suite/optim_run.py \
	  --sources $(TORCH_TESTS_DIR) $(OPTIM_SUITE_ARGS)
	$(ZERO_SUITE)

# ruff's checks and its formatter in check mode, configured in pyproject.toml [tool.ruff], one
# line per finding. `.venv/bin/ruff check FILE` and `.venv/bin/ruff format --diff FILE` show them
# in full; `ruff format FILE` and `ruff check --fix FILE` fix most.
LINT_PATHS := fastcoll tests benchmarks examples setup.py
lint: setup
	rc=0; $(VENV)/bin/ruff check --output-format concise $(LINT_PATHS) || rc=1; \
	  $(VENV)/bin/ruff format --check --output-format concise $(LINT_PATHS) || rc=1; exit $$rc

# The test suite against the oldest torch fastcoll supports (pyproject's floor), on a copy
# of the tree built there (CPU kernels). PyPI's Linux torch wheels are CUDA builds: the
# first run installs torch and its nvidia-* libraries (about 3 GB, 1.5 min here) into
# OLDEST_VENV, which later runs reuse. By default a subset that covers the ops (all four
# families), DDP on 2 and 3 ranks with comm hooks, the torch DDP member table, gradient
# health and stall diagnosis, and fastcoll.dist, so that CI stays under 25 minutes;
# `OLDEST_TESTS=tests` runs all. (By hand on 2026-11-25 the sharded-optimizer, main-gradient,
# find_unused, signature and DCP suites passed on 2.6 too.)
OLDEST_TORCH ?= 2.6.0
OLDEST_VENV  ?= $(HOME)/.cache/fastcoll/oldest-venv
OLDEST_TESTS ?= tests/test_ops.py tests/test_ops_health.py tests/test_ops_accumulate.py tests/test_checksum.py tests/test_ddp.py \
  tests/test_ddp_hooks.py tests/test_ddp_members.py tests/test_dist.py tests/test_grad_health.py tests/test_ddp_stall.py \
  tests/test_ddp_strides.py tests/test_ddp_module_changes.py tests/test_comm_profiler.py tests/test_guarded_grad_ops.py \
  tests/test_ops_complex.py tests/test_ddp_complex.py
OLDEST_TREE  := build/oldest/tree
# Hypothesis examples in the op tests there, as a fraction of `make test`'s (tests/test_ops.py, examples()):
# the same kernels on the same inputs; there they check the build and the dispatch against torch 2.6.
OLDEST_EXAMPLES ?= 0.25
# oldest-build: the venv, a copy of the tree, the CPU extension built there against torch $(OLDEST_TORCH) and
# imported; oldest-run: the tests in that copy (CI builds in the background of the test stages, then runs).
OLDEST_MAX_JOBS ?= 2
OLDEST_PYTEST = cd $(OLDEST_TREE) && FASTCOLL_TEST_EXAMPLES=$(OLDEST_EXAMPLES) OMP_NUM_THREADS=1 \
  $(OLDEST_VENV)/bin/python -m pytest -q -p no:cacheprovider $(OLDEST_TESTS) $(PYTEST_ARGS)
.PHONY: oldest-build oldest-run
test-oldest-torch: oldest-build
	$(OLDEST_PYTEST)
oldest-run:
	$(OLDEST_PYTEST)
oldest-build:
	test -x $(OLDEST_VENV)/bin/python || $(PYTHON) -m venv $(OLDEST_VENV)
	$(OLDEST_VENV)/bin/python -c "import torch, pytest, hypothesis, matplotlib; assert torch.__version__.split('+')[0] == '$(OLDEST_TORCH)'" \
	  2>/dev/null || \
	  $(OLDEST_VENV)/bin/python -m pip install -q torch==$(OLDEST_TORCH) numpy ninja "setuptools>=77" wheel \
	    pytest pytest-timeout hypothesis expecttest rich matplotlib
	rm -rf $(OLDEST_TREE) && mkdir -p $(OLDEST_TREE)
	tar -cf - --exclude=__pycache__ --exclude='*.so' fastcoll csrc tests examples benchmarks setup.py pyproject.toml \
	  | tar -xf - -C $(OLDEST_TREE)
	cd $(OLDEST_TREE) && FASTCOLL_CUDA=0 MAX_JOBS=$(OLDEST_MAX_JOBS) $(OLDEST_VENV)/bin/python setup.py -q build_ext --inplace --build-temp ../tmp
	cd $(OLDEST_TREE) && $(OLDEST_VENV)/bin/python -c "import fastcoll, json; i = fastcoll.build_info(); print(json.dumps(i)); \
	  assert i['extension'] and i['torch'].split('+')[0] == '$(OLDEST_TORCH)', i"

# `make bench`: every benchmark, rounds until each target's 90% interval resolves (capped): about 10 minutes on a
# 2-core machine; `make bench-full`: every row, higher caps (about 35 minutes). `make results` renders
# benchmarks/RESULTS.md from the JSON they wrote (docs/benchmarks.md).
bench: build
	OMP_NUM_THREADS=1 $(VPY) -m fastcoll.bench all

bench-full: build
	OMP_NUM_THREADS=1 $(VPY) -m fastcoll.bench all --full

bench-quick: bench

results:
	$(VPY) benchmarks/render_results.py

# C++ unit test of the CPU kernels through CMake + ctest, against the venv's torch.
cmake-test: build
	cmake -S . -B build/cmake -G Ninja -DCMAKE_BUILD_TYPE=Release \
	  -DCMAKE_PREFIX_PATH="$$($(VPY) -c 'import torch; print(torch.utils.cmake_prefix_path)')"
	cmake --build build/cmake -j2
	cd build/cmake && ctest --output-on-failure

# The AVX2 builds of the CPU loops compiled against libstdc++ 13's headers (what g++ 13, Ubuntu 24.04's
# compiler, builds with): .ci/gcc13_headers_check.sh, which fetches Debian's libstdc++-13-dev once.
.PHONY: gcc13-check
gcc13-check: setup
	VPY="$(VPY)" bash .ci/gcc13_headers_check.sh

# Builds the CUDA kernels (sm_80, sm_90) against torch 2.14.1+cu130 and imports them; no GPU needed.
# CUDA_MAX_JOBS: parallel compile jobs (CI runs it with 1, in the background of the test stages).
CUDA_MAX_JOBS ?= 2
cuda-build-check:
	test -x $(CUDA_VENV)/bin/python || $(PYTHON) -m venv $(CUDA_VENV)
	$(CUDA_VENV)/bin/python -c "import torch; assert torch.__version__.startswith('2.14.1')" 2>/dev/null || \
	  $(CUDA_VENV)/bin/python -m pip install -q $(TORCH_CUDA) numpy ninja "setuptools>=77" wheel
	rm -rf build/cuda-check && mkdir -p build/cuda-check
	NV=$$($(CUDA_VENV)/bin/python -c 'import os, nvidia; print(os.path.join(list(nvidia.__path__)[0], "cu13"))'); \
	  CUDA_HOME=$(CUDA_HOME) FASTCOLL_CUDA=1 TORCH_CUDA_ARCH_LIST="8.0;9.0+PTX" MAX_JOBS=$(CUDA_MAX_JOBS) \
	  CPATH=$$NV/include:$$CPATH LIBRARY_PATH=$$NV/lib:$$LIBRARY_PATH \
	  $(CUDA_VENV)/bin/python setup.py -q build_ext --build-temp build/cuda-check/tmp --build-lib build/cuda-check/lib
	tar -cf - --exclude='*.so' --exclude=_C.build.json --exclude=__pycache__ fastcoll | tar -xf - -C build/cuda-check/lib  # the Python package, beside the CUDA build of _C
	cd build/cuda-check/lib && $(CUDA_VENV)/bin/python -c "import fastcoll, json; i = fastcoll.build_info(); print(json.dumps(i, indent=1)); assert i['cuda_kernels'], i"

# tests/test_integrations_timm.py and the timm rows of the contract and loop tests (ModelEmaV3), which skip under
# `make test`: timm imports torchvision, and PyPI's torchvision
# for torch 2.13.0 is a CUDA build that does not load with the CPU torch. Here it runs in the CUDA build check's
# environment (torch 2.14.1+cu130; its CPU ops need no GPU) with torchvision 0.29.1 and timm 1.0.31, installed
# --no-deps so pip cannot replace torch, and the tree's fastcoll on its pure-PyTorch path. Not part of `make test`.
TIMM_PKGS := torchvision==0.29.1 timm==1.0.31
.PHONY: test-timm
test-timm:
	test -x $(CUDA_VENV)/bin/python || $(PYTHON) -m venv $(CUDA_VENV)
	$(CUDA_VENV)/bin/python -c "import torch; assert torch.__version__.startswith('2.14.1')" 2>/dev/null || \
	  $(CUDA_VENV)/bin/python -m pip install -q $(TORCH_CUDA) numpy ninja "setuptools>=77" wheel
	$(CUDA_VENV)/bin/python -c "import timm, pytest_timeout" 2>/dev/null || \
	  { $(CUDA_VENV)/bin/python -m pip install -q $(TORCH_CUDA) pytest pytest-timeout pillow pyyaml safetensors && \
	    $(CUDA_VENV)/bin/python -m pip install -q --no-deps $(TIMM_PKGS); } || \
	  echo "fastcoll: torchvision/timm did not install in $(CUDA_VENV); the timm tests will skip"
	FASTCOLL_NO_EXT=1 OMP_NUM_THREADS=1 $(CUDA_VENV)/bin/python -m pytest -q -p no:cacheprovider -k timm \
	  tests/test_integrations_timm.py tests/test_sharded_contract.py tests/test_sharded_loops.py $(PYTEST_ARGS)

# Installing as users do (issue 21): plain `pip install .` of a clean copy of the tree (isolated:
# compiles nothing) in a fresh venv sharing .venv's CPU torch, the compile at first import with an
# empty cache (tests/test_build_jit.py: 4 processes at once, cache hit, DDP step, ops), then the
# sdist in an empty venv (torch comes in as a dependency). Work folder: build/install-check.
.PHONY: install-check
install-check: setup
	PYTHON="$(PYTHON)" VPY="$(VPY)" TORCH_CPU="$(TORCH_CPU)" bash .ci/install_check.sh

# Wheels of the test and table tools for the GPU machine (Python 3.12, no package
# index there): `make gpu-wheels` here, then carry .gpu-wheels to the GPU machine.
GPU_PY ?= 3.12
GPU_WHEELS := pytest pytest-timeout hypothesis expecttest rich ninja "setuptools>=77"
gpu-wheels:
	test -x $(VPY) || $(PYTHON) -m venv $(VENV)
	$(VPY) -m pip download -q --only-binary=:all: --python-version $(GPU_PY) \
	  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
	  --platform any -d .gpu-wheels $(GPU_WHEELS)

# On a machine whose python already has a CUDA build of torch (the GPU machine), one step per
# device call (README, "On a GPU machine, step by step"); benchmarks/gpu_check.sh runs each.
# gpu-build: build in place with the CUDA kernels (TORCH_CUDA_ARCH_LIST, default 9.0+PTX), print
# build_info; gpu-test: pytest -m cuda (junit XML); gpu-bench-ops: the ops benchmark and the
# slot-padding timings; gpu-bench-plan: bucket plans' host and device time; gpu-bench-zero: the ZeRO benchmark and its bf16 section (one GPU: one NCCL
# rank, collectives forced); gpu-bench-ddp: the DDP benchmark twice, FASTCOLL_FORCE_COLLECTIVES=0 and =1.
# Each step installs the carried wheels from .gpu-wheels when that folder exists, builds first when
# no usable build is there, and writes its log (and JSON) to GPU_OUT even when it fails ("exit=N"
# ends each log); gpu-check runs them all, a failing one not stopping the others.
# gpu-pad-counts: the slot-padding counts (issue 14 item 7), no GPU needed.
GPU_OUT ?= $${OUT:-benchmarks/out/gpu}
GPU_STEP = GPU_OUT="$(GPU_OUT)" PYTHON="$(PYTHON)" PYTEST_ARGS="$(PYTEST_ARGS)" GPU_WHEELS='$(GPU_WHEELS)' \
  bash benchmarks/gpu_check.sh
.PHONY: gpu-build gpu-test gpu-bench-ops gpu-bench-plan gpu-bench-zero gpu-bench-ddp gpu-pad-counts
gpu-build:
	$(GPU_STEP) build
gpu-test:
	$(GPU_STEP) test
gpu-bench-ops:
	$(GPU_STEP) bench-ops
gpu-bench-plan:
	$(GPU_STEP) bench-plan
gpu-bench-zero:
	$(GPU_STEP) bench-zero
gpu-bench-ddp:
	$(GPU_STEP) bench-ddp
gpu-pad-counts:
	$(GPU_STEP) pad-counts
gpu-check:
	rc=0; for s in build test bench-ops bench-plan bench-zero bench-ddp; do $(GPU_STEP) $$s || rc=1; done; exit $$rc

clean:
	rm -rf build *.egg-info fastcoll/*.so fastcoll/_C.build.json $(VENV)/.build-stamp
