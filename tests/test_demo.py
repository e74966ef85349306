"""``make demo`` (testproject/demo.py) prints what the README says it does, every time."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.commands import ROOT
from tests.databases import new_database


def run_demo(url):
    """``python -m testproject.demo`` on the database ``url``: (exit status, output)."""
    process = subprocess.run(
        [sys.executable, "-m", "testproject.demo"],
        cwd=ROOT,
        env={**os.environ, "DJANGO_SETTINGS_MODULE": "testproject.settings", "DATABASE_URL": url},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=240,
    )
    return process.returncode, process.stdout


def test_the_demos_second_round_skips_every_instance_because_todays_slot_is_done(using, tmp_path):
    with new_database(using, tmp_path) as (_, url):
        status, output = run_demo(url)
    assert status == 0, output
    first, rest = output.split("\nRound 2:", 1)
    second = rest.split("\nThe job_runs ledger", 1)[0]
    # Round 1: one instance works; the others skip (the lock is held, or they came late).
    assert "=> 1 of 4 did the work" in first, output
    assert first.count("took the lock, working...") == 1, output
    # Round 2: the README's "all skip: today's slot is done", for each of the four. An
    # instance of round 2 may find the lock held by another one that reads the ledger: it
    # waits its turn (--lock-wait), then the ledger says the slot is done.
    assert second.count("skipped, slot ") == 4, output
    assert second.count(" is already done (succeeded at ") == 4, output
    assert "another instance holds lock" not in second, output
    assert "=> 0 of 4 did the work; 4 skipped: today's slot is done." in second, output
