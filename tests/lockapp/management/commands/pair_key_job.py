from django.core.management.base import BaseCommand

from advisory_lock import single_instance
from tests.lockapp.management.commands._job import add_job_arguments
from tests.lockapp.management.commands._job import run_job


@single_instance(key=(4242, 42), ledger="once", heartbeat=0.5)
class Command(BaseCommand):
    help = "A run-once job whose lock key is a pair of ints."

    def add_arguments(self, parser):
        add_job_arguments(parser)

    def handle(self, *args, **options):
        run_job(self, options)
