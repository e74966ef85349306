from django.core.management.base import BaseCommand

from advisory_lock import single_instance
from tests.lockapp.management.commands._job import add_job_arguments
from tests.lockapp.management.commands._job import run_job


@single_instance
class Command(BaseCommand):
    help = "@single_instance with every default (busy exit status 0)."

    def add_arguments(self, parser):
        add_job_arguments(parser)

    def handle(self, *args, **options):
        run_job(self, options)
