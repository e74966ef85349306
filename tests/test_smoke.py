from django.db import transaction

from advisory_lock import advisory_lock


def test_smoke(using):
    with advisory_lock("smoke", using=using) as h:
        assert h.acquired
        print(h)
    with transaction.atomic(using=using), advisory_lock("smoke", using=using) as h:
        assert h.scope == "transaction"
