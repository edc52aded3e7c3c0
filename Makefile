# Two commands on a fresh machine: `make demo` and `make test`. Both build .venv when missing.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
SERVICES := .services
PREFECT_PORT ?= 4200
MLFLOW_PORT ?= 5000
export PREFECT_SERVER_ANALYTICS_ENABLED ?= false
export PREFECT_SERVER_TELEMETRY_ENABLED ?= false
export DO_NOT_TRACK ?= 1

.PHONY: install demo test test-fast lint services stop bench bench-quality bench-scale clean

install: $(VENV)/.installed

# torch/torchvision come from pip (pinned in pyproject.toml); pip honours the machine's
# constraint file. uv/poetry would download multi-GB CUDA wheels instead.
$(VENV)/.installed: pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install -e '.[dev]'
	touch $@

demo: install
	$(PY) -m flows.train_flow '{"dataset": {"source": "builtin:digits"}, "training": {"epochs": 3}}'

test: install
	$(VENV)/bin/ruff check .
	$(PY) -m pytest

test-fast: install
	$(PY) -m pytest -m "not slow and not e2e"

lint: install
	$(VENV)/bin/ruff check .

# Prefect server, MLflow server and a process worker on 127.0.0.1; pids and logs in .services/
services: install
	@mkdir -p $(SERVICES)
	$(VENV)/bin/trainflow services start --folder $(SERVICES) --prefect-port $(PREFECT_PORT) --mlflow-port $(MLFLOW_PORT)

stop:
	@test -x $(VENV)/bin/trainflow && $(VENV)/bin/trainflow services stop --folder $(SERVICES) || true

bench: install
	$(PY) -m bench.run

bench-quality: install
	$(PY) -m bench.quality

# 25,000 generated photos (made once, cached in ~/.cache/trainflow-bench): data stages, then
# the whole flow against the tutorial-style script, 2 epochs
bench-scale: install
	$(PY) -m bench.scale --images 25000 --pairs 1 --train --epochs 2

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
