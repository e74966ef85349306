"""The scheduler behind ``manage.py run_jobs``: safe to run on every instance of a fleet.

Every scheduler computes the due slots of every entry from the database server's clock (so
skewed hosts agree). Of those, it starts the ones whose entry it claims (``claims``: one
scheduler of the fleet gets each claim, and the schedulers share a boundary's slots, see
``share``), and gives each to one of its workers (``workers``: job processes forked once).
The worker takes the entry's lock on a connection of its own and claims the slot in the
ledger (``GuardedRun``): whatever the number of schedulers, a slot succeeds at most once. A
worker that dies (a crash, SIGKILL, a timeout) leaves its row ``running`` under a free lock;
the scheduler records it ``failed`` and forks another worker. A worker never outlives its
scheduler (see ``workers``), so a retry can never overlap an orphan.

Which due slots run (``catch_up``): ``"latest"`` runs the most recent due slot; ``"all"``
runs each slot that fell due with no run, oldest first (at most 100 a pass), but none from
before the entry's first run; ``"none"`` runs the most recent due slot only if it fell due
less than one interval ago (cron: 60 s). A new entry's first run is its most recent due slot.
A failed or abandoned slot is run again, ``retries`` more times, while it is still the most
recent due slot.

Operators' requests (``advisory_lock.scheduling.control``): a paused entry starts no slot,
and a slot that fell due while it was paused never runs (it is ``paused``, not missed). Every
poll interval (``POLL_INTERVAL``, 1 s) a scheduler starts the pending run-now requests of its
entries, each as a slot of its own (``manual:<time>``) whose job process waits for the
entry's lock: a run of the entry going on elsewhere finishes first, and the ledger's claim
lets one scheduler's worker run it.

The entries are ``SCHEDULE``'s and those stored in the database (``scheduling.stored``),
read at start and again at each change of one: announced on PostgreSQL, and found by the look
for requests elsewhere, in its statement. A run going on when its entry changes goes on with
the entry it was given; the entry's next slot is the new entry's.

Idle, a scheduler costs the database next to nothing, whatever the number of its entries
(docs/scheduler.md, "What a scheduler costs"): one connection, kept; the server's clock read
once a minute and counted on with the monotonic clock between (``now``); one UPDATE a
heartbeat (``scheduling.liveness``, every ``SCHEDULER_HEARTBEAT`` seconds); one SELECT a
look for requests (on PostgreSQL once a minute while it hears them); and a sweep a minute of
one SELECT for all the entries (``abandon_orphans``).

A database outage (the server down, restarting, out of reach) stops no scheduler: a pass that
can't reach the database logs one WARNING, closes the connections, and is tried again after
0.2 s, then after twice the last wait, at most ``RETRY_CAP`` seconds apart; once a pass gets
through, one INFO line says how long the outage lasted, and the sweep runs at once (the
outage may have cut runs). Meanwhile no run starts, the running children are still reaped
and stopped at their timeout, and a signal stops the scheduler at once. Only the errors that
say so are an outage (``is_outage``): any other error, a bug, still stops the scheduler. A
database in reach that takes no lock (a replica, a primary demoted by a failover:
``is_refusal``) is ridden out the same way, and said as such: its claims fail before any run
is given to a worker. A run that fails before it starts in its worker (its lock or its
claim refused) holds its entry back, said once, for a growing while (``Backoff``).
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import math
import select
import signal
import time
from collections.abc import Callable
from collections.abc import Iterator
from typing import Any

from django.db import connections

from advisory_lock.backends import inspector_for
from advisory_lock.datetimes import from_field
from advisory_lock.ledger import Attempt
from advisory_lock.ledger import JobRun
from advisory_lock.ledger import abandon_orphans
from advisory_lock.ledger import deciding_attempts
from advisory_lock.schedule import MAX_CATCH_UP
from advisory_lock.schedule import Entry
from advisory_lock.scheduling.alerts import missed_before
from advisory_lock.scheduling.alerts import slot_failed
from advisory_lock.scheduling.boundaries import Boundaries
from advisory_lock.scheduling.boundaries import Due
from advisory_lock.scheduling.children import UNRECORDED
from advisory_lock.scheduling.children import Backoff
from advisory_lock.scheduling.children import Child
from advisory_lock.scheduling.children import Death
from advisory_lock.scheduling.claims import Claims
from advisory_lock.scheduling.control import CHANGE_MARGIN
from advisory_lock.scheduling.control import JobControl
from advisory_lock.scheduling.control import Request
from advisory_lock.scheduling.control import is_paused
from advisory_lock.scheduling.control import pauses_of
from advisory_lock.scheduling.control import pending_requests
from advisory_lock.scheduling.first_seen import FirstSeen
from advisory_lock.scheduling.liveness import POLL_INTERVAL
from advisory_lock.scheduling.liveness import Heartbeat
from advisory_lock.scheduling.liveness import heartbeat_interval
from advisory_lock.scheduling.notifications import CONTROL
from advisory_lock.scheduling.notifications import LISTENING
from advisory_lock.scheduling.notifications import SCHEDULE_CHANGED
from advisory_lock.scheduling.notifications import Listening
from advisory_lock.scheduling.outages import RETRY_CAP as RETRY_CAP  # its documented path
from advisory_lock.scheduling.outages import Outage
from advisory_lock.scheduling.outages import is_outage
from advisory_lock.scheduling.outages import is_refusal
from advisory_lock.scheduling.sharing import Sharing
from advisory_lock.scheduling.stored import stored_entries
from advisory_lock.scheduling.task_ends import TaskEnds
from advisory_lock.scheduling.workers import DEFAULT_WORKERS
from advisory_lock.scheduling.workers import FAILED
from advisory_lock.scheduling.workers import LOST
from advisory_lock.scheduling.workers import NOT_STARTED
from advisory_lock.scheduling.workers import SKIPPED
from advisory_lock.scheduling.workers import SUCCEEDED
from advisory_lock.scheduling.workers import Pool
from advisory_lock.scheduling.workers import Run

Status = JobRun.Status
_LOOP = 0.2  # seconds between two looks at the clock while idle
_SWEEP = 60.0  # seconds between two sweeps for abandoned runs
#: The longest, in seconds, that a once-a-minute chore (the sweep; the server's clock read
#: again, with the count of the fleet) waits while the scheduler hands out due slots: a
#: boundary's runs go first, and a scheduler that always has slots to hand out still does it.
_CHORES_WAIT = 5.0
#: How many due slots a scheduler claims ahead per worker, its runs going on included: a
#: bound on the slots it keeps from the others while its workers are busy.
_AHEAD = 8


class Scheduler:
    """Runs the due slots of ``entries`` (``ADVISORY_LOCK["SCHEDULE"]``'s) and of the entries
    stored in the database ``using`` (``scheduling.stored``: followed while it runs) on the
    ledger of ``using``."""

    def __init__(
        self,
        entries: dict[str, Entry],
        *,
        using: str = "default",
        stop_grace: float = 30,
        poll_interval: float = POLL_INTERVAL,
        workers: int = DEFAULT_WORKERS,
        say: Callable[[str], None] = print,
    ) -> None:
        self.configured = dict(entries)  # the settings': they win a name (see ``stored``)
        self.entries = dict(entries)  # and the stored ones, once read (``follow_schedule``)
        self._stored_problems: set[str] = set()  # said once each
        # The changes of stored entries to look for (``start_requested``): those stamped
        # since this moment, less those already seen (the ids of the last look's).
        self._changes_since: datetime.datetime | None = None
        self._changes_seen: set[int] = set()
        self.using = using
        self.workers = workers
        self.pool = Pool(max(1, min(workers, len(entries))), using)
        self.claims = Claims(using)
        self._unclaim: list[str] = []  # entries whose run here has ended: claims to release
        self.boundaries = Boundaries(self._missed)  # each entry's due slots
        self._released_at = 0.0  # time.monotonic() of the last release of claims
        self._asked_alive_at = 0.0  # time.monotonic() of the last is_alive() of silent workers
        # Slots claimed here, the ledger's word taken, waiting for a free worker.
        self._ready: dict[str, Due] = {}
        # Entries with a run here when a request for them was heard: a look for requests
        # once it ends (the request waited for it).
        self._asked: set[str] = set()
        # The due slots whose claim another scheduler held at our try: not tried again
        # until the next sweep (that scheduler runs them, and its retries; a sweep finds
        # what a dead one left).
        self._elsewhere: set[tuple[str, str]] = set()
        # This scheduler's order of the entries, its own first (see ``share``).
        self.sharing = Sharing(entries)
        self.stop_grace = stop_grace
        self.poll_interval = poll_interval
        self.say = say
        self.children: dict[str, Child] = {}
        self.failed = 0
        self.stopping = False
        # Slots known done (succeeded, or out of retries): not looked up again.
        self._settled: set[tuple[str, str]] = set()
        # Entries whose due slots are all settled or another scheduler's, until their next
        # boundary (``Boundary.until``): skipped by ``_next_slots`` at the cost of a lookup.
        # Forgotten whenever one of those slots may run again here (``_wake``), and at a
        # sweep, which looks at every slot again.
        self._quiet: dict[str, datetime.datetime] = {}
        # Runs whose process died, and how: to record failed (kept while the database is out,
        # and until the server has freed the dead process's lock).
        self._deaths: list[Death] = []
        # Failed runs (entry, slot, how if the scheduler knows it) to alert of (``reap``).
        self._failures: list[tuple[Entry, str, str]] = []
        self.outage = Outage(using)  # the one under way, if any
        # Entries whose last run failed before it started: no run until their backoff ends.
        self._held_back: dict[str, Backoff] = {}
        self.heartbeat = Heartbeat(using)
        self.first_seen = FirstSeen(using)  # when each entry was first loaded by a scheduler
        self.heartbeat_interval = heartbeat_interval()  # read once: ValueError if bad
        self.task_ends = TaskEnds(using)
        # Notifications (PostgreSQL): operators' requests, heard at once.
        self.listening = Listening(using)
        # Look for requests at the next pass: one was announced (or may have been, unheard),
        # or a run of ours ended (a request for its entry waited for it here).
        self._poll_now = False
        # Read the stored entries at the next pass: at the first, and once a change of one
        # was announced (a change found by the look for requests is read at once).
        self._reread_now = True
        self._next_beat = 0.0  # time.monotonic() of the next heartbeat
        self._next_sweep = 0.0  # time.monotonic() of the next sweep: the first at start
        # The last pass had due slots to hand out (claimed and waiting for a worker, or to
        # claim): the once-a-minute chores wait (``_waits``).
        self._handing_out = False
        # The database server's clock as last read, and time.monotonic() just after the
        # answer came: ``now()`` adds the monotonic time since (see ``now``).
        self._clock: tuple[datetime.datetime, float] | None = None

    # Running.

    def run_forever(self) -> None:
        """Run each slot when it falls due, until SIGTERM or SIGINT; then stop the children
        (after ``stop_grace`` seconds) and record how they ended. A database outage is ridden
        out: no run starts until the database is back (see the module's docstring)."""
        previous = {
            signum: signal.signal(signum, self._stop) for signum in (signal.SIGTERM, signal.SIGINT)
        }
        polled_at = followed_at = -math.inf  # the interval may shorten (deaf): looked at each pass
        try:
            self.pool.fill()
            while not self.stopping:
                # Every database access of a pass is in here: the outage guard.
                try:
                    self.reap()
                    self.beat_if_due()
                    if self._reread_now:
                        self._reread_now = False
                        self.follow_schedule()
                    # The entries first seen now (none, after the first pass): a statement.
                    self.first_seen.note(self.entries, self.now)
                    if self._poll_now or self._polls_now(polled_at):
                        self._poll_now = False
                        self.start_requested()
                        polled_at = time.monotonic()
                    if time.monotonic() >= followed_at + self._follow_interval():
                        self.follow_tasks()
                        followed_at = time.monotonic()
                    self.sweep_if_due()
                    self.start_due()
                    if not self._ready:  # no run waits for a worker
                        self.boundaries.prepare(self.entries, self.now())
                    self.pool.fill()  # in place of workers that died (a fork each)
                except Exception as error:
                    if not (is_outage(error) or is_refusal(error)):
                        raise
                    self._next_sweep = self._next_beat = 0.0  # once it is back
                    polled_at = followed_at = -math.inf
                    self._clock = None  # read again: a failover may bring another clock
                    self._wait(self._outage(error))
                    continue
                self.outage.over()
                # A lost listening connection with the database in reach: say so.
                self.listening.say_failure()
                self._wait(self._until_next_look())
        finally:
            self.listening.close()
            self.shut_down()
            for signum, handler in previous.items():
                signal.signal(signum, handler)

    def run_once(self) -> int:
        """Run what is due now, wait for it, and return the exit status (1 if a run failed).
        First, record how the tasks that earlier runs enqueued have ended, as far as their
        queues tell (a fleet of ``--once`` runs from cron follows its tasks one run late).
        A slot whose entry another scheduler has claimed is left to it."""
        self.follow_schedule()
        self.follow_tasks()
        self.first_seen.note(self.entries, self.now)
        pending = {name: self.due_slots(entry, self.now()) for name, entry in self.entries.items()}
        # No more workers than entries with something due (none at all: no fork).
        self.pool.size = min(self.pool.size, sum(1 for slots in pending.values() if slots))
        self.pool.fill()
        while any(pending.values()) or self.children:
            # At once: an entry with more slots due (catch_up "all") claims again for each.
            unclaim, self._unclaim = self._unclaim, []
            self.claims.release(unclaim)
            for name in self._held_back:
                pending[name] = []  # its run failed before it started: said, and not retried
            ready = [name for name, slots in pending.items() if slots and not self.busy(name)]
            batch = ready[: len(self.pool.idle())]
            claimed = set(self.claims.claim(batch)) if batch else set()
            for name in batch:
                if name in claimed:
                    self.start(self.entries[name], pending[name].pop(0))
                else:
                    pending[name] = []  # claimed elsewhere: that scheduler runs it
            self._wait_for_workers(_LOOP / 4)
            self.reap()
        self._record_deaths_before_exit()
        self._alert_failures()
        self.pool.stop()
        self.claims.close()
        return 1 if self.failed else 0

    def sweep_if_due(self) -> None:
        """Sweep (``sweep``) if a minute has passed since the last sweep, and at start: a
        restart after a crash, or after an outage, which may have cut runs."""
        if time.monotonic() >= self._next_sweep and not self._waits(self._next_sweep):
            self.sweep()
            self._next_sweep = time.monotonic() + _SWEEP

    def _waits(self, due: float) -> bool:
        """Does a once-a-minute chore due since ``due`` (``time.monotonic()``) wait? While
        the scheduler hands out due slots (the last pass had some), for at most
        ``_CHORES_WAIT`` seconds: a sweep at a boundary would take the boundary's time from
        its runs (a lock try per running row of the other schedulers, and every slot looked
        at again), and so would the count of the fleet. A chore due at start (``due`` 0)
        never waits."""
        return self._handing_out and time.monotonic() < due + _CHORES_WAIT

    def sweep(self) -> None:
        """Mark abandoned the running rows of the schedule's jobs whose lock is free: their
        scheduler died with them, maybe on a slot no scheduler looks at any more. One SELECT
        for all the entries, on this scheduler's connection, and a lock try per running row
        of another process (``abandon_orphans``): a running child of ours holds its entry's
        lock from before its row exists until after its row is no longer ``running``, so its
        row is never taken for an orphan (and is not looked at). Deletes the heartbeat rows of
        schedulers gone for a week, too."""
        alive = {(child.entry.name, child.slot) for child in self.children.values()}
        abandon_orphans(self.using, self.entries.keys(), alive)
        self.heartbeat.forget_the_dead(self.now())
        self._elsewhere.clear()  # looked at again: a slot left by a dead scheduler runs
        # Only the slots of the entries' current boundaries are ever looked up in
        # ``_settled`` (``_next_slots`` asks about ``boundaries.dues``): the others go, else
        # it would grow by each slot run, for as long as the scheduler lives.
        current = {
            (name, due.slot)
            for name, boundary in self.boundaries.current.items()
            for due in boundary.dues
        }
        self._settled &= current
        self.boundaries.forget_missed(self.entries)
        self._quiet.clear()

    def _polls_now(self, polled_at: float) -> bool:
        """Is it this scheduler's turn to look for requests? Once a poll interval, and in a
        large fleet only in its turns (``Sharing.polls_in``)."""
        interval = self._poll_interval()
        if time.monotonic() < polled_at + interval:
            return False
        return self.sharing.polls_in(self.now(), interval)

    def _poll_interval(self) -> float:
        """``poll_interval``, but at most ``POLL_INTERVAL`` (1 s) while the database announces
        requests and this process can't hear them (a transaction pooler in the way, declared
        or found out; not listening yet): they are then seen by polling only. While it hears
        them, at least ``_SWEEP`` (a minute): polling is then only a fallback, since a request
        is heard when its row commits, a new listening connection makes the scheduler poll at
        once (what was sent while none listened is lost), and so does the end of a run here
        (a request for its entry waited for it)."""
        if self.listening.deaf:
            return min(self.poll_interval, POLL_INTERVAL)
        if self.listening.hearing:
            return max(self.poll_interval, _SWEEP)
        return self.poll_interval

    def _follow_interval(self) -> float:
        """How often to ask the queues how enqueued tasks ended: every poll, but at most once
        a heartbeat interval (a task's end is not urgent, and each look is a statement)."""
        return max(self.poll_interval, self.heartbeat_interval)

    def beat_if_due(self) -> None:
        """Record the heartbeat (one UPDATE) if the heartbeat interval has passed since the
        last one: also within a long pass (many due slots), so that a busy scheduler never
        looks dead. The server's clock is read again first if it was last read ``_SWEEP``
        seconds ago or more (see ``now``), but for a while (``_waits``) while the scheduler
        hands out due slots."""
        if time.monotonic() >= self._next_beat:
            reread = self._clock is None or (
                time.monotonic() - self._clock[1] >= _SWEEP
                and not self._waits(self._clock[1] + _SWEEP)
            )
            if reread:
                self.read_clock()
            self.heartbeat.beat(self.now())
            self._next_beat = time.monotonic() + self.heartbeat_interval
            if reread or self.sharing.counts_left:
                self.sharing.counts_left = max(0, self.sharing.counts_left - 1)
                self.share()

    def share(self) -> None:
        """Count the live schedulers and order the entries by this one's share of them
        (``scheduling.sharing``): one statement."""
        mine = self.heartbeat.row.pk if self.heartbeat.row is not None else None
        self.sharing.count(self.using, self.now(), mine)
        self.sharing.reorder(self.entries)

    def _stop(self, signum: int, frame: Any) -> None:
        self.say(f"run_jobs: signal {signum}: no new runs; waiting for the running ones.")
        self.stopping = True

    def _until_next_look(self) -> float:
        """Seconds to wait before the next pass: ``_LOOP``, or less when an entry's next
        slot falls due sooner (the earliest ``Boundary.until`` of the entries looked at),
        so that a boundary's slots are not left waiting for the end of a wait."""
        if self._clock is None:
            return _LOOP  # no statement here: this runs outside a pass's outage guard
        now = self.now()
        boundary = self.boundaries.next_after(now)
        if boundary is None:
            return _LOOP
        return max(0.0, min(_LOOP, (boundary - now).total_seconds()))

    def _wait(self, seconds: float) -> None:
        """Wait ``seconds``, reaping the children meanwhile (their timeouts too, with no
        database); less if a signal stops the scheduler (a sleep resumes after a handler),
        or a notification says an operator asked something of one of our entries (the next
        pass then looks for requests at once)."""
        until = time.monotonic() + seconds
        while not self.stopping and (left := until - time.monotonic()) > 0:
            answers = self.pool.answers()
            if self.outage.since is None:
                heard = self.listening.wait(min(left, _LOOP / 2), answers)
            else:  # no listening either: the database is tried at the outage's pace only
                self._wait_for_workers(min(left, _LOOP / 2))
                heard = []
            if self._collect() or self._heard(heard):
                return  # a run ended (its worker is free for a due slot), or a request

    def _wait_for_workers(self, seconds: float) -> None:
        """Sleep until a worker answers, at most ``seconds``."""
        select.select(self.pool.answers(), [], [], seconds)

    def _heard(self, payloads: list[str]) -> bool:
        """True, and requests to be looked for at once, if a notification concerns us: a
        request for one of our entries, or a new listening connection (requests made while
        there was none went unheard, and so did changes of stored entries: that look finds
        them too); the stored entries to be read again at once if one of them changed."""
        concerns = False
        for payload in payloads:
            kind, _, name = payload.partition(":")
            if kind == SCHEDULE_CHANGED:  # any name: a new entry is not among ours yet
                self._reread_now = concerns = True
            if payload == LISTENING or (kind == CONTROL and name in self.entries):
                self._poll_now = concerns = True
                if name in self.children:
                    self._asked.add(name)  # looked for again when its run here ends
        return concerns

    # Database outages.

    def _outage(self, error: Exception) -> float:
        """A pass could not reach the database: drop the connections (the next try opens new
        ones), and return how long to wait before the next try (``Outage.failed``)."""
        for connection in connections.all(initialized_only=True):
            with contextlib.suppress(Exception):  # a broken connection may fail to close
                connection.close()
        # Listened to again once the database is back; the outage explains a lost listener.
        self.listening.close()
        # The claims go with their connection (the runs going on keep their entries' locks).
        self.claims.close()
        self._ready.clear()
        self.listening.forget_failure()
        return self.outage.failed(error)

    def _holds_back(self, name: str) -> bool:
        held = self._held_back.get(name)
        return held is not None and time.monotonic() < held.until

    def start_due(self) -> None:
        """Give due slots to this scheduler's free workers, each once its entry is claimed
        here. Claims are made ahead (``_ready``), so that a batch serves many runs: per
        batch, one statement for the claims, one for the ledger's word on the claimed slots,
        one for their pauses. A batch is made once no more than one slot per worker is
        left waiting, and claims up to ``_AHEAD`` slots per worker in all (running and
        waiting): a boundary's slots cost a few batches, not one per run's end. The batch
        of the other schedulers' entries is first looked at in the ledger (``_drop_decided``:
        one statement more). A slot whose entry another scheduler claimed is left to it (see
        ``_elsewhere``). A signal stops
        the pass (no new runs), and the heartbeat is kept up meanwhile."""
        self.pool.fill()
        if self.stopping:
            return
        self._start_ready()
        self._handing_out = bool(self._ready)
        if len(self._ready) > self.pool.size:
            return  # enough waiting: the next batch once the workers have taken most
        wanted = _AHEAD * self.pool.size - len(self.children) - len(self._ready)
        if wanted <= 0:
            return
        pending = self._next_slots(self.now())
        while wanted > 0 and not self.stopping:
            # Its own entries (``share``) as many as its workers can take; then the others'
            # all in one batch: most are run or taken by their own schedulers (the ledger,
            # then the claims, say so for all in a statement each), and those that are not
            # (theirs busy, or dead) wait here.
            # The entries are looked at only as far as that: a pass while a boundary's slots
            # are being run stops at the first few not yet run.
            first = next(pending, None)
            if first is None:
                break
            self._handing_out = True
            candidates = dict([first])
            if first[0] in self.sharing.own:
                candidates.update(itertools.islice(pending, wanted - 1))
            else:
                candidates.update(pending)
                self._drop_decided(candidates)
            batch = list(candidates)
            claimed = set(self.claims.claim(batch))
            chosen = {}
            for name in batch:
                due = candidates.pop(name)
                if name in claimed:
                    chosen[name] = due
                else:
                    # Another scheduler runs the entry. For catch_up "all" that says nothing
                    # of this slot: it runs one of the entry's missed slots at a time, maybe
                    # another one, and this slot is looked at again at the next pass.
                    if self.entries[name].catch_up != "all":
                        self._elsewhere.add((name, due.slot))
                    if name in self.sharing.own:  # the fleet changed: counted again
                        self.sharing.counts_left = max(self.sharing.counts_left, 1)
            ready = self._wanted(chosen)
            self.claims.release(name for name in chosen if name not in ready)
            self._ready.update(ready)
            wanted -= len(ready)
            self._start_ready()
            self.beat_if_due()

    def _drop_decided(self, candidates: dict[str, Due]) -> None:
        """Drop from ``candidates`` (the other schedulers' entries) the slots that the
        ledger already decides: done, or running or enqueued elsewhere (one statement, no
        claim). Their owners have mostly run them by the time a scheduler is through with
        its own entries; a claim of each, the ledger's word and a release would cost the
        same statement and two more, and grow with the number of schedulers. What is left
        (no attempt yet, or a retry due) is claimed and looked at again once claimed: the
        ledger may have changed in between."""
        deciding = deciding_attempts(
            self.using, {name: due.slot for name, due in candidates.items()}
        )
        for name, last in deciding.items():
            if not self._wants_run(self.entries[name], candidates[name], last):
                del candidates[name]

    def _next_slots(self, now: datetime.datetime) -> Iterator[tuple[str, Due]]:
        """The next slot of each entry with no run going here, claimed by no one here, not
        held back, and neither settled nor known to be another scheduler's: in the shared
        order (``Sharing``: its own first), each looked at when the caller asks for it."""
        quiet = self._quiet
        for name in self.sharing.order:
            if name in quiet and now < quiet[name]:
                continue  # nothing to run before its next boundary
            if self.busy(name) or name in self.claims.held or self._holds_back(name):
                continue  # one run of an entry at a time
            for due in self.boundaries.dues(self.entries[name], now):
                slot = (name, due.slot)
                if slot not in self._settled and slot not in self._elsewhere:
                    yield name, due
                    break
            else:
                boundary = self.boundaries.current.get(name)
                if boundary is not None:
                    quiet[name] = boundary.until

    def _wake(self, name: str) -> None:
        """Let ``_next_slots`` look at ``name`` again: a slot of it may run here again, or
        its due slots are to be computed again."""
        self._quiet.pop(name, None)

    def _start_ready(self) -> None:
        """Give the claimed slots waiting here to the free workers, oldest claim first."""
        while self._ready and self.pool.idle() and not self.stopping:
            name = next(iter(self._ready))
            self.start(self.entries[name], self._ready.pop(name).slot)

    def start_requested(self) -> None:
        """Start the pending run-now requests of the entries that have no run going here,
        each once its entry is claimed here (a request of an entry claimed elsewhere waits
        for the next look); and read the stored entries again if the same statement finds a
        change of one not seen yet. A change is looked for from ``CHANGE_MARGIN`` before the
        last look on: a change's row is stamped before it commits, at most that long before
        (see ``control.CHANGE_MARGIN``), so one that commits after a look is found by the
        next."""
        free = len(self.pool.idle())
        now = self.now()
        requests: dict[str, Request] = {}
        changes: set[int] = set()
        for request in pending_requests(self.using, now, self._changes_since):
            name = request.job_name
            if request.action == JobControl.Action.CHANGE:
                changes.add(request.pk)
            elif free and not self.busy(name) and not self._holds_back(name):
                requests.setdefault(name, request)
        if changes - self._changes_seen:
            self.follow_schedule()
        self._changes_since, self._changes_seen = now - CHANGE_MARGIN, changes
        names = [name for name in requests if name in self.entries][:free]
        if not names or self.stopping:
            return
        for name in self.claims.claim(names):
            self.start(self.entries[name], requests[name].slot, manual=True)

    def follow_schedule(self, *, say: bool = True) -> None:
        """Read the stored entries (``scheduling.stored``: one statement) and take up their
        changes. A stored entry that can't be scheduled (its callable gone, its name now in
        ``SCHEDULE``) is left out, and ``say`` says so once."""
        if self._changes_since is None:
            # A change stamped before this read may commit after it: looked for from then.
            self._changes_since = self.now() - CHANGE_MARGIN
        stored, problems = stored_entries(self.using)
        for problem in problems:
            if say and problem not in self._stored_problems:
                self.say(f"run_jobs: a stored entry is not scheduled: {problem}")
        self._stored_problems = set(problems)
        entries = {**stored, **self.configured}
        changed = {
            name
            for name in self.entries.keys() | entries.keys()
            if self.entries.get(name) != entries.get(name)
        }
        if not changed:
            return
        # A run going on here of a changed or deleted entry goes on with the entry it was
        # given, and ends recorded (fenced by its row) as any run; the next slot is the new
        # entry's. The slots claimed for them and not started are let go.
        waiting = [name for name in changed if name in self._ready]
        for name in waiting:
            del self._ready[name]
        self.claims.release(waiting)
        self.boundaries.forget(changed)
        for name in changed:
            self._quiet.pop(name, None)
            self._held_back.pop(name, None)
        self._settled = {slot for slot in self._settled if slot[0] not in changed}
        self._elsewhere = {slot for slot in self._elsewhere if slot[0] not in changed}
        added, removed = entries.keys() - self.entries.keys(), self.entries.keys() - entries.keys()
        self.entries = entries
        self.sharing.reorder(entries)
        self.pool.size = max(1, min(self.workers, len(entries)))
        if say:
            for what, names in (
                ("added", added),
                ("changed", changed - added - removed),
                ("removed", removed),
            ):
                if names:
                    self.say(f"run_jobs: stored entries {what}: {', '.join(sorted(names))}.")

    def follow_tasks(self) -> None:
        """Record how the enqueued slots of the task entries ended (``TaskEnds``)."""
        self.task_ends.follow(self.entries, say=self.say)

    def now(self) -> datetime.datetime:
        """The database server's clock, as last read (``read_clock``: at start, then once a
        minute with a heartbeat, and after an outage) plus the time this host's monotonic
        clock has counted since the answer came: no statement. Behind the server's clock by
        the answer's way back, never ahead of it but by the drift of the two clocks over a
        minute (parts per million: microseconds): the server's answer was read before the
        monotonic time was, so a slot is never taken for due before the server says so."""
        if self._clock is None:
            return self.read_clock()
        read, at = self._clock
        return read + datetime.timedelta(seconds=time.monotonic() - at)

    def read_clock(self) -> datetime.datetime:
        """Ask the database server for its clock (one statement), and keep the answer for
        ``now``."""
        read = inspector_for(connections[self.using]).database_now()
        self._clock = (read, time.monotonic())
        return read

    # Which slots.

    def due_slots(self, entry: Entry, now: datetime.datetime) -> list[str]:
        """The slots of ``entry`` to run now, oldest first, by its ``catch_up``."""
        return [
            due.slot for due in self.boundaries.dues(entry, now) if self._wanted({entry.name: due})
        ]

    def _wanted(self, slots: dict[str, Due]) -> dict[str, Due]:
        """Of ``slots`` (one per entry), those to run now, by the ledger and the pauses: two
        statements for them all (three with a pause). The others are settled, or left for a
        later look."""
        deciding = deciding_attempts(self.using, {name: due.slot for name, due in slots.items()})
        wanted = {
            name: due
            for name, due in slots.items()
            if self._wants_run(self.entries[name], due, deciding.get(name))
        }
        if not wanted:
            return {}
        # A slot about to get its first attempt: was the one before it ever started?
        first = {name: due for name, due in wanted.items() if name not in deciding}
        missed_before(self.using, self.entries, first, self._attempted)
        # A slot that fell due while the entry was paused never runs, even after the resume.
        # It is settled only once the pause is over: a resume is stamped with the database's
        # clock before it commits, so one that commits after this look may still say that
        # the slot fell due after it (it then runs, a moment late).
        spans = pauses_of(self.using, list(wanted), min(due.at for due in wanted.values()))
        for name, due in list(wanted.items()):
            covering = [span for span in spans.get(name, []) if span.covers(due.at)]
            if covering:
                del wanted[name]
                if all(span.until is not None for span in covering):
                    self._settled.add((name, due.slot))
        return wanted

    def _missed(self, entry: Entry, latest: datetime.datetime) -> list[datetime.datetime]:
        """The slots up to ``latest`` that have no run, oldest first: at most MAX_CATCH_UP,
        and none from before the entry's first run."""
        runs = JobRun.objects.using(self.using).filter(job_name=entry.name)
        first = runs.order_by("started_at").values_list("period", flat=True).first()
        if first is None:
            return [latest]  # a new entry: its first run is its most recent due slot
        names: dict[str, datetime.datetime] = {}
        for slot in entry.slots_before(latest):
            name = entry.slot_name(slot)
            if name == first or len(names) == 10 * MAX_CATCH_UP:
                break
            names[name] = slot
        seen = set(runs.filter(period__in=list(names)).values_list("period", flat=True))
        missed = [slot for name, slot in names.items() if name not in seen][:MAX_CATCH_UP]
        return sorted(missed)

    def _attempted(self, name: str, slot: str) -> bool:
        """Does this scheduler know that ``slot`` of ``name`` had an attempt?"""
        return (name, slot) in self._settled or (name, slot) in self._elsewhere

    def _wants_run(self, entry: Entry, due: Due, last: Attempt | None) -> bool:
        """Does ``due`` run now, given its deciding attempt ``last``?"""
        if last is None:
            return True
        if last.status == Status.SUCCEEDED:
            self._settled.add((entry.name, due.slot))
            return False
        if last.status in (Status.RUNNING, Status.ENQUEUED):
            # Running elsewhere, or its task in its queue (a claim would find the slot
            # taken): looked at again after the next sweep, which marks the run abandoned
            # if its lock is free (its owner died). Not settled: a task that fails, or an
            # abandoned run, leaves the slot to its retries.
            self._elsewhere.add((entry.name, due.slot))
            return False
        if due.latest and last.attempt <= entry.retries:
            return True  # failed or abandoned: run it again while it is the latest
        self._settled.add((entry.name, due.slot))
        return False

    # Children.

    def busy(self, name: str) -> bool:
        """Whether the entry ``name`` has a run here that has not ended recorded: a running
        child, or a dead one whose failure waits for the server to free its lock. Until then
        no run of the entry starts here: the next attempt's claim would find the dead run's
        row under a free lock and mark it abandoned, losing how it ended."""
        return name in self.children or (
            bool(self._deaths) and any(death.child.entry.name == name for death in self._deaths)
        )

    def start(self, entry: Entry, slot: str, *, manual: bool = False) -> None:
        """Give ``entry``'s ``slot``, whose entry is claimed here, to a free worker. A
        ``manual`` (run-now) slot's run waits for the entry's lock, and makes one attempt."""
        worker = self.pool.idle()[0]
        run = Run(entry, slot, manual, time.monotonic())
        worker.give(run)
        self.children[entry.name] = Child(worker, run)
        self.say(f"run_jobs: {entry.name} [{slot}] started (pid {worker.pid}).")

    def reap(self) -> None:
        """Record the runs that ended; stop those past their timeout; release the claims of
        the entries done with (one statement)."""
        self._collect()
        self._record_deaths()
        self._alert_failures()
        # Released together, at most once a loop while runs go on here: an entry whose run
        # has ended is done with for now (a retry is this scheduler's), and another
        # scheduler that tries its claim meanwhile leaves its slot to us.
        if self._unclaim and (
            not self.children
            or len(self._unclaim) >= self.pool.size
            or time.monotonic() >= self._released_at + _LOOP
        ):
            unclaim, self._unclaim = self._unclaim, []
            self.claims.release(unclaim)
            self._released_at = time.monotonic()

    def _collect(self) -> bool:
        """Take the answers of the workers whose run ended, and say how; stop the runs past
        their timeout (their worker). True if a run ended. No database access: the runs
        whose worker died are recorded by ``_record_deaths``, and the claims of the entries
        done with are released by ``reap``."""
        ended = False
        answered = self.pool.answered()
        # A worker that dies closes its end of the pipe, which is then readable: one whose
        # pipe a child of its job keeps open is seen dead by ``is_alive()`` (waitpid), asked
        # of the silent workers once a loop, and at once of those killed here.
        ask_alive = time.monotonic() >= self._asked_alive_at + _LOOP
        if ask_alive:
            self._asked_alive_at = time.monotonic()
        for name, child in list(self.children.items()):
            worker = child.worker
            answer = worker.answer() if worker in answered else None
            died = answer is None
            why = ""
            if answer is None:
                asked = ask_alive or worker in answered or bool(child.run.stopped_because)
                if not asked or worker.process.is_alive():
                    timeout = child.entry.timeout
                    if timeout is not None and time.monotonic() - child.run.started > timeout:
                        self.kill(child, f"stopped after its timeout of {timeout:g}s")
                    continue
                worker.process.join()
                status = worker.process.exitcode
                self.pool.remove(worker)  # a new worker takes its place (``Pool.fill``)
            else:
                status, why = answer
                worker.run = None
                self._unclaim.append(name)  # else once its death is recorded
                if status == LOST:
                    # The worker exits once it has answered (see ``workers``): waited for
                    # here, so that no run is given to it meanwhile.
                    worker.process.join()
                    self.pool.remove(worker)
            del self.children[name]
            ended = True
            self._ended(child, status, died=died, why=why)
        return ended

    def _alert_failures(self) -> None:
        """Send ``slot_failed`` for the runs that failed since the last pass, each once: one
        that can't be sent now (the database out of reach) waits for the next pass."""
        while self._failures:
            entry, slot, how = self._failures[0]
            slot_failed(self.using, entry, slot, how)
            del self._failures[0]

    def kill(self, child: Child, because: str) -> None:
        child.run.stopped_because = because
        # SIGKILL: the worker's connections die with it, and the database frees its lock.
        child.process.kill()
        child.process.join()

    def _ended(self, child: Child, status: int | None, *, died: bool, why: str = "") -> None:
        name = child.entry.name
        run = f"{name} [{child.slot}]"
        if child.entry.catch_up == "all":
            self.boundaries.forget([name])  # its missed slots are looked at again
        self._wake(name)
        if not died and status == NOT_STARTED:
            self.failed += 1
            self._settled.discard((name, child.slot))
            held = self._held_back.get(name)
            if held is None:
                self.say(
                    f"run_jobs: {run} did not start ({why}); nothing was recorded. The runs "
                    f"of {name} are tried again, at most {Backoff.CAP:g}s apart, until one "
                    f"starts."
                )
                held = self._held_back[name] = Backoff()
            held.again()
            return
        if name in self._held_back and not died:
            # It reached its job (or its slot was taken): the entry's runs start again.
            del self._held_back[name]
            self.say(f"run_jobs: {name} starts its runs again.")
        if name in self._asked:
            # A request for the entry heard while this run went on was left for now.
            self._asked.discard(name)
            self._poll_now = True
        if not died and status == SUCCEEDED:
            # A task entry's run ends when its task does (follow_tasks() says how).
            self.say(f"run_jobs: {run} {'enqueued' if child.entry.task else 'succeeded'}.")
            done = self._elsewhere if child.entry.task or child.run.manual else self._settled
            done.add((name, child.slot))
            return
        if not died and status == SKIPPED:
            # Claimed here, and yet its lock busy (a holder outside the schedulers, or the
            # claims lost in an outage) or its slot taken: rare, and said, since its start was.
            self.say(f"run_jobs: {run} skipped (running elsewhere, or done).")
            self._elsewhere.add((name, child.slot))
            return
        self.failed += 1
        if not died and status in (FAILED, LOST):
            self._settled.discard((child.entry.name, child.slot))  # retried while the latest
            self.say(f"run_jobs: {run} failed.")
            # The worker recorded it; alerted at the next pass (``reap``): no database
            # access here, which runs while the scheduler waits too (``_wait``).
            self._failures.append((child.entry, child.slot, ""))
            return
        how = child.run.stopped_because or f"its process died (exit status {status})"
        self._deaths.append(Death(child, how, time.monotonic()))

    def _record_deaths(self) -> None:
        """Record failed the runs whose process died, with how (the scheduler knows). A
        death stays for a later pass while the database can't record it (an outage), and
        while the server still holds the dead process's lock (``Death.record``)."""
        for death in list(self._deaths):
            child = death.child
            run = f"{child.entry.name} [{child.slot}]"
            unrecorded = death.record(self.using)
            if unrecorded is None:
                if not death.said_waiting:
                    death.said_waiting = True
                    self.say(f"run_jobs: {run} died ({death.how}); its lock is not free yet.")
                continue
            self._deaths.remove(death)
            self._unclaim.append(child.entry.name)  # its end recorded (or left to a sweep)
            self.say(f"run_jobs: {run} failed: {death.how}{unrecorded}")
            self._failures.append((child.entry, child.slot, f"The run {death.how}{unrecorded}."))

    def _record_deaths_before_exit(self) -> None:
        """Record the deaths, waiting for the server to free their locks (bounded by
        ``LOCK_FREED_AFTER_DEATH``: a death whose lock is still held then is said not
        recorded, and left to a sweep)."""
        self._record_deaths()
        while self._deaths:
            time.sleep(_LOOP / 4)
            self._record_deaths()

    def shut_down(self) -> None:
        """Let the running children finish for up to ``stop_grace`` seconds, then kill them;
        every run ends recorded, and no lock is left held. With the database out of reach,
        the runs whose process died are left ``running`` under a free lock: the sweep of
        the next scheduler that reaches the database marks them abandoned."""
        deadline = time.monotonic() + self.stop_grace
        try:
            while self.children and time.monotonic() < deadline:
                self._wait_for_workers(_LOOP / 4)
                self._collect()
            for child in list(self.children.values()):
                self.kill(child, "stopped with the scheduler")
            self._collect()
            self.pool.stop()
            self._record_deaths_before_exit()
            self._alert_failures()
        except Exception as error:
            if not is_outage(error):
                raise
            for death in self._deaths:
                self.say(
                    f"run_jobs: {death.child.entry.name} [{death.child.slot}] failed: "
                    f"{death.how}; {UNRECORDED}: the database is unreachable (a sweep will "
                    f"mark it abandoned)"
                )
            self._deaths.clear()
        finally:
            self.pool.stop()
            self.claims.close()

    # Listing.

    def listing(self) -> list[dict[str, Any]]:
        """Each entry with its next run and its last run, for ``run_jobs --list``."""
        self.follow_schedule(say=False)
        now = self.now()
        rows = []
        for name, entry in self.entries.items():
            last = (
                JobRun.objects.using(self.using)
                .filter(job_name=name)
                .order_by("-started_at")
                .first()
            )
            rows.append(
                {
                    "name": name,
                    "schedule": entry.cron if entry.cron else f"every {entry.every:g}s",
                    "next_run": entry.next_slot(now).isoformat(),
                    "next_slot": entry.slot_name(entry.next_slot(now)),
                    "paused": is_paused(self.using, name),
                    "last_slot": last.period if last else None,
                    "last_status": last.status if last else None,
                    "last_started": from_field(last.started_at).isoformat() if last else None,
                    "last_duration": last.duration.total_seconds()
                    if last and last.duration
                    else None,
                }
            )
        return rows
