"""A TCP proxy in a thread of the test process, that can turn into a black hole.

``BlackHoleProxy(host, port)`` listens on a free port of 127.0.0.1 and forwards every
connection it accepts to ``host:port``. ``black_hole()`` makes it stop forwarding in both
directions at once, without closing either socket: neither end hears anything again, not
even a FIN or a RST, as on a partitioned network or behind a hung middlebox.

Unlike a real partition, the proxy's kernel still ACKs whatever the peers send, TCP keepalive
probes included: keepalive can't tell this from a healthy, quiet peer (the case of a hung
but not dead process or middlebox). Only an idle timeout on the server ends such a session.
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading
import time


class BlackHoleProxy:
    """Forward 127.0.0.1:<port> to ``upstream``, until ``black_hole()``."""

    def __init__(self, upstream_host: str, upstream_port: int) -> None:
        self.upstream = (upstream_host, int(upstream_port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._peers: dict[socket.socket, socket.socket] = {}
        self._parked: list[socket.socket] = []  # accepted while silent: never forwarded
        self._silent = threading.Event()
        self._stopped = threading.Event()
        self.black_holed_at: float | None = None
        self.connections = 0
        self._thread = threading.Thread(target=self._run, name="black-hole proxy", daemon=True)
        self._thread.start()

    def __enter__(self) -> BlackHoleProxy:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def black_hole(self) -> float:
        """Stop forwarding both ways, closing nothing; return when (time.monotonic())."""
        self.black_holed_at = time.monotonic()
        self._silent.set()
        return self.black_holed_at

    def close(self) -> None:
        """Stop the thread and close every socket (the server then sees the peer go)."""
        self._stopped.set()
        self._thread.join(5)
        for sock in [self._listener, *self._peers, *self._parked]:
            with contextlib.suppress(OSError):
                sock.close()
        self._peers.clear()
        self._parked.clear()

    def _run(self) -> None:
        while not self._stopped.is_set():
            silent = self._silent.is_set()
            watched = [self._listener, *([] if silent else self._peers)]
            try:
                readable, _, _ = select.select(watched, [], [], 0.05)
            except (OSError, ValueError):  # a socket closed under us: look again
                continue
            for sock in readable:
                if sock is self._listener:
                    self._accept()
                elif self._silent.is_set():
                    break  # black-holed between select() and here: forward nothing more
                elif sock in self._peers:
                    self._forward(sock)

    def _accept(self) -> None:
        client, _ = self._listener.accept()
        self.connections += 1
        if self._silent.is_set():
            self._parked.append(client)
            return
        try:
            server = socket.create_connection(self.upstream, timeout=5)
        except OSError:
            client.close()
            return
        server.settimeout(None)
        self._peers[client] = server
        self._peers[server] = client

    def _forward(self, sock: socket.socket) -> None:
        peer = self._peers[sock]
        try:
            data = sock.recv(65536)
            if data:
                peer.sendall(data)
                return
        except OSError:
            pass
        # One end closed (while forwarding): close the pair, as a proxy does.
        for end in (sock, peer):
            self._peers.pop(end, None)
            with contextlib.suppress(OSError):
                end.close()
