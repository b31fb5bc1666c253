# Two commands set everything up on a fresh machine:
#   make demo   - a fleet of three schedulers on the embedded backend (no server needed)
#   make test   - lint, type checks and the whole test suite against the local servers
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast lint typecheck services bench chaos clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python examples/demo.py

lint: $(STAMP)
	$(BIN)/ruff check brokersched tests bench examples
	$(BIN)/ruff format --check brokersched

typecheck: $(STAMP)
	$(BIN)/mypy

services:
	bash scripts/services.sh

test: lint typecheck services
	$(BIN)/pytest

# Seconds, no server: the core on virtual time, validation, cron, typing of the API.
test-fast: $(STAMP)
	$(BIN)/pytest --no-servers -m "not slow" -q

bench: $(STAMP) services
	for script in bench/bench_*.py; do echo "== $$script"; $(BIN)/python $$script || exit 1; done

# Minutes: chaos soaks on throwaway 3-node broker clusters (as root: each node in a network
# namespace, so partitions can be cut); prints slots run twice, lost and time to resume.
chaos: $(STAMP)
	$(BIN)/python bench/chaos_rabbitmq.py
	$(BIN)/python bench/chaos_nats.py 10

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
