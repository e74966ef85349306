"""A private single-node Galera cluster (MariaDB with wsrep on), for the cluster check."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

PROVIDER = Path("/usr/lib/galera/libgalera_smm.so")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def galera_node() -> Iterator[int]:
    """Start mariadbd with wsrep on as a new one-node cluster; yield its port."""
    if not (PROVIDER.exists() and shutil.which("mariadbd") and shutil.which("mariadb-install-db")):
        if os.environ.get("CI") == "true":
            pytest.fail("CI=true but MariaDB's Galera provider (Debian galera-4) is missing")
        pytest.skip("no Galera provider (Debian package galera-4) on this machine")
    folder = Path(tempfile.mkdtemp(prefix="advisory-lock-galera-"))
    shutil.chown(folder, "mysql", "mysql")
    data, port, group_port = folder / "data", free_port(), free_port()
    subprocess.run(
        ["mariadb-install-db", "--no-defaults", f"--datadir={data}", "--user=mysql",
         "--auth-root-authentication-method=normal", "--skip-test-db"],
        check=True, capture_output=True,
    )  # fmt: skip
    server = subprocess.Popen(
        ["mariadbd", "--no-defaults", f"--datadir={data}", f"--socket={folder / 'sock'}",
         f"--port={port}", "--bind-address=127.0.0.1", "--user=mysql",
         f"--pid-file={folder / 'pid'}", "--wsrep-on=ON", f"--wsrep-provider={PROVIDER}",
         "--wsrep-cluster-address=gcomm://",
         f"--wsrep-provider-options=gmcast.listen_addr=tcp://127.0.0.1:{group_port}",
         "--binlog-format=ROW", "--innodb-autoinc-lock-mode=2"],
        stdout=subprocess.DEVNULL, stderr=(folder / "error.log").open("wb"),
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while subprocess.run(
            ["mariadb-admin", "-uroot", "-h127.0.0.1", f"-P{port}", "ping"], capture_output=True
        ).returncode:
            log = (folder / "error.log").read_text(errors="replace")[-3000:]
            assert time.monotonic() < deadline, f"the Galera node did not start:\n{log}"
            assert server.poll() is None, f"the Galera node exited:\n{log}"
            time.sleep(0.2)
        yield port
    finally:
        server.terminate()
        try:
            server.wait(20)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        shutil.rmtree(folder, ignore_errors=True)
