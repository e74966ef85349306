from django.core.management.base import BaseCommand

from advisory_lock import single_instance
from tests.lockapp.management.commands._job import add_job_arguments
from tests.lockapp.management.commands._job import run_job


def quarter(now):
    """A plain function of the local time: the slot is the year and quarter."""
    return f"{now:%Y}-Q{(now.month - 1) // 3 + 1}"


@single_instance(ledger=quarter, busy_exit_code=3, heartbeat=0.5)
class Command(BaseCommand):
    help = "A @single_instance command whose ledger period is a plain function."

    def add_arguments(self, parser):
        add_job_arguments(parser)

    def handle(self, *args, **options):
        run_job(self, options)
