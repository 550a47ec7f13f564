# The two commands of the README. Each creates/refreshes .venv and installs the project.
PYTHON ?= python3
VENV ?= .venv
# CPU machines: the local CPU wheel. GPU hosts: `make serve TORCH_SPEC=` keeps their own torch.
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: serve test test-fast lint

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	@if [ -n "$(TORCH_SPEC)" ] && ! $(BIN)/python -c "import torch" 2>/dev/null; then \
		$(BIN)/python -m pip install -q "$(TORCH_SPEC)"; fi
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $@

serve: $(STAMP)
	$(BIN)/python -m service

lint: $(STAMP)
	$(BIN)/ruff check .

test: lint
	$(BIN)/python -m pytest -q --durations=15

# No Ray, no subprocess CLIs, no Triton interpreter: under a minute once the CPU kernels are
# built (the first run builds them, ~1 min).
test-fast: lint
	$(BIN)/python -m pytest -q -m "not service and not slow"
