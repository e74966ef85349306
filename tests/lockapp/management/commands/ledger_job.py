from django.core.management.base import BaseCommand

from advisory_lock import single_instance
from tests.lockapp.management.commands._job import add_job_arguments
from tests.lockapp.management.commands._job import run_job


@single_instance(ledger="daily", busy_exit_code=3, heartbeat=0.5)
class Command(BaseCommand):
    help = "A @single_instance command with a daily ledger slot."

    def add_arguments(self, parser):
        add_job_arguments(parser)
        parser.add_argument("--fail", action="store_true")

    def handle(self, *args, **options):
        run_job(self, options)
        if options["fail"]:
            raise RuntimeError("the job failed on purpose")
