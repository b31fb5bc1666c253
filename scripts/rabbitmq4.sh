#!/usr/bin/env bash
# RabbitMQ 4.x beside the machine's own RabbitMQ 3.10 (127.0.0.1:5672): Debian 13's
# rabbitmq-server in a Debian 13 (trixie) root of its own, its nodes on other ports. Idempotent:
# run it as often as you like (make test runs it through scripts/services.sh).
#
#   scripts/rabbitmq4.sh [up [NODE...]]   build the root if needed, start each node that is down
#                                         (default: every node), print their AMQP URLs
#   scripts/rabbitmq4.sh stop [NODE...]   stop the nodes cleanly (their data stays)
#   scripts/rabbitmq4.sh restart [NODE...]  stop, then up (a new open-files limit takes effect)
#   scripts/rabbitmq4.sh status           each node: running or down, its limit, its URL
#   scripts/rabbitmq4.sh url NODE         the node's AMQP URL
#   scripts/rabbitmq4.sh ctl NODE ARGS    rabbitmqctl ARGS on the node (its own CLI, in the root)
#   scripts/rabbitmq4.sh destroy          stop every node, remove the root and its data
#
# The nodes (all on 127.0.0.1, user guest/guest, the management plugin enabled):
#   mnesia  rmq4-mnesia@localhost  AMQP 5673, management 15673, distribution 25673: RabbitMQ
#           4.0 as Debian ships it (Mnesia, the deprecated features permitted, as by default)
#   khepri  rmq4-khepri@localhost  AMQP 5674, management 15674, distribution 25674: the
#           metadata store Khepri (experimental on 4.0, enabled with `rabbitmqctl
#           enable_feature_flag --opt-in khepri_db` at its first start) and the deprecated
#           features transient_nonexcl_queues, global_qos and queue_master_locator denied: the
#           defaults of RabbitMQ 4.3, which removed Mnesia and denies them unless permitted
#
# The root: `debootstrap --variant=minbase trixie` from the mirror apt already uses here, then
# `apt-get install rabbitmq-server` in it (Erlang/OTP 27, RabbitMQ 4.0.5 on Debian 13). It lives
# outside any clone ($BROKERSCHED_RMQ4_ROOT), so every clone and CI run on this machine reuses
# it; it is built under <root>.partial and moved in place only once complete, so a failed
# debootstrap is started again from scratch at the next run, and an interrupted install is
# finished. The nodes share the host's network namespace and its epmd (127.0.0.1:4369; the first
# Erlang node up starts it); they run as the root's user rabbitmq (given the host's uid when the
# host has a user rabbitmq), as Debian's systemd unit runs them (/usr/lib/rabbitmq/bin/
# rabbitmq-server in /var/lib/rabbitmq), each with its data, logs, configuration and Erlang
# cookie in /var/lib/rabbitmq/<node> of the root. A node killed (kill -9) is down: the next run
# starts it again on its data.
#
# Settings (environment):
#   BROKERSCHED_RMQ4_ROOT    the root (default /var/lib/brokersched/rabbitmq4-trixie)
#   BROKERSCHED_RMQ4_MIRROR  the Debian mirror (default: the one apt uses here, else
#                            http://deb.debian.org/debian)
#   BROKERSCHED_RMQ4_NOFILE  the nodes' soft open-files limit (default 65536, Debian's systemd
#                            unit's LimitNOFILE; the 3.10 service here runs with 1024). A
#                            running node keeps the limit it started with: `restart` applies a
#                            new one. Above the hard limit a process here may not raise (no
#                            CAP_SYS_RESOURCE), the hard limit is used and said.
# Needs root (debootstrap, chroot, mount); installs debootstrap with apt-get when it is missing.
set -euo pipefail

ROOT=${BROKERSCHED_RMQ4_ROOT:-/var/lib/brokersched/rabbitmq4-trixie}
NOFILE=${BROKERSCHED_RMQ4_NOFILE:-65536}
SUITE=trixie
NODES=(mnesia khepri)
BOOT_S=180
INSIDE=/var/lib/rabbitmq  # the nodes' directory, inside the root

say() { echo "rabbitmq4: $*" >&2; }
die() { say "$*"; exit 1; }

# --- the nodes ---------------------------------------------------------------------------

check_node() { # NODE
  case "${1:-}" in
    mnesia | khepri) ;;
    *) die "node '${1:-}' must be one of: ${NODES[*]}" ;;
  esac
}
node_name() { echo "rmq4-$1@localhost"; }
amqp_port() { case $1 in mnesia) echo 5673 ;; khepri) echo 5674 ;; esac; }
http_port() { echo $(($(amqp_port "$1") + 10000)); }
dist_port() { echo $(($(amqp_port "$1") + 20000)); }
url_of() { echo "amqp://guest:guest@127.0.0.1:$(amqp_port "$1")/"; }
dir_of() { echo "$ROOT$INSIDE/$1"; } # the node's directory, seen from the host

listening() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

in_root() { # NODE command...: as the root's rabbitmq, with the node's environment
  local node=$1
  shift
  chroot --userspec=rabbitmq:rabbitmq "$ROOT" env -i -C "$INSIDE" \
    HOME="$INSIDE/$node" PATH=/usr/sbin:/usr/bin:/sbin:/bin LC_ALL=C.UTF-8 \
    RABBITMQ_CONF_ENV_FILE="$INSIDE/$node/env.conf" "$@"
}

ctl() { # NODE rabbitmqctl-args...
  local node=$1
  shift
  in_root "$node" /usr/lib/rabbitmq/bin/rabbitmqctl -n "$(node_name "$node")" "$@"
}

beam_pid() { # NODE: the node's Erlang VM, if it runs (checked: a stale pid file may name another)
  local file pid
  file="$(dir_of "$1")/beam.pid"
  [ -s "$file" ] || return 1
  pid=$(cat "$file")
  [[ $pid =~ ^[0-9]+$ ]] && [ -r "/proc/$pid/cmdline" ] || return 1
  [ "$(readlink "/proc/$pid/root")" = "$(readlink -f "$ROOT")" ] || return 1
  tr '\0' ' ' <"/proc/$pid/cmdline" | grep -q -- "beam.* -home $INSIDE/$1 " || return 1
  echo "$pid"
}

open_files() { # PID: the process's soft open-files limit
  awk '/^Max open files/ {print $4}' "/proc/$1/limits"
}

write_node() { # NODE: its configuration (rewritten at each start), its dirs and cookie (kept)
  local node=$1 dir
  dir=$(dir_of "$node")
  mkdir -p "$dir/mnesia" "$dir/log"
  if [ ! -s "$dir/.erlang.cookie" ]; then
    python3 -c 'import secrets; print(secrets.token_hex(20), end="")' >"$dir/.erlang.cookie"
  fi
  echo "[rabbitmq_management]." >"$dir/enabled_plugins"
  {
    echo "# Written by scripts/rabbitmq4.sh at each start of node $node."
    echo "listeners.tcp.default = 127.0.0.1:$(amqp_port "$node")"
    echo "management.tcp.ip = 127.0.0.1"
    echo "management.tcp.port = $(http_port "$node")"
    echo "log.console = false"
    echo "log.file.level = info"
    if [ "$node" = khepri ]; then
      echo "deprecated_features.permit.transient_nonexcl_queues = false"
      echo "deprecated_features.permit.global_qos = false"
      echo "deprecated_features.permit.queue_master_locator = false"
    fi
  } >"$dir/rabbitmq.conf"
  cat >"$dir/env.conf" <<EOF
# Written by scripts/rabbitmq4.sh at each start of node $node.
RABBITMQ_NODENAME=$(node_name "$node")
RABBITMQ_NODE_IP_ADDRESS=127.0.0.1
RABBITMQ_NODE_PORT=$(amqp_port "$node")
RABBITMQ_DIST_PORT=$(dist_port "$node")
RABBITMQ_CONFIG_FILE=$INSIDE/$node/rabbitmq.conf
RABBITMQ_ENABLED_PLUGINS_FILE=$INSIDE/$node/enabled_plugins
RABBITMQ_MNESIA_BASE=$INSIDE/$node/mnesia
RABBITMQ_LOG_BASE=$INSIDE/$node/log
RABBITMQ_PID_FILE=$INSIDE/$node/beam.pid
RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS="-kernel inet_dist_use_interface {127,0,0,1}"
RABBITMQ_CTL_ERL_ARGS="-kernel inet_dist_use_interface {127,0,0,1}"
ERL_EPMD_ADDRESS=127.0.0.1
EOF
  chroot "$ROOT" chown -R rabbitmq:rabbitmq "$INSIDE/$node"
  chmod 400 "$dir/.erlang.cookie"
}

nofile_limits() { # the soft:hard open-files limits a node starts with (says when it cannot)
  local hard
  hard=$(ulimit -Hn)
  if [ "$hard" = unlimited ] || [ "$NOFILE" -le "$hard" ]; then
    echo "$NOFILE:$hard"
  elif prlimit --nofile="$NOFILE:$NOFILE" true 2>/dev/null; then
    echo "$NOFILE:$NOFILE"
  else
    say "an open-files limit of $NOFILE is above the hard limit $hard, which this process may" \
      "not raise (no CAP_SYS_RESOURCE): the node gets $hard"
    echo "$hard:$hard"
  fi
}

start_node() { # NODE: start it and wait until it serves AMQP
  local node=$1 dir log pid mark limits
  dir=$(dir_of "$node")
  write_node "$node"
  rm -f "$dir/beam.pid"
  limits=${LIMITS:=$(nofile_limits)}
  log="$dir/log/$(node_name "$node").log"
  mark=$( (wc -l <"$log") 2>/dev/null || echo 0)
  say "starting node $node ($(node_name "$node"), open files ${limits%%:*})"
  # setsid: the node outlives this script and the terminal or make that ran it; it must not
  # hold the lock (fd 9) for its whole life.
  setsid prlimit --nofile="$limits" chroot --userspec=rabbitmq:rabbitmq "$ROOT" env -i \
    -C "$INSIDE" HOME="$INSIDE/$node" PATH=/usr/sbin:/usr/bin:/sbin:/bin LC_ALL=C.UTF-8 \
    RABBITMQ_CONF_ENV_FILE="$INSIDE/$node/env.conf" /usr/lib/rabbitmq/bin/rabbitmq-server \
    >>"$dir/stdout.log" 2>&1 </dev/null 9>&- &
  pid=$!
  for _ in $(seq 1 $((BOOT_S * 5))); do
    if listening "$(amqp_port "$node")" && beam_pid "$node" >/dev/null; then
      if [ "$node" = khepri ]; then enable_khepri; fi
      return 0
    fi
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.2
  done
  say "node $node did not start within $BOOT_S s; the end of its logs ($dir):"
  tail -n 15 "$dir/stdout.log" >&2 || true
  tail -n "+$((mark + 1))" "$log" 2>/dev/null | tail -n 15 >&2 || true
  kill_node "$node"
  return 1
}

enable_khepri() { # once per node's data: Mnesia's metadata moves to Khepri (experimental on 4.0)
  local dir
  dir=$(dir_of khepri)
  [ -f "$dir/khepri-enabled" ] && return 0
  say "enabling the feature flag khepri_db on node khepri"
  ctl khepri -q enable_feature_flag --opt-in khepri_db >&2
  local flags
  flags=$(ctl khepri -q list_feature_flags name state)
  grep -qE '^khepri_db[[:space:]]+enabled' <<<"$flags" ||
    die "node khepri: khepri_db is not enabled after enable_feature_flag"
  touch "$dir/khepri-enabled"
}

kill_node() { # NODE: kill -9 its VM (a node that did not come up, or would not stop)
  local pid
  if pid=$(beam_pid "$1"); then
    kill -9 "$pid" 2>/dev/null || true
    while kill -0 "$pid" 2>/dev/null; do sleep 0.05; done
  fi
}

stop_node() { # NODE
  local node=$1 pid
  if ! pid=$(beam_pid "$node"); then
    say "node $node is not running"
    return 0
  fi
  say "stopping node $node"
  ctl "$node" -q stop "$INSIDE/$node/beam.pid" >&2 || kill_node "$node"
}

node_up() { # NODE: start it unless it runs and serves AMQP
  local node=$1 pid
  if pid=$(beam_pid "$node"); then
    if listening "$(amqp_port "$node")"; then
      if [ "$node" = khepri ]; then enable_khepri; fi
      local have wanted
      have=$(open_files "$pid")
      wanted=${LIMITS:=$(nofile_limits)}
      if [ "$have" != "${wanted%%:*}" ]; then
        say "node $node runs with an open-files limit of $have, not ${wanted%%:*}:" \
          "\`scripts/rabbitmq4.sh restart $node\` to change it"
      fi
      say "node $node is up"
      return 0
    fi
    say "node $node runs but does not serve AMQP on $(amqp_port "$node"): starting it again"
    kill_node "$node"
  elif listening "$(amqp_port "$node")"; then
    die "port $(amqp_port "$node") is taken by something else than node $node"
  fi
  start_node "$node"
}

# --- the root ----------------------------------------------------------------------------

apt_mirror() { # the Debian archive apt uses on this machine
  local uri=""
  if command -v apt-get >/dev/null; then
    # shellcheck disable=SC2016  # apt's format, not the shell's
    uri=$(apt-get indextargets --format '$(REPO_URI) $(ORIGIN) $(LABEL)' 2>/dev/null |
      awk '$2 == "Debian" && $3 == "Debian" {print $1; exit}')
  fi
  echo "${uri:-http://deb.debian.org/debian}"
}

unmount_under() { # DIR: everything mounted at or under it, deepest first
  local target
  findmnt -rn -o TARGET | awk -v dir="$1" '$0 == dir || index($0, dir "/") == 1' | sort -r |
    while read -r target; do umount -l "$target" || true; done
}

remove_tree() { # DIR: never through a mount left in it
  unmount_under "$1"
  rm -rf --one-file-system "$1"
}

bootstrap() { # a minimal trixie in $ROOT.partial, moved to $ROOT once complete
  local partial=$ROOT.partial mirror
  mirror=${BROKERSCHED_RMQ4_MIRROR:-$(apt_mirror)}
  if ! command -v debootstrap >/dev/null; then
    say "installing debootstrap"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null
  fi
  [ ! -e "$ROOT" ] ||
    die "$ROOT exists but is no root this script built (no .brokersched-bootstrapped in it):" \
      "remove it or set BROKERSCHED_RMQ4_ROOT"
  [ ! -e "$partial" ] || { say "removing the unfinished $partial"; remove_tree "$partial"; }
  say "debootstrap --variant=minbase $SUITE $partial $mirror (about a minute)"
  mkdir -p "$(dirname "$ROOT")"
  if ! debootstrap --variant=minbase "$SUITE" "$partial" "$mirror" >"$ROOT.debootstrap.log" 2>&1; then
    tail -n 15 "$ROOT.debootstrap.log" >&2
    die "debootstrap failed (all of its output: $ROOT.debootstrap.log); the next run starts it again"
  fi
  unmount_under "$partial"
  touch "$partial/.brokersched-bootstrapped"
  mv "$partial" "$ROOT"
}

same_user_as_host() { # the root's rabbitmq gets the host's uid and gid, when they are free there
  local uid gid
  chroot "$ROOT" getent passwd rabbitmq >/dev/null && return 0
  uid=$(id -u rabbitmq 2>/dev/null) && gid=$(id -g rabbitmq 2>/dev/null) || return 0
  if chroot "$ROOT" getent passwd "$uid" >/dev/null || chroot "$ROOT" getent group "$gid" >/dev/null; then
    return 0
  fi
  chroot "$ROOT" groupadd --system --gid "$gid" rabbitmq
  chroot "$ROOT" useradd --system --uid "$uid" --gid "$gid" --home-dir "$INSIDE" \
    --no-create-home --shell /usr/sbin/nologin --comment "RabbitMQ messaging server" rabbitmq
}

install_rabbitmq() { # rabbitmq-server in the root; finishes an interrupted install
  say "installing rabbitmq-server in $ROOT"
  printf '#!/bin/sh\n# Written by scripts/rabbitmq4.sh: packages start no service here.\nexit 101\n' \
    >"$ROOT/usr/sbin/policy-rc.d"
  chmod 755 "$ROOT/usr/sbin/policy-rc.d"
  printf '127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n' >"$ROOT/etc/hosts"
  same_user_as_host
  mount_proc
  chroot "$ROOT" env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin DEBIAN_FRONTEND=noninteractive sh -c \
    'dpkg --configure -a && apt-get update -qq &&
     apt-get install -y -qq --no-install-recommends rabbitmq-server >/dev/null' >&2 ||
    die "apt-get install rabbitmq-server failed in $ROOT; the next run tries again"
  # shellcheck disable=SC2016  # dpkg-query's format
  chroot "$ROOT" dpkg-query -W -f '${Version}\n' rabbitmq-server >"$ROOT/.brokersched-installed"
}

mount_proc() { # Erlang reads /proc (memory, the schedulers); the mount stays while nodes run
  mountpoint -q "$ROOT/proc" || mount -t proc proc "$ROOT/proc"
}

root_ready() {
  [ -f "$ROOT/.brokersched-bootstrapped" ] || bootstrap
  [ -f "$ROOT/.brokersched-installed" ] || install_rabbitmq
  mount_proc
}

# --- commands ----------------------------------------------------------------------------

nodes_of() { # NODE... (default: all): checked, one a line
  local node
  [ $# -gt 0 ] || set -- "${NODES[@]}"
  for node in "$@"; do check_node "$node" && echo "$node"; done
}

lock() { # one run at a time (make test in two clones at once)
  mkdir -p "$(dirname "$ROOT")"
  exec 9>"$ROOT.lock"
  flock -w 900 9 || die "another scripts/rabbitmq4.sh has held $ROOT.lock for 15 minutes"
}

needs_root() {
  [ "$(id -u)" = 0 ] || die "needs root (debootstrap, chroot and mount build and run the root)"
}

check_settings() {
  [[ $NOFILE =~ ^[1-9][0-9]*$ ]] ||
    die "BROKERSCHED_RMQ4_NOFILE '$NOFILE' must be a positive number of open files"
  [[ $ROOT =~ ^/.+[^/]$ ]] ||
    die "BROKERSCHED_RMQ4_ROOT '$ROOT' must be an absolute path, without a trailing /"
}

cmd_up() {
  local nodes node
  nodes=$(nodes_of "$@")
  needs_root
  lock
  root_ready
  for node in $nodes; do node_up "$node"; done
  for node in $nodes; do url_of "$node"; done
}

cmd_stop() {
  local nodes node
  nodes=$(nodes_of "$@")
  needs_root
  lock
  [ -f "$ROOT/.brokersched-installed" ] || { say "no root at $ROOT: nothing runs"; return 0; }
  for node in $nodes; do stop_node "$node"; done
}

cmd_restart() {
  cmd_stop "$@"
  exec 9>&-
  cmd_up "$@"
}

cmd_status() {
  local node pid version=none
  [ -f "$ROOT/.brokersched-installed" ] && version=$(cat "$ROOT/.brokersched-installed")
  echo "root $ROOT (rabbitmq-server $version)"
  for node in "${NODES[@]}"; do
    if pid=$(beam_pid "$node"); then
      echo "node $node $(node_name "$node") $(url_of "$node"): running (pid $pid, open files $(open_files "$pid"))"
    else
      echo "node $node $(node_name "$node") $(url_of "$node"): down"
    fi
  done
}

cmd_destroy() {
  local node
  needs_root
  lock
  if [ -e "$ROOT" ]; then
    [ -f "$ROOT/.brokersched-bootstrapped" ] ||
      die "$ROOT is no root this script built (no .brokersched-bootstrapped in it): not removed"
    for node in "${NODES[@]}"; do kill_node "$node"; done
    remove_tree "$ROOT"
  fi
  [ ! -e "$ROOT.partial" ] || remove_tree "$ROOT.partial"
  rm -f "$ROOT.debootstrap.log"
  say "removed $ROOT"
}

check_settings
case "${1:-up}" in
  up | stop | restart)
    command=${1:-up}
    shift || true
    "cmd_$command" "$@"
    ;;
  status) cmd_status ;;
  url)
    check_node "${2:-}"
    url_of "$2"
    ;;
  ctl)
    check_node "${2:-}"
    needs_root
    [ -f "$ROOT/.brokersched-installed" ] || die "no root at $ROOT: run scripts/rabbitmq4.sh up"
    node=$2
    shift 2
    ctl "$node" "$@"
    ;;
  destroy) cmd_destroy ;;
  *) die "usage: scripts/rabbitmq4.sh [up [NODE...]] | stop [NODE...] | restart [NODE...] | status | url NODE | ctl NODE ARGS... | destroy (NODE: ${NODES[*]})" ;;
esac
