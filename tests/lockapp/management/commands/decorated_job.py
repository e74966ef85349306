from django.core.management.base import BaseCommand

from advisory_lock import single_instance
from tests.lockapp.management.commands._job import add_job_arguments
from tests.lockapp.management.commands._job import run_job


@single_instance(busy_exit_code=3, heartbeat=0.5)
class Command(BaseCommand):
    help = "A @single_instance command for the tests."

    def add_arguments(self, parser):
        add_job_arguments(parser)

    def handle(self, *args, **options):
        run_job(self, options)
