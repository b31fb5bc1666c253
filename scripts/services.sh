#!/usr/bin/env bash
# Start each local server the tests need (PostgreSQL, RabbitMQ, NATS JetStream) if it is not
# answering on 127.0.0.1 already, and wait until it does. With BROKERSCHED_*_URL pointing
# elsewhere (docker compose, a CI service), nothing is started.
set -euo pipefail

listening() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

wait_for() {  # name port seconds
  for _ in $(seq 1 "$3"); do
    listening "$2" && { echo "services: $1 is up on 127.0.0.1:$2"; return 0; }
    sleep 1
  done
  echo "services: $1 did not come up on 127.0.0.1:$2 within $3 s" >&2
  return 1
}

start() {  # name port seconds command...
  local name=$1 port=$2 seconds=$3
  shift 3
  if listening "$port"; then echo "services: $name is up on 127.0.0.1:$port"; return 0; fi
  if ! command -v "$1" >/dev/null 2>&1; then
    echo "services: $name is down and '$1' is not installed; set its BROKERSCHED_* URL" >&2
    return 1
  fi
  echo "services: starting $name"
  "$@" || true
  wait_for "$name" "$port" "$seconds"
}

if [ -z "${BROKERSCHED_POSTGRES_DSN:-}" ]; then
  start PostgreSQL 5432 60 pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql 2>/dev/null | head -n 1)" main start
fi
if [ -z "${BROKERSCHED_AMQP_URL:-}" ]; then
  start RabbitMQ 5672 120 rabbitmq-server -detached
fi
if [ -z "${BROKERSCHED_NATS_URL:-}" ]; then
  start NATS 4222 30 start-stop-daemon --start --oknodo --background --exec /usr/sbin/nats-server \
    -- -a 127.0.0.1 -p 4222 -js -sd /var/lib/nats-server -l /var/log/nats-server.log
fi
