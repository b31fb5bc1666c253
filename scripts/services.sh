#!/usr/bin/env bash
# Make the local servers the tests need ready, idempotently: start PostgreSQL, RabbitMQ, NATS
# JetStream and Redis on 127.0.0.1 if they are installed but down, wait until they answer, and
# create the PostgreSQL database the tests use; start the RabbitMQ 4.0 nodes the RabbitMQ tests
# also run on (scripts/rabbitmq4.sh: 127.0.0.1:5673 with Mnesia, 127.0.0.1:5674 with Khepri; the
# first run builds their Debian 13 root, a few minutes). Run it as often as you like.
#
# - BROKERSCHED_POSTGRES_DSN, BROKERSCHED_AMQP_URL, BROKERSCHED_NATS_URL, BROKERSCHED_REDIS_URL,
#   BROKERSCHED_AMQP4_MNESIA_URL, BROKERSCHED_AMQP4_KHEPRI_URL: a server pointed at elsewhere
#   (docker compose, a CI service) is left alone.
# - The RabbitMQ 4.0 nodes need root (debootstrap, chroot): elsewhere their tests skip, saying
#   so; in CI (CI=true) a node that cannot be started fails this script.
# - BROKERSCHED_TEST_DATABASE: the database to create (default test, the one named by the
#   default DSN of tests/support/servers.py); psql runs as user postgres on 127.0.0.1.
# - A server that is neither up nor installed is not an error when Docker answers: the tests
#   start a throwaway container instead (testcontainers, in the dev extra). Otherwise the
#   script names every such server and fails.
set -euo pipefail

listening() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

docker_works() {
  command -v docker >/dev/null 2>&1 || return 1
  if command -v timeout >/dev/null 2>&1; then
    timeout 20 docker info >/dev/null 2>&1
  else
    docker info >/dev/null 2>&1
  fi
}

wait_for() {  # name port seconds
  for _ in $(seq 1 "$3"); do
    listening "$2" && { echo "services: $1 is up on 127.0.0.1:$2"; return 0; }
    sleep 1
  done
  echo "services: $1 did not come up on 127.0.0.1:$2 within $3 s" >&2
  return 1
}

# Returns 0 when the server is up, 2 when the tests will start a container, 1 on failure.
start() {  # name port seconds server-program command...
  local name=$1 port=$2 seconds=$3 program=$4
  shift 4
  if listening "$port"; then echo "services: $name is up on 127.0.0.1:$port"; return 0; fi
  if ! command -v "$program" >/dev/null 2>&1 || ! command -v "$1" >/dev/null 2>&1; then
    if docker_works; then
      echo "services: $name is down and not installed ($program); Docker answers, so the" \
        "tests will start a $name container instead (testcontainers)"
      return 2
    fi
    echo "services: $name is down, not installed ($program) and Docker does not answer;" \
      "install $name or set its BROKERSCHED_* URL" >&2
    return 1
  fi
  echo "services: starting $name"
  "$@" || true
  wait_for "$name" "$port" "$seconds"
}

psql_postgres() {  # sql
  PGCONNECT_TIMEOUT=5 psql -w -X -h 127.0.0.1 -p 5432 -U postgres -d postgres -tAc "$1"
}

# The server can listen before it accepts logins ("the database system is starting up").
postgres_ready() {  # seconds
  local error=""
  for _ in $(seq 1 "$1"); do
    if error=$(psql_postgres "SELECT 1" 2>&1 >/dev/null); then return 0; fi
    sleep 1
  done
  echo "services: psql -h 127.0.0.1 -U postgres cannot log in: $error" >&2
  return 1
}

ensure_database() {  # name
  local name=$1
  if ! command -v psql >/dev/null 2>&1 || ! command -v createdb >/dev/null 2>&1; then
    echo "services: psql/createdb are not installed; cannot check that database '$name'" \
      "exists (create it yourself)" >&2
    return 0
  fi
  postgres_ready 30 || return 1
  if [ "$(psql_postgres "SELECT 1 FROM pg_database WHERE datname = '$name'")" = 1 ]; then
    echo "services: PostgreSQL database '$name' exists"
    return 0
  fi
  echo "services: creating PostgreSQL database '$name'"
  # Another run may create it between the check and here: only a database still missing fails.
  createdb -w -h 127.0.0.1 -p 5432 -U postgres "$name" ||
    [ "$(psql_postgres "SELECT 1 FROM pg_database WHERE datname = '$name'")" = 1 ]
}

# RabbitMQ 4.0 beside 3.10: the nodes of scripts/rabbitmq4.sh not pointed at elsewhere.
rabbitmq4() {
  local nodes=()
  [ -n "${BROKERSCHED_AMQP4_MNESIA_URL:-}" ] || nodes+=(mnesia)
  [ -n "${BROKERSCHED_AMQP4_KHEPRI_URL:-}" ] || nodes+=(khepri)
  [ ${#nodes[@]} -gt 0 ] || return 0
  if [ "$(id -u)" != 0 ]; then
    local reason="the RabbitMQ 4.0 nodes (scripts/rabbitmq4.sh) need root"
    if [ "${CI:-}" = true ]; then echo "services: $reason" >&2; return 1; fi
    echo "services: $reason; their tests will skip"
    return 0
  fi
  local here
  here=$(dirname "${BASH_SOURCE[0]}")
  bash "$here/rabbitmq4.sh" up "${nodes[@]}" | sed 's/^/services: RabbitMQ 4.0 is up at /'
}

main() {
  local failed=() status
  if [ -z "${BROKERSCHED_POSTGRES_DSN:-}" ]; then
    local database=${BROKERSCHED_TEST_DATABASE:-test}
    if [[ ! $database =~ ^[A-Za-z_][A-Za-z0-9_]*$ ]]; then
      echo "services: BROKERSCHED_TEST_DATABASE '$database' is not a plain identifier" >&2
      return 1
    fi
    local version
    version=$(ls /etc/postgresql 2>/dev/null | head -n 1)  # Debian's clusters
    status=0
    start PostgreSQL 5432 60 "/usr/lib/postgresql/${version:-?}/bin/postgres" \
      pg_ctlcluster --skip-systemctl-redirect "$version" main start || status=$?
    if [ "$status" = 0 ]; then
      ensure_database "$database" || failed+=("PostgreSQL database '$database'")
    elif [ "$status" = 1 ]; then
      failed+=(PostgreSQL)
    fi
  fi
  if [ -z "${BROKERSCHED_AMQP_URL:-}" ]; then
    start RabbitMQ 5672 120 rabbitmq-server rabbitmq-server -detached ||
      [ $? = 2 ] || failed+=(RabbitMQ)
  fi
  rabbitmq4 || failed+=("RabbitMQ 4.0 (scripts/rabbitmq4.sh)")
  if [ -z "${BROKERSCHED_NATS_URL:-}" ]; then
    start NATS 4222 30 /usr/sbin/nats-server start-stop-daemon --start --oknodo --background \
      --exec /usr/sbin/nats-server -- -a 127.0.0.1 -p 4222 -js -sd /var/lib/nats-server \
      -l /var/log/nats-server.log || [ $? = 2 ] || failed+=(NATS)
  fi
  if [ -z "${BROKERSCHED_REDIS_URL:-}" ]; then
    # Nothing on disk: the tests' data is throwaway.
    start Redis 6379 30 redis-server redis-server --daemonize yes --bind 127.0.0.1 --port 6379 \
      --save '' --appendonly no || [ $? = 2 ] || failed+=(Redis)
  fi
  if [ ${#failed[@]} -gt 0 ]; then
    echo "services: not ready: ${failed[*]}" >&2
    return 1
  fi
}

# Sourcing defines the functions only (to try one of them alone); running does the work.
if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  main "$@"
fi
