from django.db import transaction
from django.http import HttpRequest
from django.http import JsonResponse
from django.views.decorators.http import require_POST

from advisory_lock import advisory_lock
from testproject.example.models import Counter


@require_POST
def increment_counter(request: HttpRequest) -> JsonResponse:
    """Read-modify-write under a lock: held until the transaction commits, so no lost update."""
    with transaction.atomic(), advisory_lock("counter:demo", timeout=5):
        counter, _ = Counter.objects.get_or_create(name="demo")
        counter.value += 1
        counter.save(update_fields=["value"])
    return JsonResponse({"value": counter.value})
