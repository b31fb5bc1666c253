#!/usr/bin/env bash
# Throwaway broker clusters on this machine, from the installed packages (no Docker):
#
#   scripts/cluster.sh rabbitmq up|down|kill N|stop N|start N|partition N|heal|status|urls
#   scripts/cluster.sh nats ...        (scripts/cluster-nats.sh)
#
# Each broker's logic lives in its own script; this one only dispatches.
set -euo pipefail

here=$(dirname "$0")
case "${1:-}" in
  rabbitmq) exec bash "$here/cluster-rabbitmq.sh" "${@:2}" ;;
  nats) exec bash "$here/cluster-nats.sh" "${@:2}" ;;
  *)
    echo "usage: $0 rabbitmq|nats up|down|kill N|stop N|start N|partition N|heal|status" >&2
    echo "broker '${1:-}' is not one of: rabbitmq, nats" >&2
    exit 2
    ;;
esac
