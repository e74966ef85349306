"""The demo: 4 instances of ``manage.py nightly_report`` start at once, twice.

Round 1: the lock lets exactly one of them work. Round 2: the ledger (``job_runs``) refuses
today's slot, which is done, to all four. Runs on the SQLite file by default; set
DATABASE_URL to use PostgreSQL or MariaDB.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

INSTANCES = 4
ROOT = Path(__file__).resolve().parent.parent
MANAGE = [sys.executable, str(ROOT / "manage.py")]


def start_instances() -> int:
    """Start the instances together; print what each did; return how many did the work."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    processes = [
        subprocess.Popen(
            [*MANAGE, "nightly_report", "--seconds", "3"],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for _ in range(INSTANCES)
    ]
    ran = 0
    for number, process in enumerate(processes, 1):
        output = process.communicate()[0]
        worked = "took the lock" in output
        ran += worked
        verdict = "RAN" if worked else "skipped"
        print(f"--- instance {number} (exit {process.returncode}): {verdict}")
        print(output.rstrip())
    return ran


def main() -> int:
    subprocess.run([*MANAGE, "migrate", "--verbosity", "0"], check=True, cwd=ROOT)
    import django

    django.setup()
    from advisory_lock.models import JobRun

    JobRun.objects.filter(job_name="example.nightly_report").delete()  # a fresh demo

    print(f"Round 1: {INSTANCES} instances of `manage.py nightly_report` start at once.\n")
    first = start_instances()
    print(f"\n=> {first} of {INSTANCES} did the work (the lock).\n")
    print(f"Round 2: {INSTANCES} more instances, after the first finished.\n")
    second = start_instances()
    print(f"\n=> {second} of {INSTANCES} did the work (the ledger: today's slot is done).\n")
    print("The job_runs ledger (`manage.py job_runs`):\n")
    subprocess.run([*MANAGE, "job_runs"], check=True, cwd=ROOT)
    print(
        "\nSee it in the admin: `make serve`, then http://127.0.0.1:8000/admin/advisory_lock/jobrun/"
        "\n(login admin / admin)."
    )
    return 0 if (first, second) == (1, 0) else 1


if __name__ == "__main__":
    sys.exit(main())
