from django.core.management.base import BaseCommand

from advisory_lock import single_instance


@single_instance(ledger="daily", heartbeat=0.5)
class Command(BaseCommand):
    help = "Send the daily digest: once a day, on one machine of the fleet."

    def handle(self, *args, **options):
        self.stdout.write("digest sent")
