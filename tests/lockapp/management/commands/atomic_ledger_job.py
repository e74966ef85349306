from django.core.management.base import BaseCommand

from advisory_lock import SingleInstanceMixin
from testproject.example.models import Counter


class Command(SingleInstanceMixin, BaseCommand):
    help = "A single-instance command whose once slot commits with its writes."

    lock_ledger = "once"
    lock_ledger_atomic = True

    def add_arguments(self, parser):
        parser.add_argument("effect")
        parser.add_argument("--database", default="default")
        parser.add_argument("--fail", action="store_true")

    def execute(self, *args, **options):
        self.lock_using = options["database"]  # the ledger's database, for this run
        return super().execute(*args, **options)

    def handle(self, *args, **options):
        Counter.objects.using(options["database"]).create(name=options["effect"])
        if options["fail"]:
            raise RuntimeError("the job failed on purpose")
