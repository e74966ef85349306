"""A PostgreSQL HA cluster of the test's own, for the failover tests and bench/failover.py.

``patroni_cluster()`` is a context manager that starts, on free 127.0.0.1 ports in a temporary
folder:

- etcd (Debian's ``etcd-server``), one member, with a data folder of its own: Patroni's DCS.
  The package's own service, if the machine runs one, is neither used nor touched;
- two Patroni nodes (PyPI's ``patroni[etcd3]``, the ``test`` dependency group), each running a
  PostgreSQL server (``/usr/lib/postgresql/15/bin``, or the newest version there): the first
  to get etcd's initialize key runs ``initdb`` and becomes the primary, the other
  ``pg_basebackup``s from it and streams. Patroni's ``synchronous_mode`` is on: a commit
  returns once the replica has its WAL, so what a client saw committed (a fencing token, a
  ledger row) is still there after a failover to it. ``primary_start_timeout: 0`` makes a
  primary whose postmaster died fail over at once instead of being restarted in place;
  ``ttl`` 20, ``loop_wait`` 1, ``retry_timeout`` 3 are the smallest Patroni accepts;
- HAProxy (Debian's ``haproxy``) in front of both, routing to the node whose Patroni REST API
  answers ``GET /primary`` with 200, checked every 0.5 s; ``on-marked-down shutdown-sessions``
  cuts the sessions of a node once it is no longer the primary (Patroni's own template).

Clients reach the primary the two ways teams do: libpq's multi-host string (Django's
``HOST`` "127.0.0.1,127.0.0.1", ``PORT`` "p1,p2", ``target_session_attrs=read-write``), the
``multihost`` route, and HAProxy, the ``haproxy`` route (``Cluster.database(route)``).

Every wait is for an event (etcd's ``/health``, Patroni's ``/cluster`` showing a running
leader and a streaming synchronous standby, a SQL connection through each route reaching the
leader), polled, and bounded by ``GUARD`` seconds, a guard against a cluster that never
comes up, not a delay. The operations: ``switchover()`` (Patroni's REST ``POST
/switchover``) and ``fail_over()`` (SIGKILL of the primary's postmaster); each returns once
the other node is the primary and the old one streams from it again, with the times of the
events. At the end every process is stopped (SIGTERM, then SIGKILL; a postmaster left by a
killed Patroni too) and the folder removed: the machine's own PostgreSQL (5432) is never
touched.

PostgreSQL refuses to run as root, and Patroni is its parent: run as root, Patroni runs in a
user namespace (``unshare --user``) where our user is mapped to the ``postgres`` OS user's uid
and gid, so that the servers see themselves run as ``postgres``, while Patroni runs on this
virtualenv's Python (which the ``postgres`` user itself may not be allowed to execute, as
with a pyenv Python under ``/root``).

Without the programs the tests are skipped, loudly; with CI=true they fail
(``require_patroni``, the pattern of tests/pgbouncer.py).
"""

from __future__ import annotations

import contextlib
import http.client
import importlib.util
import json
import os
import pwd
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from collections.abc import Iterator
from dataclasses import dataclass
from dataclasses import field
from pathlib import Path
from typing import Any
from typing import TypeVar

from tests.processes import start_run_jobs

PG_MAJOR = 15


def _bindir() -> Path:
    """PostgreSQL 15's server programs, else the newest version's Debian installed
    (``TEST_PATRONI_BINDIR`` to choose)."""
    if chosen := os.environ.get("TEST_PATRONI_BINDIR"):
        return Path(chosen)
    versions = sorted(
        (int(path.parent.parent.name), path.parent)
        for path in Path("/usr/lib/postgresql").glob("*/bin/postgres")
        if path.parent.parent.name.isdigit()
    )
    preferred = [bindir for version, bindir in versions if version == PG_MAJOR]
    return (preferred or [bindir for _, bindir in versions[-1:]] or [Path("/nonexistent")])[0]


BINDIR = _bindir()
HAPROXY = os.environ.get("TEST_HAPROXY", "/usr/sbin/haproxy")
INSTALL_HINT = (
    "install the Debian packages etcd-server, haproxy and postgresql, and the test "
    "dependency group (patroni[etcd3]); scripts/setup.sh --servers does"
)
#: Bound on every wait for the cluster: a guard against one that never gets there, not a
#: delay (a switchover takes seconds; a rejoin after a crash, its recovery and pg_rewind).
GUARD = 180.0
#: The database the tests and the bench use on the cluster.
DBNAME = "advisory_lock"
ROUTES = ("multihost", "haproxy")
T = TypeVar("T")


class Unavailable(Exception):
    """A program the cluster needs is missing."""


def missing() -> str | None:
    """What is missing for a cluster, or None."""
    lacking = []
    if not shutil.which("etcd"):
        lacking.append("etcd (Debian package etcd-server)")
    if not os.access(HAPROXY, os.X_OK):
        lacking.append(f"{HAPROXY} (Debian package haproxy)")
    if not all(os.access(BINDIR / name, os.X_OK) for name in ("postgres", "initdb")):
        lacking.append(f"PostgreSQL's server programs (postgres, initdb) in {BINDIR}")
    if importlib.util.find_spec("patroni") is None or importlib.util.find_spec("etcd") is None:
        lacking.append("the Python package patroni[etcd3]")
    if os.geteuid() == 0 and not shutil.which("unshare"):
        lacking.append("unshare (util-linux), to run the servers as postgres")
    if not lacking:
        return None
    return f"no Patroni cluster can be started: missing {', '.join(lacking)}: {INSTALL_HINT}."


def require_patroni() -> None:
    """Skip the test (fail it with CI=true) when a cluster can't be started here."""
    import pytest

    if (message := missing()) is None:
        return
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI=true but {message}", pytrace=False)
    pytest.skip(f"\n\n*** {message} The failover tests are SKIPPED. ***\n")


def free_ports(count: int) -> list[int]:
    """``count`` distinct ports free on 127.0.0.1 now, below the kernel's range of ephemeral
    ports (``ip_local_port_range``), so that no client connection of the machine takes one
    before our server binds it. Held together while they are picked: no two are the same."""
    low = 32768
    with contextlib.suppress(OSError, ValueError):
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    picker = random.Random()
    held: list[socket.socket] = []
    try:
        while len(held) < count:
            probe = socket.socket()
            try:
                probe.bind(("127.0.0.1", picker.randrange(max(1024, low - 12000), low)))
            except OSError:
                probe.close()
                continue
            held.append(probe)
        return [probe.getsockname()[1] for probe in held]
    finally:
        for probe in held:
            probe.close()


def wait_for(condition: Callable[[], T], what: str, timeout: float = GUARD) -> T:
    """Poll ``condition`` until it returns something true; fail after ``timeout`` (a guard)."""
    deadline = time.monotonic() + timeout
    while True:
        if value := condition():
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:g}s: {what}")
        time.sleep(0.05)


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


@dataclass
class Node:
    """One Patroni node and its PostgreSQL server."""

    name: str
    port: int
    rest_port: int
    data: Path
    log: Path
    process: subprocess.Popen | None = None

    def rest(
        self, path: str, method: str = "GET", body: dict[str, Any] | None = None
    ) -> tuple[int, Any]:
        """Patroni's REST API: (status, the JSON answer or its text); (0, error) if down."""
        connection = http.client.HTTPConnection("127.0.0.1", self.rest_port, timeout=30)
        try:
            payload = json.dumps(body) if body is not None else None
            headers = {"Content-Type": "application/json"} if body is not None else {}
            connection.request(method, path, payload, headers)
            response = connection.getresponse()
            text = response.read().decode(errors="replace")
        except OSError as error:
            return 0, str(error)
        finally:
            connection.close()
        try:
            return response.status, json.loads(text)
        except ValueError:
            return response.status, text

    def postmaster_pid(self) -> int | None:
        """The running postmaster's pid (its ``postmaster.pid``), or None."""
        try:
            pid = int((self.data / "postmaster.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            return None
        return pid if b"postgres" in command and str(self.data).encode() in command else None


@dataclass
class Operation:
    """A switchover or a failover: when it was asked for (``time.monotonic()``), when the new
    primary answered SQL through each route, and when the cluster was whole again."""

    kind: str
    old: str
    new: str
    started: float
    primary_up: dict[str, float] = field(default_factory=dict)
    healthy: float = 0.0


@dataclass
class Cluster:
    """A running cluster: its nodes, etcd's and HAProxy's ports, its folder."""

    folder: Path
    scope: str
    etcd_port: int
    haproxy_port: int
    nodes: list[Node]
    dbname: str = DBNAME
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)

    # Where clients connect.

    def database(self, route: str) -> dict[str, Any]:
        """Django's settings of a database alias on the cluster, through ``route``."""
        if route == "multihost":
            host = ",".join("127.0.0.1" for _ in self.nodes)
            port = ",".join(str(node.port) for node in self.nodes)
            # libpq tries the hosts in turn and keeps the first that accepts writes.
            options = {"target_session_attrs": "read-write", "connect_timeout": 5}
        elif route == "haproxy":
            host, port, options = "127.0.0.1", str(self.haproxy_port), {"connect_timeout": 5}
        else:
            raise ValueError(f"route must be one of {ROUTES}: {route!r}")
        return {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": self.dbname,
            "USER": "postgres",
            "PASSWORD": "",
            "HOST": host,
            "PORT": port,
            "OPTIONS": options,
        }

    def conninfo(self, route: str = "multihost", dbname: str | None = None) -> str:
        settings = self.database(route)
        params = {
            "host": settings["HOST"],
            "port": settings["PORT"],
            "user": "postgres",
            "dbname": dbname or self.dbname,
            **settings["OPTIONS"],
        }
        return " ".join(f"{key}={value}" for key, value in params.items())

    def connect(self, route: str = "multihost", dbname: str | None = None) -> Any:
        """A psycopg connection (autocommit) to the primary through ``route``."""
        import psycopg

        return psycopg.connect(self.conninfo(route, dbname), autocommit=True)

    def environment(self, route: str) -> dict[str, str]:
        """What a process running tests/patroni_settings.py needs: both routes' aliases, and
        ``route``'s as its "default"."""
        aliases = {name: self.database(name) for name in ROUTES}
        return {
            "DJANGO_SETTINGS_MODULE": "tests.patroni_settings",
            "ADVISORY_LOCK_TEST_PATRONI": json.dumps(aliases),
            "ADVISORY_LOCK_TEST_PATRONI_DEFAULT": route,
        }

    def sql(self, statement: str, params: Any = None, route: str = "multihost") -> list[tuple]:
        with self.connect(route) as connection:
            cursor = connection.execute(statement, params)
            return cursor.fetchall() if cursor.description else []

    # The cluster's state, as Patroni and the servers tell it.

    def members(self) -> list[dict[str, Any]]:
        """Patroni's ``/cluster`` members, asked of the first node that answers."""
        for node in self.nodes:
            status, answer = node.rest("/cluster")
            if status == 200 and isinstance(answer, dict):
                return list(answer.get("members", []))
        return []

    def node(self, name: str) -> Node:
        return next(node for node in self.nodes if node.name == name)

    def whole(self) -> str | None:
        """The leader's name once the cluster is whole: a running leader whose REST API
        answers ``/primary`` with 200, the other node a streaming synchronous standby on the
        same timeline; else None."""
        members = {member["name"]: member for member in self.members()}
        if len(members) != len(self.nodes):
            return None
        leaders = [m for m in members.values() if m["role"] == "leader"]
        others = [m for m in members.values() if m["role"] != "leader"]
        if len(leaders) != 1 or leaders[0]["state"] != "running":
            return None
        leader = leaders[0]
        for other in others:
            if other["role"] != "sync_standby" or other["state"] != "streaming":
                return None
            if other.get("timeline") != leader.get("timeline"):
                return None
        if self.node(leader["name"]).rest("/primary")[0] != 200:
            return None
        return str(leader["name"])

    def reaches(self, route: str, node: Node) -> bool:
        """Does a new connection through ``route`` reach ``node``, as a primary?"""
        try:
            rows = self.sql("SELECT inet_server_port(), pg_is_in_recovery()", route=route)
        except Exception:  # down, refused, or no writable host yet: not yet
            return False
        return rows == [(node.port, False)]

    def leader(self) -> Node:
        """The primary, once the cluster is whole and both routes reach it."""
        name = wait_for(self.whole, "a whole cluster (a leader and a streaming sync standby)")
        node = self.node(name)
        for route in ROUTES:
            wait_for(lambda route=route: self.reaches(route, node), f"{route} to {name}")
        return node

    def check_running(self) -> None:
        """Fail if one of the cluster's processes has exited."""
        for name, process in self.processes.items():
            if process.poll() is not None:
                log = self.folder / f"{name}.log"
                raise AssertionError(
                    f"{name} exited with status {process.returncode}:\n{_tail(log)}"
                )

    # Operations.

    def switchover(self) -> Operation:
        """Patroni's scripted switchover to the replica; returns once it is done and the old
        primary streams from the new one."""
        old = self.leader()
        new = next(node for node in self.nodes if node is not old)
        started = time.monotonic()
        status, answer = old.rest(
            "/switchover", "POST", {"leader": old.name, "candidate": new.name}
        )
        if status != 200:
            raise AssertionError(f"POST /switchover answered {status}: {answer}")
        return self._after(Operation("switchover", old.name, new.name, started))

    def fail_over(self) -> Operation:
        """SIGKILL the primary's postmaster: Patroni promotes the replica, and starts the old
        primary again as its replica (pg_rewind if it must)."""
        old = self.leader()
        new = next(node for node in self.nodes if node is not old)
        pid = old.postmaster_pid()
        assert pid is not None, f"no postmaster for {old.name}"
        started = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        return self._after(Operation("failover", old.name, new.name, started))

    def haproxy_states(self) -> dict[str, str]:
        """HAProxy's own view: each server's status (``UP``, ``DOWN``, ``UP 1/2`` on its way
        down...), from its stats socket's ``show stat``."""
        with socket.socket(socket.AF_UNIX) as client:
            client.settimeout(5)
            client.connect(str(self.folder / "haproxy.sock"))
            client.sendall(b"show stat\n")
            answer = b""
            while chunk := client.recv(65536):
                answer += chunk
        lines = answer.decode().splitlines()
        header = lines[0].lstrip("# ").split(",")
        rows = [dict(zip(header, line.split(","), strict=False)) for line in lines[1:] if line]
        return {
            row["svname"]: row["status"]
            for row in rows
            if row.get("svname") not in ("FRONTEND", "BACKEND")
        }

    def routed(self, route: str, node: Node) -> bool:
        """Does ``route`` lead to ``node`` as the primary now? HAProxy is asked first (a
        client that connects while no server is up waits in its queue: the SQL probe alone
        would time the queue), then a new SQL connection shows it."""
        if route == "haproxy":
            states = self.haproxy_states()
            if states.get(node.name) != "UP":
                return False
            if any(state.startswith("UP") for name, state in states.items() if name != node.name):
                return False
        return self.reaches(route, node)

    def _after(self, operation: Operation) -> Operation:
        new = self.node(operation.new)
        pending = set(ROUTES)

        def reached() -> bool:
            self.check_running()
            for route in sorted(pending):
                if self.routed(route, new):
                    operation.primary_up[route] = time.monotonic()
                    pending.discard(route)
            return not pending

        wait_for(reached, f"{sorted(pending)} to reach the new primary {new.name}")
        wait_for(
            lambda: self.whole() == new.name,
            f"{operation.old} streaming from {new.name} again after the {operation.kind}",
        )
        operation.healthy = time.monotonic()
        return operation

    def logs(self) -> str:
        return "\n".join(
            f"--- {path.name} ---\n{_tail(path)}" for path in sorted(self.folder.glob("*.log"))
        )


def _run_as_postgres() -> list[str]:
    """The command prefix that runs a program as the postgres OS user's uid and gid in a user
    namespace, when we are root (see the module's docstring); nothing otherwise."""
    if os.geteuid() != 0:
        return []
    user = pwd.getpwnam("postgres")
    return [
        shutil.which("unshare") or "unshare",
        "--user",
        f"--map-user={user.pw_uid}",
        f"--map-group={user.pw_gid}",
        "--",
    ]


def _environment(folder: Path) -> dict[str, str]:
    """A clean environment: no PG*, ETCD* or Django variable of ours leaks in."""
    return {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(folder),
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "PYTHONUNBUFFERED": "1",
    }


def _start(
    cluster: Cluster, name: str, command: list[str], cwd: Path | None = None
) -> subprocess.Popen:
    with (cluster.folder / f"{name}.log").open("wb") as log:
        process = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=cwd or cluster.folder,
            env=_environment(cluster.folder),
            start_new_session=True,
        )
    cluster.processes[name] = process
    return process


def _http_ok(port: int, path: str) -> bool:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        connection.request("GET", path)
        response = connection.getresponse()
        body = response.read()
    except OSError:
        return False
    finally:
        connection.close()
    return response.status == 200 and b'"true"' in body


def _patroni_config(cluster: Cluster, node: Node) -> dict[str, Any]:
    return {
        "scope": cluster.scope,
        "name": node.name,
        "log": {"level": "INFO", "format": "%(asctime)s %(levelname)s: %(message)s"},
        "restapi": {
            "listen": f"127.0.0.1:{node.rest_port}",
            "connect_address": f"127.0.0.1:{node.rest_port}",
        },
        "etcd3": {"hosts": [f"127.0.0.1:{cluster.etcd_port}"]},
        "bootstrap": {
            "dcs": {
                "ttl": 20,
                "loop_wait": 1,
                "retry_timeout": 3,
                "maximum_lag_on_failover": 1048576,
                "primary_start_timeout": 0,
                "synchronous_mode": True,
                "postgresql": {
                    "use_pg_rewind": True,
                    "use_slots": True,
                    "parameters": {
                        "wal_level": "replica",
                        "hot_standby": "on",
                        "wal_log_hints": "on",
                        "max_wal_senders": 10,
                        "max_replication_slots": 10,
                        "max_connections": 100,
                        "wal_keep_size": "256MB",
                        # A test server: its data need not survive the machine.
                        "fsync": "off",
                        "full_page_writes": "on",
                    },
                },
            },
            "initdb": [{"encoding": "UTF8"}, {"auth": "trust"}],
        },
        "postgresql": {
            "listen": f"127.0.0.1:{node.port}",
            "connect_address": f"127.0.0.1:{node.port}",
            "data_dir": str(node.data),
            "bin_dir": str(BINDIR),
            "pgpass": str(cluster.folder / f"{node.name}.pgpass"),
            "authentication": {
                "superuser": {"username": "postgres"},
                "replication": {"username": "postgres"},
                "rewind": {"username": "postgres"},
            },
            "parameters": {"unix_socket_directories": str(cluster.folder)},
            "pg_hba": [
                "local all all trust",
                "host all all 127.0.0.1/32 trust",
                "host replication all 127.0.0.1/32 trust",
            ],
            "remove_data_directory_on_rewind_failure": True,
            "remove_data_directory_on_diverged_timelines": True,
        },
    }


HAPROXY_CONFIG = """\
global
    maxconn 200
    stats socket {folder}/haproxy.sock mode 600 level user

defaults
    mode tcp
    timeout connect 4s
    timeout client 30m
    timeout server 30m
    timeout check 2s

listen primary
    bind 127.0.0.1:{port}
    option httpchk
    http-check send meth GET uri /primary
    http-check expect status 200
    default-server inter 500ms fall 2 rise 1 on-marked-down shutdown-sessions
{servers}
"""


@contextlib.contextmanager
def patroni_cluster(nodes: int = 2) -> Iterator[Cluster]:
    """A running cluster for the duration of the ``with`` block (see the module)."""
    if (message := missing()) is not None:
        raise Unavailable(message)
    folder = Path(tempfile.mkdtemp(prefix="advisory-lock-patroni-"))
    folder.chmod(0o755)
    etcd_port, etcd_peer, haproxy_port, *node_ports = free_ports(3 + 2 * nodes)
    cluster = Cluster(
        folder=folder,
        scope=f"advisory-lock-{etcd_port}",
        etcd_port=etcd_port,
        haproxy_port=haproxy_port,
        nodes=[
            Node(
                f"node{number}",
                node_ports[2 * number - 2],
                node_ports[2 * number - 1],
                folder / f"node{number}",
                Path(),
            )
            for number in range(1, nodes + 1)
        ],
    )
    try:
        try:
            _bring_up(cluster, etcd_peer)
        except Exception as error:
            message = f"the Patroni cluster did not start: {error}\n{cluster.logs()}"
            raise RuntimeError(message) from error
        yield cluster
    finally:
        _stop_all(cluster)
        shutil.rmtree(folder, ignore_errors=True)


def _bring_up(cluster: Cluster, peer: int) -> None:
    folder, etcd_port = cluster.folder, cluster.etcd_port
    _start(
        cluster,
        "etcd",
        [
            shutil.which("etcd") or "etcd",
            "--name=etcd0",
            f"--data-dir={folder / 'etcd'}",
            f"--listen-client-urls=http://127.0.0.1:{etcd_port}",
            f"--advertise-client-urls=http://127.0.0.1:{etcd_port}",
            f"--listen-peer-urls=http://127.0.0.1:{peer}",
            f"--initial-advertise-peer-urls=http://127.0.0.1:{peer}",
            f"--initial-cluster=etcd0=http://127.0.0.1:{peer}",
            f"--initial-cluster-token={cluster.scope}",
            "--initial-cluster-state=new",
        ],
    )

    def etcd_healthy() -> bool:
        cluster.check_running()
        return _http_ok(etcd_port, "/health")

    wait_for(etcd_healthy, "etcd's /health")
    for node in cluster.nodes:
        node.log = folder / f"{node.name}.log"
        config = folder / f"{node.name}.yml"
        # JSON is YAML: Patroni reads it as its configuration file.
        config.write_text(json.dumps(_patroni_config(cluster, node), indent=2))
        node.process = _start(
            cluster, node.name, [*_run_as_postgres(), sys.executable, "-m", "patroni", str(config)]
        )
    servers = "\n".join(
        f"    server {node.name} 127.0.0.1:{node.port} check port {node.rest_port}"
        for node in cluster.nodes
    )
    haproxy_config = folder / "haproxy.cfg"
    haproxy_config.write_text(
        HAPROXY_CONFIG.format(port=cluster.haproxy_port, servers=servers, folder=folder)
    )
    _start(cluster, "haproxy", [HAPROXY, "-db", "-f", str(haproxy_config)])

    def bootstrapped() -> str | None:
        cluster.check_running()
        return cluster.whole()

    leader = cluster.node(wait_for(bootstrapped, "the cluster's bootstrap"))
    with contextlib.closing(cluster.connect("multihost", dbname="postgres")) as connection:
        connection.execute(f"CREATE DATABASE {cluster.dbname}")
    for route in ROUTES:
        wait_for(lambda route=route: cluster.reaches(route, leader), f"{route} at start-up")


def _stop_all(cluster: Cluster) -> None:
    """HAProxy, then the Patroni nodes (each stops its server), then etcd; SIGKILL whatever
    does not stop, and any postmaster a killed Patroni left."""
    order = ["haproxy", *(node.name for node in cluster.nodes), "etcd"]
    for name in order:
        process = cluster.processes.get(name)
        if process is None or process.poll() is not None:
            continue
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(30)
    for node in cluster.nodes:
        if (pid := node.postmaster_pid()) is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGQUIT)  # immediate shutdown: it ends its children
            wait_for(
                lambda node=node: node.postmaster_pid() is None,
                f"{node.name}'s postmaster to exit",
                30,
            )


# Processes on the cluster: lock holders (tests/failover_child.py) and run_jobs schedulers.

ROOT = Path(__file__).resolve().parent.parent


def child_environment(cluster: Cluster, route: str, **more: str) -> dict[str, str]:
    """The environment of a Django process on the cluster (tests/patroni_settings.py)."""
    return {
        **os.environ,
        **cluster.environment(route),
        "PYTHONPATH": str(ROOT),  # manage.py's django-admin does not put it first
        "PYTHONUNBUFFERED": "1",
        **more,
    }


def migrate(cluster: Cluster) -> None:
    """The app's tables on the cluster's database (``job_runs``, ``lock_fences``, ...)."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "manage.py"), "migrate", "--verbosity", "0"],
        cwd=ROOT,
        env=child_environment(cluster, "multihost"),
        capture_output=True,
        text=True,
        timeout=GUARD,
    )
    if done.returncode:
        raise RuntimeError(f"migrate on the cluster failed:\n{done.stdout}{done.stderr}")


def server_time(cluster: Cluster) -> float:
    """The primary's clock (Unix seconds): the schedulers' clock."""
    return float(cluster.sql("SELECT extract(epoch FROM clock_timestamp())")[0][0])


def slot_of_second(seconds: float) -> str:
    """The slot of an entry with ``every`` below a minute (UTC, the settings' time zone)."""
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds))


class Schedulers:
    """``manage.py run_jobs`` processes on the cluster, each in a session of its own, their
    output in files of ``folder`` (the job processes inherit them, and may outlive a
    scheduler killed)."""

    def __init__(self, cluster: Cluster, folder: Path) -> None:
        self.cluster, self.folder = cluster, folder
        self.processes: list[subprocess.Popen] = []

    def start(self, route: str, schedule: dict[str, Any], *argv: str) -> subprocess.Popen:
        number = len(self.processes)
        env = child_environment(
            self.cluster,
            route,
            ADVISORY_LOCK_TEST_SCHEDULE=json.dumps(schedule),
            ADVISORY_LOCK_TEST_JOBS_DIR=str(self.folder),
        )
        process = start_run_jobs(self.folder, number, argv, env)
        self.processes.append(process)
        return process

    def out(self, number: int) -> str:
        return (self.folder / f"run_jobs.{number}.out").read_text()

    def err(self, number: int) -> str:
        return (self.folder / f"run_jobs.{number}.err").read_text()

    def own_log(self, number: int) -> list[tuple[str, str]]:
        """(level, message) of the lines the scheduler itself logged (not its jobs)."""
        pid = self.processes[number].pid
        lines = []
        for line in self.err(number).splitlines():
            level, _, rest = line.partition(" ")
            logged_pid, _, rest = rest.partition(" ")
            if logged_pid == str(pid) and level in ("INFO", "WARNING", "ERROR", "CRITICAL"):
                lines.append((level, rest.partition(": ")[2]))
        return lines

    def exited(self) -> list[str]:
        """The schedulers that have exited, with their status and the end of their stderr."""
        return [
            f"run_jobs #{number} exited with status {process.returncode}:\n"
            f"{self.err(number)[-3000:]}"
            for number, process in enumerate(self.processes)
            if process.poll() is not None
        ]

    def wait(self, condition: Callable[[], T], what: str, timeout: float = GUARD) -> T:
        """``wait_for``, failing at once if a scheduler exits meanwhile."""

        def watched() -> T:
            if exits := self.exited():
                raise AssertionError(f"during the wait for {what}: {exits}")
            return condition()

        return wait_for(watched, what, timeout)

    def stop(self) -> list[int]:
        """SIGTERM each; their exit statuses."""
        for process in self.processes:
            process.send_signal(signal.SIGTERM)
        return [process.wait(GUARD) for process in self.processes]

    def kill_all(self) -> None:
        for process in self.processes:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)  # and the job processes of its session
            process.wait()
