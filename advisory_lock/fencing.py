"""Fencing tokens for a lock's holders: ``advisory_lock(key, fencing=True)``.

A lock can be lost while its holder still works (a killed or cut-off session, a failover), and
another process may then take it: for a while two processes believe they hold it. A token
tells their writes apart. Each time the lock is taken with ``fencing=True``, the database
issues the key's next number (``lock_fences``: one row per key, its last token), committed
before the block starts, and the holder writes it beside its effect:

    UPDATE ... SET ..., fence = <token> WHERE ... AND fence <= <token>

A holder that was superseded has a smaller token than any later one: its token was issued
while it held the lock, so before it lost it; the next holder's was issued after it took the
lock, so after that loss. Its late write finds ``fence`` above its token and changes nothing.
The ledger's fenced ends (a run's row must still be ``running``) are the same idea for a
run's own row.

The number is issued on a connection of its own (``own_connection.write``), committed at once,
whatever transaction the caller is in: a token that a rollback could give back would be
issued twice.
"""

from __future__ import annotations

import hashlib

from django.db import IntegrityError
from django.db import models
from django.db import transaction
from django.db.models import F

from advisory_lock.conf import require_app
from advisory_lock.keys import LockKey
from advisory_lock.own_connection import write

require_app()  # before the model: Django can only define a model of an installed app


class LockFence(models.Model):
    """The last fencing token issued for a lock's key."""

    #: The SHA-256 of the key's identity (``LockKey.identity``), which may be longer than an
    #: index can hold.
    key = models.CharField(max_length=64, primary_key=True)
    #: The key as it reads (``LockKey.label``), cut to fit: for people.
    name = models.CharField(max_length=200)
    token = models.BigIntegerField()

    class Meta:
        app_label = "advisory_lock"
        db_table = "lock_fences"
        verbose_name = "lock fence"

    def __str__(self) -> str:
        return f"{self.name}: {self.token}"


def issue_token(using: str, key: LockKey) -> int:
    """The next fencing token of ``key`` on the database ``using``, committed: larger than
    every token issued for it before. Call it while holding the lock."""
    digest = hashlib.sha256(key.identity.encode()).hexdigest()

    def next_token() -> int:
        fences = LockFence.objects.using(using)
        row = fences.filter(pk=digest)
        # The UPDATE locks the row until the commit (PostgreSQL, InnoDB; SQLite's writer
        # lock): the read that follows in the same transaction sees this increment.
        with transaction.atomic(using=using):
            if not row.update(token=F("token") + 1):
                try:
                    with transaction.atomic(using=using):  # a savepoint: the INSERT may fail
                        fences.create(key=digest, name=key.label[:200], token=1)
                except IntegrityError:  # another holder's first token came first
                    row.update(token=F("token") + 1)
            token: int = row.values_list("token", flat=True).get()
        return token

    return write(using, next_token)
