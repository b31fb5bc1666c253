#!/usr/bin/env bash
# The whole suite (make test): the tiers of tests/ (its folders) in four lanes run side by side.
# Most of the time of the backend, cluster and deploy tiers is waiting on real servers and
# processes, not CPU, so the lanes share 2 cores well and the suite fits CI's budget. The lanes
# are of about the same length on this project's 2-core machine:
#   lane 1: tests/unit tests/docs (property tests, type checkers), then tests/deploy
#   lane 2: tests/backends/rabbitmq tests/backends/nats, then the fleet simulator (tests/cluster),
#           then the RabbitMQ tests again on RabbitMQ 4.0 with Mnesia
#   lane 3: the other backends (redis, sql, multi), then tests/web, then the RabbitMQ tests again
#           on RabbitMQ 4.0 with Khepri
#   lane 4: the rest of tests/cluster, then the NATS cluster tests again on the current server
# The RabbitMQ tests are tests/backends/rabbitmq and the RabbitMQ ones of tests/backends/multi;
# RABBITMQ_SERVER chooses the broker (tests/support/servers.py; scripts/rabbitmq4.sh, which
# scripts/services.sh runs, starts the 4.0 nodes).
# Each lane's output is printed when it ends; the last thing printed is the summary of all
# (failures first), ending with one line `tests: N passed, N failed`. Exit status: non-zero if
# any lane failed (pytest's 5, no test ran, included). Extra pytest arguments go to every run:
# scripts/test-tiers.sh --durations=20
set -uo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-.venv/bin}
LOGS=${TEST_LOGS:-.test-logs}
mkdir -p "$LOGS"
rm -f "$LOGS"/*.log "$LOGS"/lane*-part*

# Each pytest run draws its own tag for what it names on the servers (tests/support/names.py).
unset BROKERSCHED_TEST_RUN

part() { # a titled pytest run within a lane: part TITLE [VAR=value...] -- PYTEST ARGS
	local title=$1 status=0
	shift
	local env=()
	while [ "$1" != "--" ]; do env+=("$1") && shift; done
	shift
	echo "== $title"
	env "${env[@]}" "$BIN/pytest" -p no:cacheprovider "$@" || status=$?
	return $status
}

rabbitmq4() { # the RabbitMQ tests on a RabbitMQ 4.0 node of scripts/rabbitmq4.sh: NODE ARGS...
	local node=$1 store
	shift
	store=${node^}
	part "tests/backends/rabbitmq, multi -k rabbitmq on RabbitMQ 4.0 ($store)" \
		"RABBITMQ_SERVER=4-$node" -- "$@" tests/backends/rabbitmq tests/backends/multi -k rabbitmq
}

lane1() {
	local status=0
	part "tests/unit tests/docs" -- "$@" tests/unit tests/docs || status=1
	part "tests/deploy" -- "$@" tests/deploy || status=1
	return $status
}
lane2() {
	local status=0
	part "tests/backends: rabbitmq, nats" -- "$@" tests/backends/rabbitmq tests/backends/nats ||
		status=1
	part "tests/cluster: the fleet simulator" -- "$@" tests/cluster/test_simulate.py || status=1
	rabbitmq4 mnesia "$@" || status=1
	return $status
}
lane3() {
	local status=0
	part "tests/backends: the others" -- "$@" tests/backends \
		--ignore=tests/backends/rabbitmq --ignore=tests/backends/nats || status=1
	part "tests/web" -- "$@" tests/web || status=1
	rabbitmq4 khepri "$@" || status=1
	return $status
}
lane4() {
	local status=0
	part "tests/cluster: the rest" -- "$@" tests/cluster --ignore=tests/cluster/test_simulate.py ||
		status=1
	part "tests/cluster/test_nats_cluster.py on the current nats-server" NATS_SERVER=current -- \
		"$@" tests/cluster/test_nats_cluster.py || status=1
	return $status
}

LANES=(1 2 3 4)
started=$(date +%s)
declare -A pids
for lane in "${LANES[@]}"; do
	"lane$lane" "$@" >"$LOGS/lane$lane.log" 2>&1 &
	pids[$lane]=$!
done
declare -A exits
for lane in "${LANES[@]}"; do # print each lane as it ends, in order
	wait "${pids[$lane]}"
	exits[$lane]=$?
	echo
	echo "================ lane $lane (exit ${exits[$lane]}, $(($(date +%s) - started)) s) ================"
	cat "$LOGS/lane$lane.log"
done

summary() { # a pytest log's short summary of failures, then its closing line
	sed -n '/short test summary info/,$p' "$1" | grep -E '^(FAILED|ERROR) ' || true
	grep -E '^(=+ )?[0-9]+ (passed|failed|error)|no tests ran|left behind' "$1" | tail -n 1
}
echo
echo "================ summary ($(($(date +%s) - started)) s) ================"
failed_lanes=()
for lane in "${LANES[@]}"; do
	echo "lane $lane, exit ${exits[$lane]}:"
	csplit -s -z -f "$LOGS/lane$lane-part" "$LOGS/lane$lane.log" '/^== /' '{*}'
	for piece in "$LOGS/lane$lane-part"*; do
		head -n 1 "$piece"
		summary "$piece"
	done
	[ "${exits[$lane]}" -eq 0 ] || failed_lanes+=("$lane")
done
count() { # the sum of "N <word>" over every pytest closing line of every lane
	grep -hE '^=+ .*[0-9]+ (passed|failed|error)' "$LOGS"/lane?.log |
		grep -oE "[0-9]+ $1" | awk '{n += $1} END {print n + 0}'
}
passed=$(count passed)
failed=$(($(count failed) + $(count errors?)))
if [ ${#failed_lanes[@]} -eq 0 ]; then
	echo "every lane passed"
	echo "tests: $passed passed, $failed failed"
	exit 0
fi
echo "FAILED: lane(s) ${failed_lanes[*]} (the failures are listed above)"
echo "tests: $passed passed, $((failed > 0 ? failed : 1)) failed"
exit 1
