# Every target installs what it needs into .venv first: a fresh clone needs only python3 (>= 3.11).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install test lint typecheck check demo bench bench-smoke sim soak clean

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	@touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

lint: $(STAMP)
	$(PY) -m ruff check src tests examples $(wildcard bench)
	$(PY) -m ruff format --check src tests examples $(wildcard bench)

typecheck: $(STAMP)
	$(PY) -m mypy

check: lint typecheck test

# The pool's core over seeded random schedules: SIM_SCHEDULES=N make sim (SIM_SEED=first seed).
sim: $(STAMP)
	$(PY) tests/sim_world.py

demo: $(STAMP)
	$(PY) -m toolpool demo

# BASELINE=<python of another checkout's venv>: its toolpool runs beside this one (before/after).
bench: $(STAMP)
	$(PY) -m pip install --quiet -e '.[bench]'
	$(PY) bench/run.py $(if $(BASELINE),--baseline $(BASELINE))
	$(PY) bench/batch.py --out bench/results/batch.json
	$(PY) bench/serve.py --out bench/results/serve.json

bench-smoke: $(STAMP)
	$(PY) -m pip install --quiet -e '.[bench]'
	$(PY) bench/run.py --smoke
	$(PY) bench/batch.py --smoke
	$(PY) bench/serve.py --smoke

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache .mypy_cache .ruff_cache

# A chaos soak with real processes: 10,000 calls by default (SOAK_ARGS="--calls N --seed S ...").
soak: $(STAMP)
	$(PY) bench/soak.py $(SOAK_ARGS)
