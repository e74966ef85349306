from django.core.management.base import BaseCommand

from advisory_lock import single_instance


@single_instance(ledger="daily", grace=3600, heartbeat=0.5)
class Command(BaseCommand):
    help = "A daily job declared in code: overdue an hour after a day without a success."

    def handle(self, *args, **options):
        self.stdout.write("digest sent")
