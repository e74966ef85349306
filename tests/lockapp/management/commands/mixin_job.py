from django.core.management.base import BaseCommand

from advisory_lock import SingleInstanceMixin
from tests.lockapp.management.commands._job import add_job_arguments
from tests.lockapp.management.commands._job import run_job


class Command(SingleInstanceMixin, BaseCommand):
    help = "A SingleInstanceMixin command for the tests."
    lock_busy_exit_code = 3
    lock_heartbeat = 0.5

    def add_arguments(self, parser):
        add_job_arguments(parser)

    def handle(self, *args, **options):
        run_job(self, options)
