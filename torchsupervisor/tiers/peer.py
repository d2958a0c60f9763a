"""Peer replicas: the chief's memory-tier snapshots copied into another node's memory.

When a whole node is lost (its processes killed, its memory gone), its memory tier goes with
it. So the chief of a replicated run (DDP) sends each snapshot it commits to a rank on another
node, which keeps the newest copy in its own memory root; a restarted chief whose own memory
lacks a newer snapshot fetches the copy back before it restores (every byte of it checked as
any snapshot's), reading nothing from disk or the bucket.

The transport is a plain TCP connection per snapshot:

* ``PeerServer`` (on the receiving rank, a thread): listens on an ephemeral port of the node's
  address, published to the other ranks through the process group's store with a random token
  that every request must carry. ``put`` receives a snapshot's files (data first, the manifest
  last) into ``<memory root>/<run key>/peer-<owner>/`` through ``MemoryTierStorage`` (the same
  commit protocol and file modes as the tier; a name that is not a snapshot file, a size over
  the room left, another owner or a wrong token is refused), then deletes the older copies;
  ``get`` sends one back. Both ends move the bytes in the kernel: ``sendfile(2)`` from the
  snapshot's files, ``splice(2)`` from the socket into the tmpfs
  (``LocalStorage.put_received``), so a copy costs the processes no pass over its bytes.
* ``PeerSender`` (on the chief, a thread): takes the newest committed snapshot (a newer one
  replaces one not yet sent: never a backlog), opens its files (an open file stays readable
  when retention deletes it), and sends them.

A request is one JSON line (at most 64 KiB), then the files' bytes; the answer is one JSON
line. Nothing is ever pickled.

Thread safety: the server and the sender run their own threads; their methods may be called
from any thread.

TF name: none.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import logging
import os
import re
import secrets
import socket
import threading
import time
from collections.abc import Collection
from typing import Any

from torchsupervisor.checkpoint.files import checkpoint_step, remove_checkpoint
from torchsupervisor.checkpoint.recovery import clean_checkpoint_dir, scan_checkpoints
from torchsupervisor.storage.private import MemoryTierStorage
from torchsupervisor.tiers.tier import snapshot_files

__all__ = [
    "PeerSender",
    "PeerServer",
    "fetch_snapshot",
    "held_steps",
    "peer_directory",
    "remove_newer",
    "send_snapshot",
]

logger = logging.getLogger("torchsupervisor")

_FILE = re.compile(r"model\.ckpt-(\d+)\.(index|data-\d{5}-of-\d{5})\Z")
_MAX_LINE = 1 << 16
_IO_TIMEOUT_SECS = 60.0
_POLL_SECS = 0.2


def peer_directory(run_directory: str, owner: int) -> str:
    """Where a rank keeps its copies of rank ``owner``'s snapshots: ``<run dir>/peer-<owner>``."""
    return os.path.join(run_directory, f"peer-{owner}")


def held_steps(directory: str, storage: MemoryTierStorage) -> list[int]:
    """The steps of the committed snapshots in ``directory``, newest first ([] if absent)."""
    if not storage.is_dir(directory):
        return []
    found = scan_checkpoints(directory, storage=storage)
    return sorted((s for s in map(checkpoint_step, found) if s is not None), reverse=True)


def remove_newer(directory: str, step: int, storage: MemoryTierStorage) -> list[int]:
    """Delete the snapshots in ``directory`` newer than ``step`` (of a timeline a restart
    abandoned); return their steps."""
    newer = [s for s in held_steps(directory, storage) if s > step]
    for old in newer:
        remove_checkpoint(os.path.join(directory, f"model.ckpt-{old}"), storage=storage)
    return newer


def _read_line(conn: socket.socket) -> dict[str, Any]:
    data = bytearray()
    while not data.endswith(b"\n"):
        chunk = conn.recv(1)
        if not chunk:
            raise ConnectionError("the peer closed the connection")
        data += chunk
        if len(data) > _MAX_LINE:
            raise ValueError("a request line longer than 64 KiB")
    value = json.loads(data.decode("utf-8"))
    if not isinstance(value, dict):
        raise ValueError("a request that is not a JSON object")
    return value


def _send_line(conn: socket.socket, value: dict[str, Any]) -> None:
    conn.sendall(json.dumps(value).encode("utf-8") + b"\n")


def _files(files: object, step: int) -> list[tuple[str, int]]:
    """The announced files, checked: snapshot files of ``step``, the manifest last."""
    if not isinstance(files, list) or not files:
        raise ValueError("no files")
    checked = []
    for item in files:
        if not (isinstance(item, list) and len(item) == 2):
            raise ValueError(f"a file entry that is not [name, size]: {item!r}")
        name, size = item
        match = _FILE.match(name) if isinstance(name, str) else None
        if match is None or int(match.group(1)) != step:
            raise ValueError(f"not a file of the snapshot of step {step}: {name!r}")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise ValueError(f"a size that is not a byte count: {size!r}")
        checked.append((name, size))
    if not checked[-1][0].endswith(".index") or sum(n.endswith(".index") for n, _ in checked) != 1:
        raise ValueError("the manifest must come last, once")
    return checked


class PeerServer:
    """Keeps copies of other ranks' snapshots sent to it, and gives back any snapshot this node
    holds (module docstring).

    Args:
        root: The memory tier's root (``tiers.memory_root.memory_root``).
        run_directory: The run's directory under ``root`` (``<root>/<run key>``); the copies of
            rank ``o`` go to ``peer_directory(run_directory, o)``, made 0700.
        host: The address to listen on (this node's, as the other nodes reach it).
        owners: The ranks whose snapshots are accepted; None: any rank (a sharded run's ring).
        keep: How many copies of each owner are kept (the newest ones; at least 1).
        local: Also give back the snapshots in this node's ``rank-<o>`` directories (a sharded
            run restarted with its ranks renumbered: a rank's part may be in the memory of a
            node that held another rank before).

    Attributes:
        address: ``"host:port"`` to publish.
        token: The secret every request must carry (published with the address).

    Raises:
        OSError: A directory cannot be made or the port not bound.
    """

    def __init__(
        self,
        root: str,
        run_directory: str,
        host: str,
        *,
        owners: Collection[int] | None = (0,),
        keep: int = 1,
        local: bool = False,
    ) -> None:
        if keep < 1:
            raise ValueError(f"keep must be at least 1, got {keep}")
        self.storage = MemoryTierStorage()
        self.root = root
        self.run_directory = run_directory
        self.owners = None if owners is None else frozenset(owners)
        self.keep = keep
        self.local = local
        self._received: set[int] = set()
        self.storage.prepare_directory(root, run_directory)
        for owner in self.owners or ():
            self.storage.prepare_directory(root, self.directory_of(owner))
            clean_checkpoint_dir(self.directory_of(owner), storage=self.storage)
        self.token = secrets.token_hex(16)
        self._socket = socket.create_server((host, 0))
        self._socket.settimeout(_POLL_SECS)
        self.address = f"{host}:{self._socket.getsockname()[1]}"
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._serve, name="torchsupervisor-peer-server", daemon=True
        )
        self._thread.start()

    def directory_of(self, owner: int) -> str:
        """Where the copies of rank ``owner``'s snapshots are kept."""
        return peer_directory(self.run_directory, owner)

    def holds(self) -> dict[int, list[int]]:
        """By owner, the steps of the committed snapshots this server gives back (its copies,
        and with ``local`` the node's own), newest first."""
        held: dict[int, set[int]] = {}
        kinds = ("peer", "rank") if self.local else ("peer",)
        for name in self.storage.list(self.run_directory):
            kind, _, owner = name.partition("-")
            if kind in kinds and owner.isdigit():
                steps = held_steps(os.path.join(self.run_directory, name), self.storage)
                if steps:
                    held.setdefault(int(owner), set()).update(steps)
        return {owner: sorted(steps, reverse=True) for owner, steps in sorted(held.items())}

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._socket.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # Closed.
            with conn:
                conn.settimeout(_IO_TIMEOUT_SECS)
                try:
                    self._handle(conn)
                except Exception as e:  # A bad or broken request never stops the server.
                    logger.warning("Peer replica: a request was refused: %s", e)
                    with contextlib.suppress(OSError):
                        _send_line(conn, {"error": str(e)})
                        _close_gently(conn)

    def _handle(self, conn: socket.socket) -> None:
        request = _read_line(conn)
        token = request.get("token")
        if not isinstance(token, str) or not hmac.compare_digest(token, self.token):
            raise PermissionError("a request without this server's token")
        owner = request.get("owner")
        if not isinstance(owner, int) or isinstance(owner, bool) or owner < 0:
            raise ValueError(f"not a rank: {owner!r}")
        step = request.get("step")
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"not a step: {step!r}")
        if request.get("op") == "put":
            if self.owners is not None and owner not in self.owners:
                expected = ", ".join(map(str, sorted(self.owners)))
                raise ValueError(f"a snapshot of rank {owner}, not of rank {expected}")
            self._put(conn, owner, step, _files(request.get("files"), step))
        elif request.get("op") == "get":
            self._get(conn, owner, step)
        else:
            raise ValueError(f"unknown operation {request.get('op')!r}")

    def _put(
        self, conn: socket.socket, owner: int, step: int, files: list[tuple[str, int]]
    ) -> None:
        directory = self.directory_of(owner)
        self.storage.prepare_directory(self.root, directory)
        self._received.add(owner)
        self.storage.check_room(directory, sum(size for _, size in files))
        prefix = os.path.join(directory, f"model.ckpt-{step}")
        try:
            for name, size in files:
                self.storage.put_received(os.path.join(directory, name), conn, size)
        except BaseException:
            remove_checkpoint(prefix, storage=self.storage)
            raise
        # A copy newer than the one received is of a timeline its owner abandoned (it restored
        # an older step): never to be given back. Then the newest ``keep``.
        remove_newer(directory, step, self.storage)
        for old in held_steps(directory, self.storage)[self.keep :]:
            remove_checkpoint(os.path.join(directory, f"model.ckpt-{old}"), storage=self.storage)
        _send_line(conn, {"ok": step})

    def drop_newer(self, owner: int, step: int) -> list[int]:
        """Delete the copies of ``owner``'s snapshots newer than ``step`` (its restart restored
        ``step``: they are of a timeline it abandoned); return their steps."""
        return remove_newer(self.directory_of(owner), step, self.storage)

    def _get(self, conn: socket.socket, owner: int, step: int) -> None:
        kinds = ("peer", "rank") if self.local else ("peer",)
        for kind in kinds:
            directory = os.path.join(self.run_directory, f"{kind}-{owner}")
            if step in held_steps(directory, self.storage):
                prefix = os.path.join(directory, f"model.ckpt-{step}")
                _send_prefix(conn, prefix, self.storage, {"step": step})
                return
        raise ValueError(f"no copy of step {step} of rank {owner}")

    def close(self, *, free: bool = False) -> None:
        """Stop serving; with ``free``, delete the copies of the owners it was made for and
        of those it received (a clean end)."""
        self._stop.set()
        self._socket.close()
        self._thread.join(_IO_TIMEOUT_SECS)
        if free:
            for owner in sorted((self.owners or set()) | self._received):
                self.storage.remove_directory(self.root, self.directory_of(owner))


def _close_gently(conn: socket.socket) -> None:
    """Read what the peer still sends (for 5 s at most), so that closing does not reset the
    connection before it has read the answer."""
    conn.shutdown(socket.SHUT_WR)
    conn.settimeout(1.0)
    deadline = time.monotonic() + 5.0
    with contextlib.suppress(OSError):
        while time.monotonic() < deadline and conn.recv(1 << 16):
            pass


def _send_prefix(
    conn: socket.socket, prefix: str, storage: MemoryTierStorage, header: dict[str, Any]
) -> None:
    """Send the header line with the files' names and sizes, then their bytes. Every file is
    opened first, and kept from becoming a spare (``MemoryTierStorage.reading``), so that a
    deletion meanwhile (retention) does not change what is sent."""
    directory = os.path.dirname(prefix)
    with contextlib.ExitStack() as stack:
        opened = []
        for name in snapshot_files(prefix, storage):
            path = os.path.join(directory, name)
            stack.enter_context(storage.reading(path))
            f = stack.enter_context(open(path, "rb"))
            opened.append((name, f, os.fstat(f.fileno()).st_size))
        _send_line(conn, {**header, "files": [[name, size] for name, _, size in opened]})
        for _, f, size in opened:
            if conn.sendfile(f, 0, size) != size:
                raise ConnectionError("the peer stopped reading")


def _connect(address: str) -> socket.socket:
    host, _, port = address.rpartition(":")
    conn = socket.create_connection((host, int(port)), timeout=_IO_TIMEOUT_SECS)
    return conn


def send_snapshot(address: str, token: str, owner: int, prefix: str) -> None:
    """Send the snapshot ``prefix`` of rank ``owner`` to the ``PeerServer`` at ``address``.

    Raises:
        OSError: It could not be read or sent; ``RuntimeError``: the server refused it.
    """
    step = checkpoint_step(prefix)
    storage = MemoryTierStorage()
    with _connect(address) as conn:
        header = {"op": "put", "token": token, "owner": owner, "step": step}
        _send_prefix(conn, prefix, storage, header)
        answer = _read_line(conn)
    if answer.get("ok") != step:
        raise RuntimeError(f"the peer at {address} refused the snapshot: {answer.get('error')}")


def fetch_snapshot(
    address: str, token: str, owner: int, step: int, root: str, directory: str
) -> str:
    """Fetch the copy of rank ``owner``'s snapshot of ``step`` from the ``PeerServer`` at
    ``address`` into ``directory`` (the data first, the manifest last); return its prefix.

    Raises:
        OSError, ValueError: It could not be fetched (nothing of it is left).
        RuntimeError: The server has no such copy.
    """
    storage = MemoryTierStorage()
    storage.prepare_directory(root, directory)
    prefix = os.path.join(directory, f"model.ckpt-{step}")
    with _connect(address) as conn:
        _send_line(conn, {"op": "get", "token": token, "owner": owner, "step": step})
        answer = _read_line(conn)
        if "error" in answer:
            raise RuntimeError(f"the peer at {address} has no copy: {answer['error']}")
        files = _files(answer.get("files"), step)
        storage.check_room(directory, sum(size for _, size in files))
        try:
            for name, size in files:
                storage.put_received(os.path.join(directory, name), conn, size)
        except BaseException:
            remove_checkpoint(prefix, storage=storage)
            raise
    return prefix


class PeerSender:
    """Sends the newest committed snapshot to a peer, on a thread of its own (module docstring).

    Args:
        address, token: The peer's ``PeerServer``.
        owner: This rank (whose snapshots they are).
        every_secs: Start a send at most once per this many seconds (0: as soon as the one
            before is done); what is offered meanwhile waits, the newest replacing the older.
            ``close`` sends what waits at once.

    Thread safety: ``offer`` from any thread.
    """

    def __init__(self, address: str, token: str, owner: int, every_secs: float = 0.0) -> None:
        self.address = address
        self._token = token
        self._owner = owner
        self._every_secs = every_secs
        self._lock = threading.Condition()
        self._pending: str | None = None
        self._closed = False
        self._failures: set[str] = set()
        self.sent: int | None = None
        """The step of the newest snapshot the peer holds."""
        self._thread = threading.Thread(
            target=self._run, name="torchsupervisor-peer-sender", daemon=True
        )
        self._thread.start()

    def offer(self, prefix: str) -> None:
        """Send ``prefix`` next (replacing one offered and not yet started)."""
        with self._lock:
            self._pending = prefix
            self._lock.notify()

    def _next(self, not_before: float) -> str | None:
        """The snapshot to send once ``not_before`` (``time.monotonic``) has come or the
        sender is closed; None: closed with nothing to send."""
        with self._lock:
            while not self._closed:
                left = not_before - time.monotonic()
                if self._pending is not None and left <= 0:
                    break
                self._lock.wait(left if self._pending is not None else None)
            prefix, self._pending = self._pending, None
            return prefix

    def _run(self) -> None:
        not_before = 0.0
        while (prefix := self._next(not_before)) is not None:
            not_before = time.monotonic() + self._every_secs
            try:
                send_snapshot(self.address, self._token, self._owner, prefix)
            except FileNotFoundError as e:  # Retention deleted it first: the next goes now.
                not_before = 0.0
                logger.debug("Peer replica: %s was deleted before it was sent: %s", prefix, e)
            except Exception as e:
                kind = type(e).__name__
                (logger.debug if kind in self._failures else logger.warning)(
                    "Peer replica: %s could not be sent to %s: %s", prefix, self.address, e
                )
                self._failures.add(kind)
            else:
                self.sent = checkpoint_step(prefix)

    def close(self, timeout_secs: float | None = None) -> None:
        """Send what is pending, then stop (waiting at most ``timeout_secs``)."""
        with self._lock:
            self._closed = True
            self._lock.notify()
        self._thread.join(timeout_secs)
