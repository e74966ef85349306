"""The exceptions the app raises; all derive from AdvisoryLockError."""

from __future__ import annotations

from django.core.exceptions import ImproperlyConfigured


class AdvisoryLockError(Exception):
    """Base class for every error raised by django-advisory-lock."""


class LockNotAcquired(AdvisoryLockError):
    """The lock is held by someone else and could not be taken in the time allowed."""


class NotSupportedError(AdvisoryLockError):
    """The database, or the requested kind of lock, is not supported by this backend."""


class LockLost(AdvisoryLockError):
    """A lock that was held is no longer held (its connection was closed or killed)."""


class ReplicaError(AdvisoryLockError, ImproperlyConfigured):
    """A lock was asked of a replica (a hot standby, a read-only server): its locks exclude
    nobody on the primary, so none is taken there."""


class LedgerNotMigrated(AdvisoryLockError, ImproperlyConfigured):
    """The ``job_runs`` ledger's table is missing (or lacks columns) on its database: the
    app's migrations were not applied there. ``manage.py migrate`` creates it. Also raised
    by every way into the ledger when the app is not in ``INSTALLED_APPS``: add it, then
    migrate."""


class SlotAlreadySucceeded(LockLost):
    """A ledger run ended without error, but its slot already had a succeeded run, written
    outside the ledger's claims (which refuse a slot that has one): the database allows one
    success per slot, so the run was recorded ``failed``, saying so. A ``LockLost``, as a run
    that was taken over: its work may have repeated the other's."""
