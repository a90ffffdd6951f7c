#!/usr/bin/env bash
# Repeats one flaky GPU test to catch a rare hang: HANG_TEST (default the dead-peer IPC test with
# the entry fence, which hung once in Run 19) HANG_REPS times (default 8), each under its own
# timeout; on a failure the test's output (with the stuck ranks' Python stacks) stays in
# $OUT/hang_fail_<i>.log. Summary table LAST.
set -uo pipefail
source "$(dirname "$0")/common.sh"
TEST=${HANG_TEST:-"tests/test_cuda_ipc.py::test_peer_that_never_runs_is_a_timeout_naming_rank_op_seq[True]"}
REPS=${HANG_REPS:-8}
pass=0; fail=0; times=()
for i in $(seq 1 "$REPS"); do
  t0=$(date +%s)
  if timeout 200 $PY -m pytest -q -p no:cacheprovider "$TEST" >"$OUT/hang_run.log" 2>&1; then
    pass=$((pass + 1))
  else
    fail=$((fail + 1)); cp "$OUT/hang_run.log" "$OUT/hang_fail_$i.log"
    tail -60 "$OUT/hang_run.log"
  fi
  times+=("$(( $(date +%s) - t0 ))")
done
rm -f "$OUT/hang_run.log"
echo
echo "== hang: $TEST x $REPS"
echo "passed $pass, failed $fail; seconds per run: ${times[*]}"
(( fail == 0 ))
