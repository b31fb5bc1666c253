# Two commands set everything up on a fresh machine:
#   make demo   - a fleet of three schedulers on the embedded backend (no server needed)
#   make test   - lint, type checks and the whole test suite against the local servers
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast lint typecheck services bench chaos simulate clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python examples/demo.py

lint: $(STAMP)
	$(BIN)/ruff check brokersched tests bench examples
	$(BIN)/ruff format --check brokersched tests bench

typecheck: $(STAMP)
	$(BIN)/mypy

services:
	bash scripts/services.sh

# The tiers are the folders of tests/ (README "Running the tests"): scripts/test-tiers.sh runs
# them in four lanes side by side (most of their time is waiting on servers and processes)
# and ends with the summary of all; any lane failing fails the target.
test: lint typecheck services
	BIN=$(BIN) bash scripts/test-tiers.sh

# Seconds, no server, no process, no real time: tests/unit, with a fifth of the property tests'
# examples (make test runs them all).
test-fast: $(STAMP)
	$(BIN)/pytest -q -p no:cacheprovider --hypothesis-profile=fast -n 2 tests/unit

bench: $(STAMP) services
	for script in bench/bench_*.py; do echo "== $$script"; $(BIN)/python $$script || exit 1; done

# Minutes: chaos soaks on throwaway 3-node broker clusters (as root: each node in a network
# namespace, so partitions can be cut); prints slots run twice, lost and time to resume.
chaos: $(STAMP)
	$(BIN)/python bench/chaos_rabbitmq.py
	$(BIN)/python bench/chaos_nats.py 10

# The fleet simulator (brokersched.testing.simulate): SEEDS=N runs seeds 0..N-1 (FIRST=K to
# start elsewhere) and prints what they reached (operation x fault), SEED=n replays one
# (BACKEND=lease|redis|nats|rabbitmq|natslease, STEPS=120, VERBOSE=1).
SEEDS ?= 200
simulate: $(STAMP)
	PYTHONHASHSEED=0 $(BIN)/python -m brokersched.testing.simulate \
		$(if $(SEED),--seed $(SEED),--seeds $(SEEDS) $(if $(FIRST),--first $(FIRST))) \
		$(if $(BACKEND),--backend $(BACKEND)) $(if $(STEPS),--steps $(STEPS)) $(if $(VERBOSE),-v)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .test-logs
