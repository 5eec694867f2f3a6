# MiniGPT: `make demo` (set-up + train + sample), `make test` (set-up + tests).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
export PYTHONUNBUFFERED := 1

.PHONY: install install-dev demo demo-zh chat-demo lint test test-slow clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

# compileall: an editable install writes no bytecode, and where PYTHONDONTWRITEBYTECODE is set nothing ever does:
# every CLI call would then compile MiniGPT's sources again (~0.3 s measured).
$(VENV)/.installed: $(PY) pyproject.toml constraints.txt
	$(PIP) install -q -c constraints.txt -e .
	$(PY) -m compileall -q minigpt
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed
	$(PIP) install -q -c constraints.txt -e '.[dev]'
	touch $@

install: $(VENV)/.installed
install-dev: $(VENV)/.installed-dev

# Tiny Shakespeare: byte-level BPE, `tiny` preset, 10 minutes of CPU training, then samples.
demo: install
	$(VENV)/bin/minigpt prepare --data shakespeare --out-dir data/shakespeare-1024 --vocab-size 1024
	$(VENV)/bin/minigpt train --config minigpt/recipes/tiny-shakespeare.yaml
	$(VENV)/bin/minigpt generate runs/tiny-shakespeare --prompt "ROMEO:" --max-new-tokens 120 --temperature 0.8 --top-k 50 --seed 1 --echo
	$(VENV)/bin/minigpt generate runs/tiny-shakespeare --prompt "JULIET:" --max-new-tokens 120 --temperature 0.8 --top-k 50 --seed 2 --echo

# Tang poems (Chinese), same pipeline.
demo-zh: install
	$(VENV)/bin/minigpt prepare --data tang-poems --out-dir data/tang-poems --vocab-size 4096
	$(VENV)/bin/minigpt train --config minigpt/recipes/tiny-tang-poems.yaml
	$(VENV)/bin/minigpt generate runs/tiny-tang-poems --prompt "靜夜思" --max-new-tokens 80 --temperature 0.8 --top-k 50 --seed 1 --echo

# Tang poems, base -> SFT -> DPO (about 27 minutes of CPU after `make demo-zh`): poetry instructions built from the
# corpus, split by title; DPO's pairs are the SFT model's own answers judged by the form checker (on-policy: right
# answer chosen, wrong one rejected). The table gives how often each model writes the requested form, greedily, for
# the 200 held-out titles.
chat-demo: install
	test -d runs/tiny-tang-poems || $(MAKE) demo-zh
	$(PY) scripts/build_poetry_sets.py --out-dir data/poetry
	$(VENV)/bin/minigpt sft --model runs/tiny-tang-poems --data data/poetry/sft_train.jsonl --val-data data/poetry/sft_val.jsonl --out-dir runs/poetry-sft --max-time 600 --lr 1e-3 --batch-size 16 --seq-len 256
	$(PY) scripts/sample_poetry_pairs.py runs/poetry-sft --pairs data/poetry/dpo_train.jsonl --out data/poetry/dpo_judged_train.jsonl --limit 3000 --samples 4
	$(PY) scripts/sample_poetry_pairs.py runs/poetry-sft --pairs data/poetry/dpo_val.jsonl --out data/poetry/dpo_judged_val.jsonl --limit 200 --samples 4
	$(VENV)/bin/minigpt dpo --model runs/poetry-sft --data data/poetry/dpo_judged_train.jsonl --val-data data/poetry/dpo_judged_val.jsonl --out-dir runs/poetry-dpo --max-time 300 --beta 0.1 --lr 5e-5 --sft-weight 1.0 --batch-size 8 --seq-len 256
	$(PY) scripts/poetry_form_table.py --prompts data/poetry/eval_prompts.jsonl --limit 200 runs/tiny-tang-poems runs/poetry-sft runs/poetry-dpo

# Lint (pyflakes, isort, bugbear) and the layering contract (pyproject.toml, docs/architecture.md) before the tests.
lint: install-dev
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports --no-cache

# pytest exits 5 when it collects no test: make fails on it like on any other non-zero status.
test: lint
	$(PY) -m pytest -q --durations=25

test-slow: install-dev
	$(PY) -m pytest -q -m slow --durations=25

clean:
	rm -rf runs data .pytest_cache
