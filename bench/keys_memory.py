"""Many keys and memory: PostgreSQL's lock table, and 1,000,000 distinct keys in a row.

    .venv/bin/python bench/keys_memory.py [--cycles 1000000] [--pg-cycles 1000000]
    .venv/bin/python bench/keys_memory.py --only keys        # or: --only memory

Many keys: one PostgreSQL connection takes session locks on distinct int keys through the
library (``advisory_lock(i, using="postgresql").__enter__()``, never exited) until the lock
table is full (``AdvisoryLockError``); the error's message must name
``max_locks_per_transaction``. Reported: the count, the server's settings and the formula
``max_locks_per_transaction x (max_connections + max_prepared_transactions)``, what the other
sessions had in the shared lock table, and whether another session could still take a lock
while the table was full. Then ``SELECT pg_advisory_unlock_all()`` frees them all. The table is
full for a moment: other sessions on the server may get "out of shared memory" then.

Memory: ``--cycles`` acquire + release cycles (``with advisory_lock(key, using=...)``), each on
a key never used before (``f"key-{i}"``, then ints), on SQLite and PostgreSQL, with
tracemalloc on: traced memory (current and peak) and the process's RSS after ``gc.collect()``
at 0, 25, 50, 75 and 100 % of the loop, the size of the library's name memory (bounded at
1000) and of its per-connection hold tables. A released SQLite lock's file is removed (when
no one else holds it), so the files left in the lock folder, their number and size, must be
none. The temporary folder is deleted at the end
(``--keep`` keeps it).
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import sys
import tempfile
import time
import tracemalloc
from importlib.metadata import version as dist_version
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR.parent))
sys.path.insert(0, str(BENCH_DIR))

import django  # noqa: E402
from django.conf import settings  # noqa: E402
from fleet import affinity_note  # noqa: E402
from fleet import library_revision  # noqa: E402
from fleet import pinned  # noqa: E402
from fleet import wait_until_quiet  # noqa: E402
from servers import PG  # noqa: E402
from servers import PG_PARAMS  # noqa: E402
from servers import databases  # noqa: E402

FOLDER = Path(tempfile.mkdtemp(prefix="advisory-lock-keys-"))

settings.configure(
    DEBUG=False,
    USE_TZ=True,
    DATABASES=databases(
        {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": str(FOLDER / "bench.sqlite3"),
        }
    ),
    INSTALLED_APPS=["django.contrib.contenttypes", "advisory_lock"],
    DEFAULT_AUTO_FIELD="django.db.models.BigAutoField",
)
django.setup()

import psycopg  # noqa: E402
from django.db import DatabaseError  # noqa: E402
from django.db import connections  # noqa: E402

from advisory_lock import AdvisoryLockError  # noqa: E402
from advisory_lock import advisory_lock  # noqa: E402
from advisory_lock.backends.sqlite import lock_folder  # noqa: E402
from advisory_lock.holds import connection_locks  # noqa: E402
from advisory_lock.keys import MAX_REMEMBERED_NAMES  # noqa: E402
from advisory_lock.keys import make_key  # noqa: E402
from advisory_lock.keys import recent_names  # noqa: E402

K = 0x6B65_7900_0000_0000  # int keys of this benchmark start here


# Many keys.


def many_keys() -> str:
    monitor = psycopg.connect(**PG_PARAMS, autocommit=True)
    show = {
        name: int(monitor.execute(f"SHOW {name}").fetchone()[0])
        for name in ("max_locks_per_transaction", "max_connections", "max_prepared_transactions")
    }
    formula = show["max_locks_per_transaction"] * (
        show["max_connections"] + show["max_prepared_transactions"]
    )
    in_table = "SELECT count(*) FROM pg_locks WHERE NOT fastpath AND pid IS DISTINCT FROM %s"
    connection = connections[PG]
    connection.ensure_connection()
    pid = connection.connection.info.backend_pid
    others_before = monitor.execute(in_table, (pid,)).fetchone()[0]
    held = 0
    message = ""
    started = time.perf_counter()
    try:
        while True:
            advisory_lock(K + held, using=PG).__enter__()
            held += 1
            if held > 100 * formula:
                break  # no limit found: reported below
    except AdvisoryLockError as error:
        message = str(error)
    filled = time.perf_counter() - started
    # While the table is full: what the others have in it, and can another session lock?
    try:
        others_full = monitor.execute(in_table, (pid,)).fetchone()[0]
        ours = monitor.execute(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = %s", (pid,)
        ).fetchone()[0]
    except psycopg.Error as error:
        others_full = ours = f"? ({type(error).__name__}: {error})"
    try:
        got = monitor.execute("SELECT pg_try_advisory_lock(%s)", (K - 1,)).fetchone()[0]
        if got:
            monitor.execute("SELECT pg_advisory_unlock(%s)", (K - 1,))
        other_session = f"took a lock ({got})"
    except psycopg.Error as error:
        other_session = f"failed: `{type(error).__name__}: {str(error).strip()}`"
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_advisory_unlock_all()")
    left = monitor.execute(
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = %s", (pid,)
    ).fetchone()[0]
    connection.close()
    monitor.close()
    names_it = "max_locks_per_transaction" in message
    lines = [
        "### Many keys: session locks one PostgreSQL connection can hold",
        "",
        "| | |",
        "| --- | ---: |",
        f"| `max_locks_per_transaction` | {show['max_locks_per_transaction']} |",
        f"| `max_connections` | {show['max_connections']} |",
        f"| `max_prepared_transactions` | {show['max_prepared_transactions']} |",
        f"| formula: max_locks_per_transaction x (max_connections + max_prepared_transactions)"
        f" | {formula:,} |",
        f"| locks of other sessions in the shared table before | {others_before} |",
        f"| **locks this connection took before `AdvisoryLockError`** | **{held:,}** |",
        f"| ... as pg_locks counted them (table full) | {ours} |",
        f"| locks of other sessions in the table when full | {others_full} |",
        f"| time to fill (s) | {filled:.2f} ({filled / max(held, 1) * 1e6:.0f} µs per lock) |",
        f"| held / formula | {held / formula:.2f} |",
        f"| this connection's advisory locks after `pg_advisory_unlock_all()` | {left} |",
        "",
        f"- error message names `max_locks_per_transaction`: **{'yes' if names_it else 'NO'}**",
        f"- the message: `{message}`",
        f"- another session, while the table was full, `pg_try_advisory_lock`: {other_session}",
    ]
    if not message:
        lines.append(f"- NO error after {held:,} locks: the search stopped there")
    return "\n".join(lines)


# Memory.


def rss_mib() -> float:
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def lock_folder_usage(folder: Path) -> tuple[int, int, int]:
    """(files, bytes of content, bytes on disk) in ``folder``."""
    files = size = disk = 0
    if folder.is_dir():
        with os.scandir(folder) as entries:
            for entry in entries:
                stat = entry.stat(follow_symlinks=False)
                files += 1
                size += stat.st_size
                disk += stat.st_blocks * 512
    return files, size, disk


def memory_run(alias: str, kind: str, cycles: int) -> tuple[list[str], dict[str, Any]]:
    key = (lambda i: f"key-{i}") if kind == "str" else (lambda i: K + i)
    offset = 0 if kind == "str" else 10**7  # fresh keys in each run
    locks = connection_locks(connections[alias])
    backend = locks.backend
    with advisory_lock(key(offset - 1), using=alias):  # connect, caches: before measuring
        pass
    marks = [cycles * share // 4 for share in range(5)]
    rows = []
    gc.collect()
    tracemalloc.start(1)
    first = tracemalloc.take_snapshot()
    started = time.perf_counter()
    done = 0
    lost = ""
    for mark in marks:
        try:
            for i in range(offset + done, offset + mark):
                with advisory_lock(key(i), using=alias):
                    pass
        except DatabaseError as error:
            # Someone restarted the server: say so, and go on from the next key.
            lost = f"connection lost at cycle {i - offset:,} ({str(error).splitlines()[0]})"
            connections[alias].close()
        done = mark
        elapsed = time.perf_counter() - started
        gc.collect()
        current, peak = tracemalloc.get_traced_memory()
        holds = backend.held_count() if hasattr(backend, "held_count") else "-"
        rows.append(
            f"| {alias_name(alias)} | {kind} | {mark:,} ({mark * 100 // cycles} %) "
            f"| {current / 1024:,.1f} | {peak / 1024:,.1f} | {rss_mib():,.1f} "
            f"| {len(recent_names())} | {len(locks.session_holds)} / {holds} "
            f"| {elapsed:,.1f} |"
        )
    last = tracemalloc.take_snapshot()
    tracemalloc.stop()
    growth = [
        f"{stat.traceback[0].filename.rsplit('/', 2)[-1]}:{stat.traceback[0].lineno} "
        f"{stat.size_diff / 1024:+.1f} KiB"
        for stat in last.compare_to(first, "lineno")[:3]
    ]
    elapsed = time.perf_counter() - started
    connections[alias].close()
    return rows, {"per_cycle": elapsed / cycles * 1e6, "growth": growth, "lost": lost}


def alias_name(alias: str) -> str:
    return "SQLite" if alias == "default" else "PostgreSQL"


def fifo_or_lru() -> str:
    """Is the name memory an LRU (a name used again is kept) or a FIFO of first use?"""
    make_key("hot-name")
    for i in range(MAX_REMEMBERED_NAMES):
        make_key(f"cold-name-{i}")
        if i % 100 == 0:
            make_key("hot-name")  # used again and again
    kept = "hot-name" in recent_names()
    return (
        f"a name used every 100 new names is {'kept' if kept else 'EVICTED'} after "
        f"{MAX_REMEMBERED_NAMES} new names: the memory is "
        f"{'an LRU' if kept else 'a FIFO of first use, not an LRU'}"
    )


def memory(cycles: int, pg_cycles: int) -> str:
    lock_dir = Path(lock_folder(connections["default"]))
    lines = [
        "### Memory: acquire + release on a new key every cycle (`with advisory_lock(key)`)",
        "",
        "| database | keys | cycles done | tracemalloc current (KiB) | peak (KiB) | RSS (MiB) "
        "| names remembered | session holds / open lock files | s |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    notes = []
    files_lines = []
    before = lock_folder_usage(lock_dir)
    for alias, kind, n in (
        ("default", "str", cycles),
        ("default", "int", cycles),
        (PG, "str", pg_cycles),
        (PG, "int", pg_cycles),
    ):
        if n <= 0:
            continue
        rows, info = memory_run(alias, kind, n)
        lines += rows
        notes.append(
            f"- {alias_name(alias)}, {kind} keys: {info['per_cycle']:.1f} µs per cycle under "
            f"tracemalloc; largest growth by line, 0 → 100 %: {'; '.join(info['growth'])}"
            + (f"; **{info['lost']}**" if info["lost"] else "")
        )
        if alias == "default":
            after = lock_folder_usage(lock_dir)
            added, content, disk = (a - b for a, b in zip(after, before, strict=True))
            files_lines.append(
                f"| {kind} keys, {n:,} cycles | {added:,} | {content / 2**20:,.1f} "
                f"| {disk / 2**20:,.1f} |"
            )
            before = after
    sample = next(iter(sorted(lock_dir.glob("*.lock"))), None) if lock_dir.is_dir() else None
    lines += ["", *notes, f"- {fifo_or_lru()}", ""]
    lines += [
        f"#### SQLite lock files left in the lock folder (`{lock_dir.name}/`) after the runs",
        "",
        "| run | files added | MiB of content | MiB on disk (blocks) |",
        "| --- | ---: | ---: | ---: |",
        *files_lines,
    ]
    if sample is not None:
        content = sample.read_text().strip()
        lines += ["", f"- a left file, `{sample.name}`, holds: `{content or '(empty)'}`"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cycles", type=int, default=1_000_000, help="SQLite, per key kind")
    parser.add_argument("--pg-cycles", type=int, default=1_000_000, help="PostgreSQL, per kind")
    parser.add_argument("--only", choices=("keys", "memory"))
    parser.add_argument("--pin", type=int, metavar="CPU", help="pin this and the servers")
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder")
    parser.add_argument("--quiet-wait", type=float, default=600, help="max s to wait for quiet")
    args = parser.parse_args(argv)
    quiet = wait_until_quiet(args.quiet_wait)
    server = psycopg.connect(**PG_PARAMS).info.parameter_status("server_version")
    pinning = "pinned" if args.pin is not None else "NOT pinned"
    try:
        with pinned(args.pin):
            print("# advisory_lock: many keys, and memory over many distinct keys\n")
            print(f"- {library_revision()}; {quiet}")
            print(f"- {affinity_note()} ({pinning}); {os.cpu_count()} CPUs")
            print(
                f"- PostgreSQL {server}; Django {django.get_version()}; psycopg "
                f"{dist_version('psycopg')}; Python {sys.version.split()[0]}\n",
                flush=True,
            )
            if args.only in (None, "keys"):
                print(many_keys() + "\n", flush=True)
            if args.only in (None, "memory"):
                print(memory(args.cycles, args.pg_cycles), flush=True)
    finally:
        if args.keep:
            print(f"(kept {FOLDER})", file=sys.stderr)
        else:
            shutil.rmtree(FOLDER, ignore_errors=True)


if __name__ == "__main__":
    main()
