#!/usr/bin/env bash
# Run `make test` RUNS times in a row while BURNERS busy loops (ordinary priority, not niced)
# compete with it for the CPUs, and print each run's status, duration and the load average.
# A test that fails here but passes on an idle machine depends on timing: that is a defect.
#   scripts/under_load.sh [RUNS] [BURNERS]      (defaults: 3 runs, 8 burners)
set -uo pipefail
cd "$(dirname "$0")/.."
RUNS=${1:-3}
BURNERS=${2:-8}
PYTHON=${PYTHON:-python3}

burners=()
for _ in $(seq "$BURNERS"); do
  "$PYTHON" -c "while True: pass" &
  burners+=($!)
done
trap 'kill "${burners[@]}" 2>/dev/null' EXIT

mkdir -p build
failed=0
for run in $(seq "$RUNS"); do
  started=$(date +%s)
  make test >"build/under-load-$run.log" 2>&1
  status=$?
  [ "$status" -eq 0 ] || failed=1
  echo "under_load: run $run of $RUNS: status $status, $(( $(date +%s) - started )) s," \
    "load average $(cut -d' ' -f1-3 /proc/loadavg), $(grep -E '(passed|failed)' \
    "build/under-load-$run.log" | tail -n 2 | tr '\n' ' ')"
done
exit "$failed"
