import argparse
import time
from pathlib import Path

from django.core.management.base import BaseCommand
from django.core.management.base import CommandError

from advisory_lock import single_instance


@single_instance(heartbeat=1)
class Command(BaseCommand):
    help = "Run by call_command in a worker thread: works for --seconds, polling or not."

    def add_arguments(self, parser):
        parser.add_argument("--seconds", type=float, default=6.0)
        parser.add_argument("--poll", action="store_true", help="Call self.lock.check().")
        parser.add_argument(
            "--until", help="Work until this file exists (at most 600 s), not for --seconds."
        )
        # call_command(started=event) only: a threading.Event to set once the body runs.
        parser.add_argument("--started", help=argparse.SUPPRESS)

    def handle(self, *args, **options):
        if options["started"] is not None:
            options["started"].set()
        if options["until"]:
            # A guard against a test that never creates the file, not a timing: a body that
            # gives up fails loudly instead of finishing as if it had been told to.
            deadline = time.monotonic() + 600
            while not Path(options["until"]).exists():
                if time.monotonic() > deadline:
                    raise CommandError(f"--until: {options['until']} did not appear within 600 s")
                if options["poll"]:
                    self.lock.check()
                time.sleep(0.05)
            self.stdout.write("finished")
            return
        deadline = time.monotonic() + options["seconds"]
        while time.monotonic() < deadline:
            if options["poll"]:
                self.lock.check()
                time.sleep(0.1)
            else:
                time.sleep(max(0.0, deadline - time.monotonic()))
        self.stdout.write("finished")
