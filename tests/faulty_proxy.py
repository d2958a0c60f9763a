"""A TCP proxy in front of the real S3 server that fails the first connections it accepts,
and can be partitioned from it (``partition``: the server stops answering).

Each failed connection gets either an HTTP 503 with S3's ``SlowDown`` error (what S3 sends
when it throttles) or is closed without an answer (a reset connection); the connections after
that are forwarded to the server byte for byte. Listens on 127.0.0.1 only; ``close()`` shuts
every socket and joins every thread (bounded).
"""

from __future__ import annotations

import contextlib
import socket
import threading
from urllib.parse import urlparse

_BODY = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message></Error>"
)
SLOW_DOWN = (
    b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\nConnection: close\r\n"
    + f"Content-Length: {len(_BODY)}\r\n\r\n".encode()
    + _BODY
)


class FaultyProxy:
    """Forward to ``upstream`` (``http://host:port``) after failing ``failures`` connections.

    Args:
        upstream: The real server's endpoint.
        failures: How many connections to fail first (None: every one).
        mode: ``"503"`` (answer SlowDown) or ``"reset"`` (close at once).
    """

    def __init__(self, upstream: str, failures: int | None, mode: str = "503") -> None:
        parsed = urlparse(upstream)
        self._upstream = (parsed.hostname, parsed.port)
        self._left = failures
        self._mode = mode
        self.failed = 0
        self.forwarded = 0
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self._partitioned = False
        self._server = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"http://127.0.0.1:{self._server.getsockname()[1]}"
        self._start(self._accept)

    def _start(self, target, *args) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True, name="faulty-proxy")
        with self._lock:
            self._threads.append(thread)
        thread.start()

    def _track(self, sock: socket.socket) -> socket.socket:
        with self._lock:
            self._sockets.append(sock)
        return sock

    def partition(self) -> None:
        """From now on the server does not answer: open connections are cut, new ones are
        accepted and then held without a byte (a client waits for its read timeout)."""
        with self._lock:
            self._partitioned = True
            sockets = list(self._sockets)
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        """Stop accepting, shut every connection, and join the threads (10 s each at most)."""
        with self._lock:
            sockets = [self._server, *self._sockets]
            threads = list(self._threads)
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # Wakes a thread blocked in accept or recv.
            with contextlib.suppress(OSError):
                sock.close()
        for thread in threads:
            thread.join(10)

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return
            self._track(conn)
            with self._lock:
                if self._partitioned:
                    continue  # Held: accepted, never answered (closed by close()).
                fail = self._left is None or self._left > 0
                if fail:
                    self.failed += 1
                    if self._left is not None:
                        self._left -= 1
                else:
                    self.forwarded += 1
            self._start(self._fail if fail else self._forward, conn)

    def _fail(self, conn: socket.socket) -> None:
        with conn:
            if self._mode == "503":
                conn.settimeout(10)
                with contextlib.suppress(OSError):
                    conn.recv(65536)  # The request's head, so that the client reads the answer.
                    conn.sendall(SLOW_DOWN)
            else:
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\1\0\0\0\0\0\0\0")

    def _forward(self, conn: socket.socket) -> None:
        try:
            upstream = self._track(socket.create_connection(self._upstream, timeout=10))
        except OSError:
            conn.close()
            return
        upstream.settimeout(None)

        def pump(src: socket.socket, dst: socket.socket) -> None:
            with contextlib.suppress(OSError):
                while data := src.recv(1 << 16):
                    dst.sendall(data)
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)

        back = threading.Thread(target=pump, args=(upstream, conn), daemon=True)
        back.start()
        pump(conn, upstream)
        back.join(10)
        conn.close()
        upstream.close()
