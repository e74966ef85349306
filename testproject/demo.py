"""The demo: 4 instances of ``manage.py nightly_report`` start at once, twice.

Round 1: the lock lets exactly one of them work; the others skip. Round 2, after round 1
ended: 4 more start at once with ``--lock-wait``, so that each waits its turn for the lock
(which the others hold only while they read the ledger), and the ledger (``job_runs``) then
refuses each of them today's slot, which is done. Without the wait, an instance that found
the lock held by another instance of round 2 (reading the ledger) would skip for that reason
instead, before asking the ledger. Runs on the SQLite file by default; set DATABASE_URL to
use PostgreSQL or MariaDB.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

INSTANCES = 4
#: Round 2's --lock-wait, in seconds: far more than 4 instances take to read the ledger.
LOCK_WAIT = 60
ROOT = Path(__file__).resolve().parent.parent
MANAGE = [sys.executable, str(ROOT / "manage.py")]
# What an instance did, by what it printed: the job's own line, or its skip line.
RAN = "RAN"
LOCK_BUSY = "skipped: another instance held the lock"
SLOT_DONE = "skipped: today's slot is done"
VERDICTS = {
    "took the lock": RAN,
    "another instance holds lock": LOCK_BUSY,
    "is already done": SLOT_DONE,
}


def start_instances(*options: str) -> Counter[str]:
    """Start the instances together; print what each did; count the verdicts."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    processes = [
        subprocess.Popen(
            [*MANAGE, "nightly_report", "--seconds", "3", *options],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for _ in range(INSTANCES)
    ]
    verdicts: Counter[str] = Counter()
    for number, process in enumerate(processes, 1):
        output = process.communicate()[0]
        verdict = next((v for line, v in VERDICTS.items() if line in output), "FAILED")
        verdicts[verdict] += 1
        print(f"--- instance {number} (exit {process.returncode}): {verdict}")
        print(output.rstrip())
    return verdicts


def summary(verdicts: Counter[str]) -> str:
    """A round in one line, e.g. 1 of 4 did the work; 3 skipped: another instance held the
    lock."""
    parts = [f"{verdicts[RAN]} of {INSTANCES} did the work"]
    parts += [f"{count} {verdict}" for verdict, count in verdicts.items() if verdict != RAN]
    return "; ".join(parts)


def main() -> int:
    subprocess.run([*MANAGE, "migrate", "--verbosity", "0"], check=True, cwd=ROOT)
    import django

    django.setup()
    from advisory_lock.models import JobRun

    JobRun.objects.filter(job_name="example.nightly_report").delete()  # a fresh demo

    print(f"Round 1: {INSTANCES} instances of `manage.py nightly_report` start at once.\n")
    first = start_instances()
    print(f"\n=> {summary(first)}.\n")
    print(
        f"Round 2: {INSTANCES} more instances, after the first finished, with "
        f"`--lock-wait {LOCK_WAIT}`: each waits its turn for the lock, then the ledger refuses "
        f"it today's slot, which is done.\n"
    )
    second = start_instances("--lock-wait", str(LOCK_WAIT))
    print(f"\n=> {summary(second)}.\n")
    print("The job_runs ledger (`manage.py job_runs`):\n")
    subprocess.run([*MANAGE, "job_runs"], check=True, cwd=ROOT)
    print(
        "\nSee it in the admin: `make serve`, then http://127.0.0.1:8000/admin/advisory_lock/jobrun/"
        "\n(login admin / admin)."
    )
    one_ran = first[RAN] == 1 and first[RAN] + first[LOCK_BUSY] + first[SLOT_DONE] == INSTANCES
    return 0 if one_ran and second[SLOT_DONE] == INSTANCES else 1


if __name__ == "__main__":
    sys.exit(main())
