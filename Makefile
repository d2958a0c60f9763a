# One command for the main job, one for the tests. Both set everything up on a fresh machine.
#   make demo   train the digits CNN under a Supervisor (kill it and run it again: it resumes)
#   make test   lint (ruff) and run the test suite

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0
AZURITE_VERSION ?= 3.37.0
LINT_PATHS := torchsupervisor tests examples benchmarks

.PHONY: install demo test test-slow bench lint format clean

$(VENV)/.installed: pyproject.toml
	@echo "Setting up $(VENV) (first run only, about 1-2 minutes)"
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@# Pin torch before the project, whose "torch>=2.4" would otherwise take the newest release
	@# (a multi-GB CUDA build on Linux). Our CI machines find a CPU wheel of 2.13.0 on their
	@# disk; elsewhere pip takes PyPI's build: install the one you want first and it is kept.
	@$(PY) -c "import torch" 2>/dev/null || echo "Installing torch==$(TORCH_VERSION)"
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "torch==$(TORCH_VERSION)"
	@echo "Installing torchsupervisor (editable) with its demo and test extras: scikit-learn, pytest, ruff, boto3, google-cloud-storage, azure-storage-blob, SeaweedFS, fake-gcs-server, tensorboardX, ..."
	$(PY) -m pip install -q -e ".[demo,test]"
	@# The Azure Blob emulator of the az:// tests (Node.js); without npm those tests are skipped.
	@if command -v npm >/dev/null; then \
		echo "Installing Azurite $(AZURITE_VERSION) (npm) into $(VENV)/azurite"; \
		npm install --prefix $(VENV)/azurite --no-audit --no-fund --silent "azurite@$(AZURITE_VERSION)"; \
	else echo "npm not found: the az:// tests will be skipped (install Node.js for them)"; fi
	@# A real SLURM for the scheduler tests (Debian's slurm-wlm and munge), as root with apt;
	@# elsewhere those tests are skipped, saying why.
	@if [ ! -x /usr/sbin/slurmctld ] && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "Installing SLURM (slurm-wlm, munge) for the scheduler tests"; \
		export DEBIAN_FRONTEND=noninteractive; \
		apt-get install -y -q --no-install-recommends slurm-wlm munge >/dev/null 2>&1 || \
		{ apt-get update -q >/dev/null 2>&1 && \
		  apt-get install -y -q --no-install-recommends slurm-wlm munge >/dev/null 2>&1; } || \
		echo "SLURM could not be installed: the SLURM tests will be skipped"; \
	fi
	touch $@

install: $(VENV)/.installed

demo: install
	$(PY) -m torchsupervisor demo $(ARGS)

lint: install
	$(VENV)/bin/ruff check $(LINT_PATHS)
	$(VENV)/bin/ruff format --check $(LINT_PATHS)

format: install
	$(VENV)/bin/ruff check --fix $(LINT_PATHS)
	$(VENV)/bin/ruff format $(LINT_PATHS)

test: lint
	@# The suite starts several hundred Python processes: compile the package once, not in
	@# each of them (they would, where PYTHONDONTWRITEBYTECODE is set: about 0.4 s apiece).
	$(PY) -m compileall -q torchsupervisor
	@echo "Running the test suite in two workers (about 13-19 minutes on 2 cores)"
	@# The slowest tests are listed at the end: the suite must stay well under 15 minutes.
	@# Work stealing: a worker that runs out of tests takes some of the other's, so the slow
	@# end-to-end tests do not leave one worker idle at the end (1-2 minutes less, measured).
	$(PY) -m pytest -q -n 2 --dist worksteal --durations=15

test-slow: install
	$(PY) -m pytest -q -m slow

# Every benchmark, each against its alternatives in the same run (about 20 minutes; each
# script also runs alone, e.g. .venv/bin/python benchmarks/checkpoint.py --sizes 10MB,100MB).
bench: install
	$(PY) benchmarks/checkpoint.py
	$(PY) benchmarks/summaries.py
	$(PY) benchmarks/hooks.py
	$(PY) benchmarks/distributed.py
	$(PY) benchmarks/save_cache.py
	$(PY) benchmarks/memory_tier.py
	$(PY) benchmarks/goodput.py
	$(PY) benchmarks/hf_export.py
	$(PY) benchmarks/reshard.py
	@if $(PY) -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then \
		$(PY) benchmarks/gpu.py; \
	else echo "No CUDA device: benchmarks/gpu.py skipped"; fi

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache *.egg-info
