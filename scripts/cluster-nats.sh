#!/usr/bin/env bash
# A throwaway 3-node NATS JetStream cluster on this machine, from the installed nats-server
# (Debian: /usr/sbin/nats-server), without Docker; for the cluster chaos tests and by hand.
#
#   bash scripts/cluster-nats.sh up            # start n1 n2 n3; prints the server list
#   bash scripts/cluster-nats.sh status        # each node: pid, client URL, JetStream health
#   bash scripts/cluster-nats.sh leader STREAM # the node that leads STREAM (n1, n2 or n3)
#   bash scripts/cluster-nats.sh kill 2        # kill -9 of node 2 (a crash)
#   bash scripts/cluster-nats.sh stop 2        # a clean stop of node 2 (SIGTERM)
#   bash scripts/cluster-nats.sh start 2       # start node 2 again, same store and ports
#   bash scripts/cluster-nats.sh partition 2   # cut node 2 off silently (its link drops)
#   bash scripts/cluster-nats.sh heal          # bring every cut link back
#   bash scripts/cluster-nats.sh down          # stop what `up` started, remove what it made
#
# State (configs, stores, logs, pids) lives in BROKERSCHED_NATS_CLUSTER_DIR (default
# ${TMPDIR:-/tmp}/brokersched-nats-cluster); several clusters can run side by side, one per
# directory. `up` writes "$DIR/env" (BROKERSCHED_NATS_CLUSTER=url1,url2,url3, MODE=...).
#
# Two modes, chosen at `up` (BROKERSCHED_NATS_CLUSTER_MODE=netns|loopback forces one):
# - netns (needs root and `ip netns`): each node runs in a network namespace of its own, linked
#   by a veth to a bridge in a hub namespace; the host reaches them through one more veth, on a
#   private /24 (10.213.X.0/24, X picked from the directory, refused if already in use). Client
#   port 4222, routes 6222, monitoring 8222, on each node's own address. `partition N` sets
#   node N's bridge port down: its routes and clients hang silently (no reset), as when a
#   cable is pulled. Nothing outside these namespaces and the one host veth is touched.
# - loopback: nodes on 127.0.0.1, free ports. Kills and stops work; `partition` is refused
#   (exit 3, saying why): nothing short of a namespace silences a node's routes.
# The machine's own nats-server (127.0.0.1:4222) is never touched: in netns mode each node's
# 4222 is in its own namespace; in loopback mode the ports are free ones.
set -euo pipefail

NATS_SERVER=${NATS_SERVER:-/usr/sbin/nats-server}
DIR=${BROKERSCHED_NATS_CLUSTER_DIR:-${TMPDIR:-/tmp}/brokersched-nats-cluster}
NODES=(1 2 3)

die() { echo "cluster-nats: $*" >&2; exit "${EXIT:-1}"; }
say() { echo "cluster-nats: $*" >&2; }

# A short tag from the directory: names namespaces and links (interface names <= 15 chars).
tag() { printf '%s' "$(cd "$DIR" 2>/dev/null && pwd -P || echo "$DIR")" | md5sum | cut -c1-6; }

netns_works() {
  [[ $(id -u) == 0 ]] && command -v ip >/dev/null 2>&1 || return 1
  local probe="bsnprobe$$"
  ip netns add "$probe" 2>/dev/null || return 1
  ip netns del "$probe"
}

free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'
}

load() {
  [[ -f $DIR/env ]] || die "no cluster in $DIR (run: bash scripts/cluster-nats.sh up)"
  # shellcheck disable=SC1091
  source "$DIR/env"
}

node_arg() {
  [[ ${1:-} =~ ^[123]$ ]] || die "node must be 1, 2 or 3, got '${1:-}'"
}

alive() {  # node -> 0 when the process we started for it runs
  local pidfile=$DIR/n$1.pid pid cmdline state
  [[ -f $pidfile ]] || return 1
  pid=$(<"$pidfile")
  cmdline=$(tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null) || return 1
  state=$(sed 's/.*) //' "/proc/$pid/stat" 2>/dev/null) || return 1
  [[ ${state:0:1} != Z ]] || return 1  # dead, not yet reaped
  # Empty while it execs (setsid, then ip netns exec, then nats-server): the kernel installs
  # the new program before its arguments; reading then made `start` say "n1 exited".
  [[ -z $cmdline || $cmdline == *"$DIR/n$1.conf"* ]]
}

write_config() {  # node
  local n=$1 routes="" m
  for m in "${NODES[@]}"; do
    [[ $m == "$n" ]] || routes+="    nats-route://${HOSTS[m]}:${ROUTE_PORTS[m]}"$'\n'
  done
  mkdir -p "$DIR/n$n"
  cat >"$DIR/n$n.conf" <<EOF
server_name: n$n
listen: ${HOSTS[n]}:${CLIENT_PORTS[n]}
http: ${HOSTS[n]}:${HTTP_PORTS[n]}
jetstream {
  store_dir: "$DIR/n$n"
  max_memory_store: 64MB
  max_file_store: 1GB
}
cluster {
  name: $CLUSTER_NAME
  listen: ${HOSTS[n]}:${ROUTE_PORTS[n]}
  routes: [
$routes  ]
}
EOF
}

start_node() {  # node
  local n=$1
  alive "$n" && { say "n$n already runs (pid $(<"$DIR/n$n.pid"))"; return 0; }
  local run=()
  [[ $MODE == netns ]] && run=(ip netns exec "bsn${TAG}n$n")
  # setsid: the node outlives the shell that started it and gets no signal meant for it.
  setsid "${run[@]}" "$NATS_SERVER" -c "$DIR/n$n.conf" >>"$DIR/n$n.log" 2>&1 </dev/null &
  echo $! >"$DIR/n$n.pid"
}

healthy() {  # node -> 0 once JetStream on it is up (it may still elect leaders)
  curl -fsS --max-time 1 "http://${HOSTS[$1]}:${HTTP_PORTS[$1]}/healthz?js-enabled-only=true" \
    >/dev/null 2>&1
}

wait_healthy() {  # node seconds
  local n=$1 i
  for ((i = 0; i < $2 * 10; i++)); do
    healthy "$n" && return 0
    alive "$n" || die "n$n exited; see $DIR/n$n.log: $(tail -n 3 "$DIR/n$n.log" 2>/dev/null)"
    sleep 0.1
  done
  die "n$n did not answer within $2 s; see $DIR/n$n.log"
}

make_netns() {
  local hub="bsn${TAG}hub" n
  ip netns add "$hub"
  ip -n "$hub" link add br0 type bridge
  ip -n "$hub" link set br0 up
  for n in "${NODES[@]}"; do
    ip netns add "bsn${TAG}n$n"
    ip link add "bsn${TAG}n${n}a" type veth peer name "bsn${TAG}n${n}b"
    ip link set "bsn${TAG}n${n}a" netns "bsn${TAG}n$n"
    ip link set "bsn${TAG}n${n}b" netns "$hub"
    ip -n "bsn${TAG}n$n" link set lo up
    ip -n "bsn${TAG}n$n" addr add "${HOSTS[n]}/24" dev "bsn${TAG}n${n}a"
    ip -n "bsn${TAG}n$n" link set "bsn${TAG}n${n}a" up
    ip -n "$hub" link set "bsn${TAG}n${n}b" master br0 up
  done
  ip link add "bsn${TAG}h" type veth peer name "bsn${TAG}hb"
  ip link set "bsn${TAG}hb" netns "$hub"
  ip -n "$hub" link set "bsn${TAG}hb" master br0 up
  ip addr add "$SUBNET.254/24" dev "bsn${TAG}h"
  ip link set "bsn${TAG}h" up
}

remove_netns() {
  ip link del "bsn${TAG}h" 2>/dev/null || true
  local ns
  for ns in "bsn${TAG}n1" "bsn${TAG}n2" "bsn${TAG}n3" "bsn${TAG}hub"; do
    ip netns del "$ns" 2>/dev/null || true
  done
}

pick_subnet() {
  local x=$((16#${TAG:0:4} % 200 + 20)) try
  for try in 0 1 2 3 4 5 6 7; do
    SUBNET="10.213.$(((x + try * 29) % 250 + 1))"
    ip -o -4 addr | grep -qF " $SUBNET." || ip -4 route | grep -qF "$SUBNET." || return 0
  done
  die "no free 10.213.X.0/24 for the cluster's namespaces"
}

cmd_up() {
  mkdir -p "$DIR"
  DIR=$(cd "$DIR" && pwd -P)
  [[ -f $DIR/env ]] && die "a cluster is already set up in $DIR (run: down)"
  [[ -x $NATS_SERVER ]] || die "nats-server not found at $NATS_SERVER (apt install nats-server)"
  TAG=$(tag)
  MODE=${BROKERSCHED_NATS_CLUSTER_MODE:-}
  if [[ -z $MODE ]]; then
    if netns_works; then MODE=netns; else MODE=loopback; fi
  elif [[ $MODE == netns ]] && ! netns_works; then
    die "BROKERSCHED_NATS_CLUSTER_MODE=netns, but network namespaces are unavailable (root and \`ip netns add\` are needed)"
  elif [[ $MODE != netns && $MODE != loopback ]]; then
    die "BROKERSCHED_NATS_CLUSTER_MODE must be netns or loopback, got '$MODE'"
  fi
  declare -ga HOSTS CLIENT_PORTS ROUTE_PORTS HTTP_PORTS
  local n urls=()
  SUBNET=""
  [[ $MODE == netns ]] && pick_subnet
  for n in "${NODES[@]}"; do
    if [[ $MODE == netns ]]; then
      HOSTS[n]=$SUBNET.$n CLIENT_PORTS[n]=4222 ROUTE_PORTS[n]=6222 HTTP_PORTS[n]=8222
    else
      HOSTS[n]=127.0.0.1 CLIENT_PORTS[n]=$(free_port) ROUTE_PORTS[n]=$(free_port)
      HTTP_PORTS[n]=$(free_port)
    fi
    urls+=("nats://${HOSTS[n]}:${CLIENT_PORTS[n]}")
  done
  CLUSTER_NAME=bsn$TAG
  {
    echo "MODE=$MODE TAG=$TAG SUBNET=$SUBNET CLUSTER_NAME=$CLUSTER_NAME"
    echo "HOSTS=(x ${HOSTS[*]:1}) CLIENT_PORTS=(x ${CLIENT_PORTS[*]:1})"
    echo "ROUTE_PORTS=(x ${ROUTE_PORTS[*]:1}) HTTP_PORTS=(x ${HTTP_PORTS[*]:1})"
    echo "BROKERSCHED_NATS_CLUSTER=$(IFS=,; echo "${urls[*]}")"
  } >"$DIR/env.partial"
  # The env file exists from here on, so that `down` can undo a half-done `up`.
  mv "$DIR/env.partial" "$DIR/env"
  trap 'say "up failed: undoing it"; cmd_down' EXIT
  load
  [[ $MODE == netns ]] && make_netns
  for n in "${NODES[@]}"; do write_config "$n"; start_node "$n"; done
  for n in "${NODES[@]}"; do wait_healthy "$n" 30; done
  trap - EXIT
  say "up ($MODE): $BROKERSCHED_NATS_CLUSTER"
  echo "BROKERSCHED_NATS_CLUSTER=$BROKERSCHED_NATS_CLUSTER"
}

signal_node() {  # node signal
  local n=$1 pid i
  alive "$n" || { say "n$n is not running"; return 0; }
  pid=$(<"$DIR/n$n.pid")
  kill "-$2" "$pid"
  for ((i = 0; i < 150; i++)); do
    [[ -d /proc/$pid ]] || return 0
    # a zombie until its parent (gone: init) reaps it
    [[ $(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null) == Z ]] && return 0
    sleep 0.1
  done
  say "n$n (pid $pid) still runs 15 s after SIG$2; killing it"
  kill -KILL "$pid" 2>/dev/null || true
}

cmd_down() {
  [[ -f $DIR/env ]] || { say "nothing to stop in $DIR"; return 0; }
  load
  local n
  for n in "${NODES[@]}"; do signal_node "$n" KILL; done
  [[ $MODE == netns ]] && remove_netns
  rm -rf "$DIR/n1" "$DIR/n2" "$DIR/n3" "$DIR"/n?.conf "$DIR"/n?.pid "$DIR"/n?.log "$DIR/env"
  rmdir "$DIR" 2>/dev/null || true
  say "down"
}

cmd_partition() {
  node_arg "${1:-}"
  load
  [[ $MODE == netns ]] || EXIT=3 die "partition needs network namespaces (this cluster runs" \
    "in loopback mode: root and \`ip netns add\` are needed at \`up\`); nothing was cut"
  ip -n "bsn${TAG}hub" link set "bsn${TAG}n${1}b" down
  say "n$1 cut off (its link is down: packets to and from it are dropped)"
}

cmd_heal() {
  load
  [[ $MODE == netns ]] || { say "loopback mode: nothing to heal"; return 0; }
  local n
  for n in "${NODES[@]}"; do ip -n "bsn${TAG}hub" link set "bsn${TAG}n${n}b" up; done
  say "every link is up"
}

cmd_status() {
  load
  local n state
  for n in "${NODES[@]}"; do
    if ! alive "$n"; then state=down
    elif healthy "$n"; then state="up pid $(<"$DIR/n$n.pid")"
    else state="starting pid $(<"$DIR/n$n.pid")"; fi
    if [[ $MODE == netns ]] && ip -n "bsn${TAG}hub" -o link show "bsn${TAG}n${n}b" \
      | grep -q 'state DOWN'; then state+=", partitioned"; fi
    echo "n$n nats://${HOSTS[n]}:${CLIENT_PORTS[n]} $state"
  done
}

cmd_leader() {  # stream -> prints the leading node's name (n1..n3); fails when there is none
  [[ -n ${1:-} ]] || die "usage: leader STREAM"
  load
  local n answer
  for n in "${NODES[@]}"; do
    alive "$n" || continue
    answer=$(curl -fsS --max-time 1 \
      "http://${HOSTS[n]}:${HTTP_PORTS[n]}/jsz?streams=true&raft=true" 2>/dev/null) || continue
    if python3 -c '
import json, sys
data, stream = json.loads(sys.argv[1]), sys.argv[2]
for account in data.get("account_details") or []:
    for detail in account.get("stream_detail") or []:
        if detail["name"] == stream and (detail.get("cluster") or {}).get("leader"):
            print(detail["cluster"]["leader"]); sys.exit(0)
sys.exit(1)' "$answer" "$1"; then return 0; fi
  done
  die "no node knows a leader of stream '$1'"
}

case ${1:-} in
  up) cmd_up ;;
  down) cmd_down ;;
  kill) node_arg "${2:-}"; load; signal_node "$2" KILL ;;
  stop) node_arg "${2:-}"; load; signal_node "$2" TERM ;;
  start) node_arg "${2:-}"; load; start_node "$2"; wait_healthy "$2" 30 ;;
  partition) cmd_partition "${2:-}" ;;
  heal) cmd_heal ;;
  status) cmd_status ;;
  leader) cmd_leader "${2:-}" ;;
  *) die "usage: bash scripts/cluster-nats.sh up|down|status|leader STREAM|kill N|stop N|start N|partition N|heal" ;;
esac
