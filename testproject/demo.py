"""The demo: start 4 instances of ``manage.py nightly_report`` at once; exactly one works.

Runs on the SQLite file by default; set DATABASE_URL to use PostgreSQL or MariaDB.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

INSTANCES = 4
ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    manage = [sys.executable, str(ROOT / "manage.py")]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    subprocess.run([*manage, "migrate", "--verbosity", "0"], check=True, cwd=ROOT, env=env)
    print(f"Starting {INSTANCES} instances of `manage.py nightly_report` at the same moment...")
    processes = [
        subprocess.Popen(
            [*manage, "nightly_report", "--seconds", "3"],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for _ in range(INSTANCES)
    ]
    outputs = [process.communicate()[0] for process in processes]
    ran = 0
    for number, (process, output) in enumerate(zip(processes, outputs, strict=True), 1):
        worked = "done" in output
        ran += worked
        verdict = "RAN" if worked else "skipped"
        print(f"\n--- instance {number} (exit {process.returncode}): {verdict}")
        print(output.rstrip())
    print(f"\n{ran} of {INSTANCES} instances did the work.")
    return 0 if ran == 1 else 1


if __name__ == "__main__":
    sys.exit(main())
