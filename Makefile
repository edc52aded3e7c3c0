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

.PHONY: install lock demo test test-all test-fast browser lint services stop bench bench-quality bench-scale soak clean

install: $(VENV)/.installed

# torch/torchvision come from pip (pinned in pyproject.toml); pip honours the machine's
# constraint file. uv/poetry would download multi-GB CUDA wheels instead.
# Every dependency at the exact version of requirements.lock (make lock refreshes it), then the
# project itself without resolving anything again.
$(VENV)/.installed: pyproject.toml requirements.lock
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install -r requirements.lock
	$(PY) -m pip install --no-deps -e '.[dev]'
	@if command -v nvidia-smi >/dev/null 2>&1; then \
		echo "GPU machine: adding the gpu extra (pynvml, for MLflow's GPU metrics)"; \
		$(PY) -m pip install --quiet -c requirements.lock -e '.[dev,gpu]'; fi
	touch $@

# After changing dependencies in pyproject.toml, or to take newer releases on purpose: resolve
# again (uv only resolves here; pip installs, torch included) and commit requirements.lock.
lock:
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet uv
	$(VENV)/bin/uv pip compile pyproject.toml --extra dev --python-version 3.11 \
		--python-platform x86_64-manylinux_2_28 --no-header --annotation-style line -o requirements.lock

demo: install
	$(VENV)/bin/trainflow train --dataset.source builtin:digits --training.epochs 3

# CI's suite: every test but the `extended` scenarios (long faults, concurrency and the short
# soak), which `make test-all` adds; CI must stay well under an hour on 2 cores.
test: install browser
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -m "not extended"

test-all: install browser
	$(VENV)/bin/ruff check .
	$(PY) -m pytest

# Headless Chromium, for the test that screenshots the review page (tests/test_review.py):
# Debian's package, as root (CI is). Without it that one test fails and says so; the others run.
browser:
	@command -v chromium-headless-shell >/dev/null || { apt-get update -qq && \
		apt-get install -y -qq --no-install-recommends chromium-headless-shell; } || \
		echo "make browser: could not install chromium-headless-shell (root and apt needed)"

test-fast: install
	$(PY) -m pytest -m "not slow and not e2e"

lint: install
	$(VENV)/bin/ruff check .

# Prefect server, MLflow server and a process worker on 127.0.0.1; pids and logs in .services/
services: install
	@mkdir -p $(SERVICES)
	$(VENV)/bin/trainflow services start --folder $(SERVICES) --prefect-port $(PREFECT_PORT) --mlflow-port $(MLFLOW_PORT)

# Ends `make services` and the local Prefect server that hand-started flows reuse.
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

# About 20 digits flow runs against one stack, 10 of them with faults (killed, preempted and
# hung ranks, MLflow and Prefect servers restarted, a corrupt image, a bad parameter), then an
# audit of what was left behind (bench/soak.py; its table is in bench/RESULTS.md)
soak: install
	$(PY) -m bench.soak --runs 20 --faults 10

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
