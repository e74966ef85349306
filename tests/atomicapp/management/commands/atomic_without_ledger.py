from django.core.management.base import BaseCommand

from advisory_lock import SingleInstanceMixin


class Command(SingleInstanceMixin, BaseCommand):
    help = "lock_ledger_atomic without a lock_ledger: a system check error (E012)."

    lock_ledger_atomic = True

    def handle(self, *args, **options):
        self.stdout.write("ran")
