#!/usr/bin/env bash
# A throwaway 3-node RabbitMQ cluster from the installed Debian package (no Docker), for the
# chaos tests and for trying things by hand:
#
#   scripts/cluster.sh rabbitmq up           start 3 clustered nodes, print their URLs
#   scripts/cluster.sh rabbitmq kill N       kill -9 node N (1-3)
#   scripts/cluster.sh rabbitmq stop N       stop node N cleanly
#   scripts/cluster.sh rabbitmq start N      start node N again (after kill or stop)
#   scripts/cluster.sh rabbitmq forget N     remove stopped node N from the cluster (its data too)
#   scripts/cluster.sh rabbitmq ctl N ARGS   rabbitmqctl ARGS on node N
#   scripts/cluster.sh rabbitmq partition N  cut node N off silently (its packets vanish)
#   scripts/cluster.sh rabbitmq heal         link every node again
#   scripts/cluster.sh rabbitmq status       which nodes run, which are cut off, the cluster
#   scripts/cluster.sh rabbitmq urls         the AMQP URLs, one a line
#   scripts/cluster.sh rabbitmq down         stop only what `up` started, remove its files
#
# Layout: each node is started with the server binaries of /usr/lib/rabbitmq/bin as the
# current user (the /usr/sbin wrappers would switch to user rabbitmq), with its own node
# name, data and log dirs under $BROKERSCHED_RMQ_CLUSTER_DIR, one Erlang cookie for the
# cluster (in its own HOME), `cluster_partition_handling = pause_minority`, no plugins. Its
# settings come from a per-node env file (RABBITMQ_CONF_ENV_FILE), so the machine's
# /etc/rabbitmq/rabbitmq-env.conf (which pins epmd and distribution to 127.0.0.1) and the
# machine's own RabbitMQ on 5672 are left alone.
#
# Network: as root, where `ip netns add` works, each node lives in its own network namespace
# <name>-n1..3 with address <subnet>.11-13, joined by veth links to a bridge in a namespace
# <name>-hub, which this host reaches at <subnet>.1 (no forwarding, no route elsewhere).
# `partition N` takes node N's link off the bridge: its packets vanish silently, to the other
# nodes and to the clients alike, as when a switch port dies; `heal` puts it back. Elsewhere
# (not root, no netns) the nodes share 127.0.0.1 on free ports and their own epmd port, and
# `partition` says it is unavailable (exit 3) and why.
#
# Settings (environment):
#   BROKERSCHED_RMQ_CLUSTER_NAME    namespace and node name prefix (default bsrmq, <= 8 chars)
#   BROKERSCHED_RMQ_CLUSTER_DIR     state, data and logs (default /tmp/brokersched-<name>)
#   BROKERSCHED_RMQ_CLUSTER_SUBNET  first three octets of the namespaces' /24 (10.237.41)
#   BROKERSCHED_RMQ_NET_TICKTIME    the nodes' net_ticktime in seconds (default 60, Erlang's)
#   BROKERSCHED_RMQ_NETNS           auto (default), yes (fail without) or no
set -euo pipefail

NAME=${BROKERSCHED_RMQ_CLUSTER_NAME:-bsrmq}
BASE=${BROKERSCHED_RMQ_CLUSTER_DIR:-/tmp/brokersched-$NAME}
SUBNET=${BROKERSCHED_RMQ_CLUSTER_SUBNET:-10.237.41}
TICKTIME=${BROKERSCHED_RMQ_NET_TICKTIME:-60}
WANT_NETNS=${BROKERSCHED_RMQ_NETNS:-auto}
SBIN=/usr/lib/rabbitmq/bin
NODES="1 2 3"
HUB=$NAME-hub
HOST_LINK=${NAME}h
STATE=$BASE/state

die() { echo "cluster rabbitmq: $*" >&2; exit 1; }
say() { echo "cluster rabbitmq: $*"; }

check_args() {
  [[ $NAME =~ ^[a-z][a-z0-9]{0,7}$ ]] ||
    die "BROKERSCHED_RMQ_CLUSTER_NAME '$NAME' must be 1-8 characters of [a-z0-9], a letter first"
  [[ $SUBNET =~ ^[0-9]{1,3}\.[0-9]{1,3}\.[0-9]{1,3}$ ]] ||
    die "BROKERSCHED_RMQ_CLUSTER_SUBNET '$SUBNET' must be three octets, like 10.237.41"
  [[ $TICKTIME =~ ^[1-9][0-9]*$ ]] ||
    die "BROKERSCHED_RMQ_NET_TICKTIME '$TICKTIME' must be a positive number of seconds"
  [[ $WANT_NETNS =~ ^(auto|yes|no)$ ]] ||
    die "BROKERSCHED_RMQ_NETNS '$WANT_NETNS' must be auto, yes or no"
  [ -x "$SBIN/rabbitmq-server" ] ||
    die "$SBIN/rabbitmq-server is missing: install the rabbitmq-server package"
}

node_arg() {  # N
  [[ ${1:-} =~ ^[123]$ ]] || die "node '${1:-}' must be 1, 2 or 3"
}

free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# --- state ------------------------------------------------------------------------------

load() {
  [ -f "$STATE" ] || die "no cluster is up (no $STATE); run: scripts/cluster.sh rabbitmq up"
  # shellcheck source=/dev/null
  . "$STATE"
}

node_name() { echo "$NAME$1@$(ip_of "$1")"; }
ip_of() { local v="IP_$1"; echo "${!v}"; }
amqp_of() { local v="AMQP_$1"; echo "${!v}"; }
ns_of() { echo "$NAME-n$1"; }

in_node() {  # N command...: run in node N's namespace with its environment
  local n=$1
  shift
  local env=(env HOME="$BASE/home" RABBITMQ_CONF_ENV_FILE="$BASE/n$n/env.conf"
    ERL_EPMD_PORT="$EPMD_PORT" ERL_EPMD_ADDRESS="$(ip_of "$n")" ERL_FLAGS=)
  if [ "$MODE" = netns ]; then
    ip netns exec "$(ns_of "$n")" "${env[@]}" "$@"
  else
    "${env[@]}" "$@"
  fi
}

ctl() {  # N rabbitmqctl-args...
  local n=$1
  shift
  in_node "$n" "$SBIN/rabbitmqctl" -n "$(node_name "$n")" "$@"
}

beam_pid() {  # N: the node's Erlang VM, if it runs (checked: a stale pid file may name another)
  local file="$BASE/n$1/beam.pid" pid
  [ -s "$file" ] || return 1
  pid=$(cat "$file")
  [ -r "/proc/$pid/cmdline" ] || return 1
  tr '\0' ' ' <"/proc/$pid/cmdline" | grep -q -- "beam.*-home $BASE/home " || return 1
  echo "$pid"
}

# --- network ----------------------------------------------------------------------------

netns_reason() {  # prints why namespaces cannot be used here; empty when they can
  [ "$(id -u)" = 0 ] || { echo "not root (ip netns add needs CAP_SYS_ADMIN)"; return; }
  command -v ip >/dev/null || { echo "the ip command (iproute2) is missing"; return; }
  local probe=$NAME-probe err
  if ! err=$(ip netns add "$probe" 2>&1); then echo "ip netns add failed: $err"; return; fi
  ip netns del "$probe" 2>/dev/null || true
  if ip -br addr | grep -q " $SUBNET\."; then
    echo "subnet $SUBNET.0/24 is already in use on this host (set BROKERSCHED_RMQ_CLUSTER_SUBNET)"
  fi
}

net_up() {
  ip netns add "$HUB"
  ip -n "$HUB" link add br0 type bridge
  ip -n "$HUB" link set br0 up
  ip link add "$HOST_LINK" type veth peer name host netns "$HUB"
  ip -n "$HUB" link set host master br0
  ip -n "$HUB" link set host up
  ip addr add "$SUBNET.1/24" dev "$HOST_LINK"
  ip link set "$HOST_LINK" up
  for n in $NODES; do
    local ns
    ns=$(ns_of "$n")
    ip netns add "$ns"
    ip -n "$ns" link set lo up
    ip -n "$ns" link add eth0 type veth peer name "n$n" netns "$HUB"
    ip -n "$HUB" link set "n$n" master br0
    ip -n "$HUB" link set "n$n" up
    ip -n "$ns" addr add "$(ip_of "$n")/24" dev eth0
    ip -n "$ns" link set eth0 up
  done
}

net_down() {
  for n in $NODES; do
    local ns
    ns=$(ns_of "$n")
    ip netns list | grep -qw "^$ns" || continue
    # Every process left in the node's namespace is ours: its epmd, a CLI still waiting.
    for pid in $(ip netns pids "$ns"); do kill -9 "$pid" 2>/dev/null || true; done
    ip netns del "$ns" || true
  done
  ip link del "$HOST_LINK" 2>/dev/null || true
  ip netns list | grep -qw "^$HUB" && ip netns del "$HUB" || true
}

# --- nodes ------------------------------------------------------------------------------

write_files() {
  mkdir -p "$BASE/home"
  python3 -c 'import secrets; print(secrets.token_hex(20), end="")' >"$BASE/home/.erlang.cookie"
  chmod 400 "$BASE/home/.erlang.cookie"
  echo "[]." >"$BASE/enabled_plugins"
  {
    echo "cluster_partition_handling = pause_minority"
    echo "loopback_users = none"  # guest from the host's namespace address (test clusters only)
    echo "cluster_formation.peer_discovery_backend = classic_config"
    for n in $NODES; do echo "cluster_formation.classic_config.nodes.$n = $(node_name "$n")"; done
    echo "log.console = false"
    echo "log.file.level = info"
  } >"$BASE/rabbitmq.conf"
  for n in $NODES; do
    mkdir -p "$BASE/n$n/mnesia" "$BASE/n$n/log"
    local ip tuple
    ip=$(ip_of "$n")
    tuple="{${ip//./,}}"
    cat >"$BASE/n$n/env.conf" <<EOF
# Written by scripts/cluster-rabbitmq.sh: node $n of cluster $NAME.
RABBITMQ_NODENAME=$(node_name "$n")
RABBITMQ_USE_LONGNAME=true
RABBITMQ_NODE_IP_ADDRESS=$ip
RABBITMQ_NODE_PORT=$(amqp_of "$n")
RABBITMQ_DIST_PORT=$(eval echo "\$DIST_$n")
RABBITMQ_CONFIG_FILE=$BASE/rabbitmq.conf
RABBITMQ_ADVANCED_CONFIG_FILE=$BASE/advanced.config
RABBITMQ_ENABLED_PLUGINS_FILE=$BASE/enabled_plugins
RABBITMQ_MNESIA_BASE=$BASE/n$n/mnesia
RABBITMQ_LOG_BASE=$BASE/n$n/log
RABBITMQ_PID_FILE=$BASE/n$n/beam.pid
RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS="-kernel net_ticktime $TICKTIME -kernel inet_dist_use_interface $tuple"
RABBITMQ_CTL_ERL_ARGS="-kernel net_ticktime $TICKTIME"
ERL_EPMD_ADDRESS=$ip
ERL_EPMD_PORT=$EPMD_PORT
EOF
  done
}

log_of() { echo "$BASE/n$1/log/$(node_name "$1").log"; }

start_node() {  # N: start it in the background; wait_node waits
  local n=$1
  if beam_pid "$n" >/dev/null; then say "node $n already runs"; return 0; fi
  rm -f "$BASE/n$n/beam.pid"
  # Where this boot's lines start in the node's log: wait_node reads only those.
  if [ -f "$(log_of "$n")" ]; then wc -l <"$(log_of "$n")"; else echo 0; fi >"$BASE/n$n/log.mark"
  in_node "$n" setsid "$SBIN/rabbitmq-server" >>"$BASE/n$n/stdout.log" 2>&1 </dev/null &
  echo $! >"$BASE/n$n/server.pid"
}

wait_node() {  # N: until the node says it has started (boots take 5-30 s here), at most 180 s
  local n=$1 pid mark
  pid=$(cat "$BASE/n$n/server.pid")
  mark=$(cat "$BASE/n$n/log.mark")
  for _ in $(seq 1 900); do
    if tail -n "+$((mark + 1))" "$(log_of "$n")" 2>/dev/null | grep -q "Server startup complete"; then
      return 0
    fi
    if ! kill -0 "$pid" 2>/dev/null; then break; fi
    sleep 0.2
  done
  echo "cluster rabbitmq: node $n ($(node_name "$n")) did not start; the end of its logs:" >&2
  tail -n 8 "$BASE/n$n/stdout.log" "$(log_of "$n")" >&2 || true
  return 1
}

stop_group() {  # N: kill -9 what start_node started (the script, its VM and their children)
  local pid
  pid=$(cat "$BASE/n$1/server.pid" 2>/dev/null) || return 0
  kill -9 -- "-$pid" 2>/dev/null || true
  if pid=$(beam_pid "$1"); then kill -9 "$pid" 2>/dev/null || true; fi
}

# --- commands ---------------------------------------------------------------------------

cmd_up() {
  [ ! -f "$STATE" ] || die "a cluster is already up (state in $STATE); run: scripts/cluster.sh rabbitmq down"
  local reason=""
  if [ "$WANT_NETNS" != no ]; then reason=$(netns_reason); else reason="BROKERSCHED_RMQ_NETNS=no"; fi
  if [ -n "$reason" ] && [ "$WANT_NETNS" = yes ]; then die "network namespaces unavailable: $reason"; fi
  mkdir -p "$BASE"
  {
    echo "TICKTIME=$TICKTIME"
    if [ -z "$reason" ]; then
      echo "MODE=netns"
      echo "EPMD_PORT=4369"  # each namespace has its own epmd
      for n in $NODES; do echo "IP_$n=$SUBNET.1$n AMQP_$n=5672 DIST_$n=25672"; done
    else
      echo "MODE=loopback"
      printf 'NO_PARTITION=%q\n' "$reason"
      echo "EPMD_PORT=$(free_port)"  # our own epmd: `down` stops it, the machine's stays
      for n in $NODES; do echo "IP_$n=127.0.0.1 AMQP_$n=$(free_port) DIST_$n=$(free_port)"; done
    fi
  } >"$STATE"
  load
  trap 'echo "cluster rabbitmq: up failed; cleaning up" >&2; [ -n "${KEEP:-}" ] || cmd_down >/dev/null 2>&1' ERR
  if [ "$MODE" = netns ]; then net_up; else say "no network namespaces ($NO_PARTITION): nodes on 127.0.0.1, partition unavailable"; fi
  write_files
  # Node 1 first: the others find it up and join it (classic peer discovery has no lock).
  start_node 1
  wait_node 1
  start_node 2
  start_node 3
  wait_node 2
  wait_node 3
  trap - ERR
  say "up ($MODE, net_ticktime $TICKTIME s, data in $BASE)"
  cmd_urls
}

cmd_down() {
  [ -f "$STATE" ] || { say "nothing to stop (no $STATE)"; return 0; }
  load
  for n in $NODES; do stop_group "$n"; done
  if [ "$MODE" = netns ]; then
    net_down
  else
    local pid
    for pid in $(ss -ltnpH "sport = :$EPMD_PORT" 2>/dev/null | grep -o 'pid=[0-9]*' | cut -d= -f2 | sort -u); do
      grep -q epmd "/proc/$pid/comm" 2>/dev/null && kill -9 "$pid" 2>/dev/null || true
    done
  fi
  rm -rf "$BASE"
  say "down"
}

cmd_kill() {
  node_arg "${1:-}"
  load
  local pid
  pid=$(beam_pid "$1") || die "node $1 is not running"
  kill -9 "$pid"
  # The VM is gone once its pid is: the caller's next step sees a dead node.
  while kill -0 "$pid" 2>/dev/null; do sleep 0.05; done
  say "killed node $1 ($(node_name "$1"), pid $pid)"
}

cmd_stop() {
  node_arg "${1:-}"
  load
  beam_pid "$1" >/dev/null || die "node $1 is not running"
  ctl "$1" -q stop "$BASE/n$1/beam.pid"
  say "stopped node $1 ($(node_name "$1"))"
}

cmd_start() {
  node_arg "${1:-}"
  load
  start_node "$1"
  wait_node "$1"
  say "started node $1 ($(node_name "$1"))"
}

cmd_partition() {
  node_arg "${1:-}"
  load
  [ "$MODE" = netns ] || { echo "cluster rabbitmq: partition unavailable: $NO_PARTITION" >&2; exit 3; }
  ip -n "$HUB" link set "n$1" nomaster
  say "node $1 ($(node_name "$1")) cut off: its packets are dropped until heal"
}

cmd_heal() {
  load
  [ "$MODE" = netns ] || { echo "cluster rabbitmq: partition unavailable: $NO_PARTITION" >&2; exit 3; }
  for n in $NODES; do ip -n "$HUB" link set "n$n" master br0; done
  say "every node linked"
}

cmd_status() {
  load
  local first=""
  echo "mode $MODE, net_ticktime $TICKTIME s, data in $BASE"
  [ "$MODE" = netns ] || echo "partition unavailable: $NO_PARTITION"
  for n in $NODES; do
    local state="down" link=""
    if beam_pid "$n" >/dev/null; then state="running"; first=${first:-$n}; fi
    if [ "$MODE" = netns ] && ! ip -n "$HUB" -d link show "n$n" | grep -q "master br0"; then
      link=", cut off"
    fi
    echo "node $n $(node_name "$n") amqp $(ip_of "$n"):$(amqp_of "$n"): $state$link"
  done
  [ -z "$first" ] || ctl "$first" -q -t 10 cluster_status || true
}

cmd_forget() {  # N: remove stopped node N from the cluster, as an operator does for a lost node
  node_arg "${1:-}"
  load
  ! beam_pid "$1" >/dev/null || die "node $1 runs: kill or stop it first"
  local other
  for other in $NODES; do
    [ "$other" != "$1" ] && beam_pid "$other" >/dev/null && break
  done
  ctl "$other" -q forget_cluster_node "$(node_name "$1")"
  rm -rf "$BASE/n$1/mnesia" && mkdir -p "$BASE/n$1/mnesia"  # it can only come back empty
  say "node $1 ($(node_name "$1")) removed from the cluster; 'start $1' adds it back empty"
}

cmd_ctl() {  # N rabbitmqctl-args...: rabbitmqctl on node N
  node_arg "${1:-}"
  load
  local n=$1
  shift
  ctl "$n" "$@"
}

cmd_urls() {
  load
  for n in $NODES; do echo "amqp://guest:guest@$(ip_of "$n"):$(amqp_of "$n")/"; done
}

check_args
case "${1:-}" in
  up | down | heal | status | urls) "cmd_$1" ;;
  kill | stop | start | partition | forget) "cmd_$1" "${2:-}" ;;
  ctl) shift; cmd_ctl "$@" ;;
  *) die "usage: scripts/cluster.sh rabbitmq up|down|kill N|stop N|start N|forget N|partition N|heal|status|urls|ctl N ARGS..." ;;
esac
