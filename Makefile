# MiniGPT: `make demo` (set-up + train + sample), `make test` (set-up + tests).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
export PYTHONUNBUFFERED := 1

.PHONY: install install-dev demo demo-zh lint test test-slow clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

$(VENV)/.installed: $(PY) pyproject.toml constraints.txt
	$(PIP) install -q -c constraints.txt -e .
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed
	$(PIP) install -q -c constraints.txt -e '.[dev]'
	touch $@

install: $(VENV)/.installed
install-dev: $(VENV)/.installed-dev

# Tiny Shakespeare: byte-level BPE, `tiny` preset, 10 minutes of CPU training, then samples.
demo: install
	$(VENV)/bin/minigpt prepare --data shakespeare --out-dir data/shakespeare --vocab-size 2048
	$(VENV)/bin/minigpt train --config minigpt/recipes/tiny-shakespeare.yaml
	$(VENV)/bin/minigpt generate runs/tiny-shakespeare --prompt "ROMEO:" --max-new-tokens 120 --temperature 0.8 --top-k 50 --seed 1 --echo
	$(VENV)/bin/minigpt generate runs/tiny-shakespeare --prompt "JULIET:" --max-new-tokens 120 --temperature 0.8 --top-k 50 --seed 2 --echo

# Tang poems (Chinese), same pipeline.
demo-zh: install
	$(VENV)/bin/minigpt prepare --data tang-poems --out-dir data/tang-poems --vocab-size 4096
	$(VENV)/bin/minigpt train --config minigpt/recipes/tiny-tang-poems.yaml
	$(VENV)/bin/minigpt generate runs/tiny-tang-poems --prompt "靜夜思" --max-new-tokens 80 --temperature 0.8 --top-k 50 --seed 1 --echo

# Lint (pyflakes, isort, bugbear) and the layering contract (pyproject.toml, docs/architecture.md) before the tests.
lint: install-dev
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports --no-cache

# pytest exits 5 when it collects no test: make fails on it like on any other non-zero status.
test: lint
	$(PY) -m pytest -q

test-slow: install-dev
	$(PY) -m pytest -q -m slow

clean:
	rm -rf runs data .pytest_cache
