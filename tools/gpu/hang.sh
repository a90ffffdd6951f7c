#!/usr/bin/env bash
# Repeats one flaky GPU test to catch a rare hang: HANG_TEST (default the dead-peer IPC test with
# the entry fence, which hung in Runs 19 and 20) HANG_REPS times (default 6). The test's hang
# deadline is cut to TIDE_TEST_HANG_S (default here 30 s): past it the test sends SIGUSR1 to the
# stuck rank processes (Python stacks on stderr; pytest -s keeps them in the log); before it
# (HANG_DUMP_AFTER_S, 20 s) this script records each rank process's thread states, syscalls and,
# where gdb or eu-stack exists, native stacks.
# A failed run's log stays as $OUT/hang_fail_<i>.log. Summary LAST.
set -uo pipefail
source "$(dirname "$0")/common.sh"
TEST=${HANG_TEST:-"tests/test_cuda_ipc.py::test_peer_that_never_runs_is_a_timeout_naming_rank_op_seq[True]"}
REPS=${HANG_REPS:-6}
export TIDE_TEST_HANG_S=${TIDE_TEST_HANG_S:-30}
DUMP_AFTER_S=${HANG_DUMP_AFTER_S:-20}  # a passing run takes ~10 s
pass=0; fail=0; times=()
native() {  # native() PID...: thread states and stacks of the rank processes
  for p in "$@"; do
    echo "---- pid $p: $(tr '\0' ' ' </proc/$p/cmdline 2>/dev/null | cut -c1-120)"
    for t in /proc/$p/task/*; do
      grep -q futex_do_wait $t/wchan 2>/dev/null && [[ ${t##*/} != "$p" ]] && continue  # idle pool threads
      echo "  tid ${t##*/} $(awk '{print $2, $3}' $t/stat 2>/dev/null) wchan $(cat $t/wchan 2>/dev/null) syscall $(cut -d' ' -f1-3 $t/syscall 2>/dev/null)"
    done
    cat /proc/$p/task/$p/stack 2>/dev/null | head -12
    if command -v gdb >/dev/null; then
      timeout 60 gdb -p "$p" -batch -ex "thread apply all bt 25" 2>/dev/null | grep -E "^#|^Thread" | head -120
    elif command -v eu-stack >/dev/null; then
      timeout 60 eu-stack -p "$p" 2>/dev/null | head -120
    else
      echo "  (no gdb or eu-stack on this machine)"
    fi
  done
}
for i in $(seq 1 "$REPS"); do
  t0=$(date +%s)
  log="$OUT/hang_run.log"
  timeout 240 $PY -m pytest -q -s -p no:cacheprovider "$TEST" >"$log" 2>&1 &
  pid=$!
  dumped=0
  while kill -0 $pid 2>/dev/null; do
    sleep 1
    if (( dumped == 0 && $(date +%s) - t0 > DUMP_AFTER_S )); then
      dumped=1
      kids=$(pgrep -f "multiprocessing.spawn" | xargs)
      { echo "==== $(date -u +%T) still running after $(( $(date +%s) - t0 )) s; rank processes: $kids"; native $kids; } >>"$log" 2>&1
      for k in $kids; do kill -USR2 "$k" 2>/dev/null; sleep 0.3; done  # native stacks (tide._core handler)
    fi
  done
  wait $pid
  rc=$?
  if (( rc == 0 )); then
    pass=$((pass + 1))
  else
    fail=$((fail + 1))
    # native frames of tide._core (SIGUSR2 handler) -> function names
    so=$(ls tide/_core*.so 2>/dev/null | head -1)
    if [[ -n $so ]] && command -v addr2line >/dev/null; then
      echo "==== tide._core frames" >>"$log"
      grep -oE "_core[^ ]*\.so\(\+0x[0-9a-f]+\)" "$log" | grep -oE "0x[0-9a-f]+" | sort -u | while read -r a; do
        echo "$a $(addr2line -Cfpe "$so" "$a" | head -1 | cut -c1-160)"
      done >>"$log"
    fi
    cp "$log" "$OUT/hang_fail_$i.log"
    grep -vE "^\s*$|futex_do_wait|poll_schedule|libpython|^\[<0>\]" "$log" | tail -150
  fi
  times+=("$(( $(date +%s) - t0 ))")
done
rm -f "$OUT/hang_run.log"
echo
echo "== hang: $TEST x $REPS (hang report after ${TIDE_TEST_HANG_S} s)"
echo "passed $pass, failed $fail; seconds per run: ${times[*]}"
(( fail == 0 ))
