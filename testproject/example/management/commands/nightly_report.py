import os
import time

from django.core.management.base import BaseCommand

from advisory_lock import single_instance


@single_instance(ledger="daily")
class Command(BaseCommand):
    help = "The demo's nightly job: only one instance at a time does the work."

    def add_arguments(self, parser):
        parser.add_argument("--seconds", type=float, default=2.0, help="How long the work takes.")

    def handle(self, *args, **options):
        self.stdout.write(f"pid {os.getpid()}: took the lock, working...")
        time.sleep(options["seconds"])
        self.stdout.write(self.style.SUCCESS(f"pid {os.getpid()}: nightly_report done."))
