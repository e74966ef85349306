"""How the tasks that a scheduler's task entries enqueued have ended, as their queues tell."""

from __future__ import annotations

import logging
from collections.abc import Callable

from django.utils.module_loading import import_string

from advisory_lock.ledger import JobRun
from advisory_lock.ledger import end_enqueued
from advisory_lock.queues import ResultsNotStored
from advisory_lock.queues import queue_for
from advisory_lock.schedule import Entry
from advisory_lock.scheduling.alerts import slot_failed

logger = logging.getLogger("advisory_lock")
Status = JobRun.Status
_FOLLOWED = 100  # enqueued slots of an entry asked about per poll, oldest first


class TaskEnds:
    """Follows the enqueued slots of the database ``using`` to their tasks' ends."""

    def __init__(self, using: str) -> None:
        self.using = using
        # Task entries whose queue keeps no results: their slots stay enqueued.
        self._no_results: set[str] = set()
        # Per task entry, the last enqueued row asked about: the next poll goes on from it.
        self._followed_up_to: dict[str, int] = {}
        # The enqueued rows whose queue could not answer, said once each.
        self._unanswered: set[int] = set()

    def follow(self, entries: dict[str, Entry], say: Callable[[str], None]) -> None:
        """Record the end of the enqueued slots whose task has ended, as their queue tells
        (a queue that stores results); a queue that can't answer now is asked again later.
        At most ``_FOLLOWED`` slots of an entry a poll, oldest first, each poll going on
        from where the last one stopped: slots whose task never ends (its worker killed,
        its result deleted) can't keep the others from being followed."""
        followed = [
            name
            for name, entry in entries.items()
            if entry.task is not None and name not in self._no_results
        ]
        if not followed:
            return
        # One statement for all the task entries: which have enqueued slots (usually none).
        waiting = set(
            JobRun.objects.using(self.using)
            .filter(status=Status.ENQUEUED)
            .values_list("job_name", flat=True)
            .distinct()
        )
        for name in followed:
            if name not in waiting:
                continue
            entry = entries[name]
            assert entry.task is not None
            enqueued = JobRun.objects.using(self.using).filter(
                job_name=name, status=Status.ENQUEUED
            )
            after = self._followed_up_to.pop(name, 0)
            runs = list(enqueued.filter(pk__gt=after).order_by("pk")[:_FOLLOWED])
            if len(runs) == _FOLLOWED:
                self._followed_up_to[name] = runs[-1].pk  # else from the oldest again
            if not runs:
                continue
            task = import_string(entry.task)
            queue = queue_for(task)
            for run in runs:
                try:
                    outcome = queue.outcome(task, run.task_id)
                except ResultsNotStored as why:
                    self._no_results.add(name)
                    logger.info("run_jobs: %s: %s; its slots stay enqueued.", name, why)
                    break
                except Exception as error:  # the queue's: a broker down, a result gone
                    if run.pk not in self._unanswered:
                        self._unanswered.add(run.pk)
                        logger.warning(
                            "run_jobs: %s [%s]: the queue did not say how task %s ended: "
                            "%r (asked again later; said once)",
                            name,
                            run.period,
                            run.task_id,
                            error,
                        )
                    continue
                if outcome is not None and end_enqueued(
                    self.using,
                    run,
                    succeeded=outcome.succeeded,
                    error=outcome.error,
                    finished_at=outcome.finished_at,
                ):
                    ended = "succeeded" if outcome.succeeded else "failed"
                    say(f"run_jobs: {name} [{run.period}] task {run.task_id} {ended}.")
                    if not outcome.succeeded:
                        slot_failed(self.using, entry, run.period)
