#!/usr/bin/env bash
# Run bench/locks.py with the client, PostgreSQL and MariaDB all pinned to one CPU (see
# shared/BENCHMARKING.md: ratios are stable to a few % that way), then restore the servers'
# affinity, also on failure or Ctrl-C.
#   bench/run_pinned.sh [--pairs N] [--rounds N] [--only postgresql|mysql] [--markdown]
# Environment: PYTHON (default: .venv/bin/python of this checkout), BENCH_CPU (default: 0).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(dirname "$here")"
python="${PYTHON:-$root/.venv/bin/python}"
cpu="${BENCH_CPU:-0}"
all_cpus="0-$(($(nproc --all) - 1))"

# By process name, not `pgrep -f postgres`: that would also match this script when it is
# run with `--only postgresql`.
server_pids() { pgrep -x postgres || true; pgrep -x mariadbd || true; pgrep -x mysqld || true; }
mapfile -t pids < <(server_pids)
if [ ${#pids[@]} -eq 0 ]; then
  echo "run_pinned: no postgres or mariadbd process found; start the servers first" >&2
  exit 1
fi

restore() {
  # Look again: backends forked while pinned (other clients' too) inherited CPU $cpu.
  for pid in $(server_pids); do
    taskset -acp "$all_cpus" "$pid" >/dev/null 2>&1 || true # the process may have exited
  done
}
trap restore EXIT
trap 'exit 130' INT TERM

for pid in "${pids[@]}"; do
  taskset -acp "$cpu" "$pid" >/dev/null 2>&1 || true
done
taskset -c "$cpu" "$python" "$here/locks.py" "$@"
