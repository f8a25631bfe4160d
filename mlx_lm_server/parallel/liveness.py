"""Tensor parallel: noticing that a rank, or the launcher, has gone.

A rank that stops answering leaves the others blocked in an all-reduce that
nothing else can interrupt, and ``mlx.launch`` forwards no signal when it is
itself killed. ``Heartbeat`` (a byte a second each way over TCP, which also
carries rank 0's doorbell to sleeping followers: see ``distributed.py``),
``Watchdog`` (where rank 0's address is unknown) and ``watch_parent`` end
the process instead of leaving it blocked or orphaned.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Optional

from .distributed import RING, Link

log = logging.getLogger("mlx_lm_server.parallel.distributed")


class Watchdog:
    """Ends the process when the inference loop makes no progress for
    ``timeout`` seconds: a rank that stops answering leaves the others
    blocked in an all-reduce, which nothing else can interrupt. The fallback
    where ``Heartbeat`` has no address for rank 0: it cannot tell a frozen
    rank from one long step (a big prefill), so its timeout must exceed both."""

    def __init__(self, link: Link, timeout: float, busy: Callable[[], bool],
                 on_timeout: Callable[[str], None]):
        self.link, self.timeout, self.busy, self.on_timeout = link, timeout, busy, on_timeout
        self._thread = threading.Thread(target=self._run, name="watchdog", daemon=True)

    def start(self) -> "Watchdog":
        self._thread.start()
        return self

    def _run(self) -> None:
        while True:
            time.sleep(min(1.0, self.timeout / 4))
            if not self.busy():
                self.link.last_progress = time.monotonic()
                continue
            idle = time.monotonic() - self.link.last_progress
            if idle > self.timeout:
                self.on_timeout(f"rank {self.link.rank}: no progress for {idle:.0f} s after "
                                f"plan {self.link.plans}; another rank stopped answering")
                return


HEARTBEAT_S = 1.0


class Heartbeat:
    """A byte a second each way between rank 0 and every other rank, on a
    TCP connection beside the collectives. A rank that dies closes it, and
    ``on_lost`` is called at once; one that freezes (or whose link drops)
    goes quiet, and after ``timeout`` seconds of silence ``on_lost`` is
    called, whatever the inference loop is doing: a long prefill step keeps
    beating (MLX releases the GIL while it evaluates), so it is never
    mistaken for a frozen rank. The same connection is the link's doorbell
    (``ring``, ``wait``)."""

    def __init__(self, link: Link, timeout: float, on_lost: Callable[[str], None]):
        self.link, self.timeout, self.on_lost = link, timeout, on_lost
        self.lost: Optional[str] = None  # why a connection ended
        self._conns: list = []  # (socket, its send lock): rank 0 one per other rank
        self._rings = threading.Semaphore(0)

    def start(self) -> bool:
        """Connect (a collective: every rank calls it); False where rank 0's
        address is unknown (the ``Watchdog`` must then stand in)."""

        host = rank0_host()
        server = None
        if self.link.leader:
            server = socket.create_server(("", 0))
        port = self.link.share(server.getsockname()[1] if server else None)
        usable = self.link.share(None if not self.link.leader else host is not None)
        if not usable:
            if server:
                server.close()
            return False
        if self.link.leader:
            server.settimeout(max(self.timeout, 30))
            for _ in range(self.link.size - 1):
                conn, addr = server.accept()
                self._pump(conn, f"a rank at {addr[0]}")
            server.close()
        else:
            conn = socket.create_connection((host, port), timeout=max(self.timeout, 30))
            self._pump(conn, "rank 0")
        self.link.doorbell = self
        return True

    def ring(self) -> None:
        """Rank 0: wake every other rank from ``wait``."""
        for conn, sending in self._conns:
            try:
                with sending:
                    conn.sendall(RING)
            except OSError:
                pass  # the reader reports it

    def wait(self) -> None:
        """A follower: sleep until rank 0 rings. Raises ``ConnectionError``
        once rank 0 is lost (``on_lost`` has been called by then)."""
        self._rings.acquire()
        if self.lost:
            raise ConnectionError(self.lost)

    def _pump(self, conn, peer: str) -> None:

        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn.settimeout(self.timeout)
        sending = threading.Lock()  # the beat and the doorbell share the socket
        self._conns.append((conn, sending))

        def send():
            try:
                while True:
                    with sending:
                        conn.sendall(b".")
                    time.sleep(HEARTBEAT_S)
            except OSError:
                pass  # the reader reports it

        def read():
            reason = None
            try:
                while reason is None:
                    data = conn.recv(64)
                    if not data:
                        reason = f"{peer} closed its connection"
                    for _ in range(data.count(RING)):
                        self._rings.release()
            except socket.timeout:
                reason = f"no heartbeat from {peer} for {self.timeout:.0f} s"
            except ConnectionResetError:
                # a process that dies with our beats unread in its socket
                # resets the connection instead of closing it
                reason = f"{peer} closed its connection (reset)"
            except OSError as e:
                reason = f"lost {peer}: {e}"
            if self.lost is None:
                self.lost = f"rank {self.link.rank}: {reason} after plan {self.link.plans}"
                if not self.link.closing:
                    self.on_lost(self.lost)
                self._rings.release()  # a sleeping follower wakes to the loss

        for fn in (send, read):
            threading.Thread(target=fn, name=f"heartbeat-{fn.__name__}", daemon=True).start()


def watch_parent(parent: int, on_gone: Callable[[], None], every: float = 0.5) -> None:
    """Call ``on_gone`` once this process's parent ``parent`` has gone.
    ``mlx.launch`` forwards no signal to its ranks when it is itself killed,
    and its ranks would otherwise serve on as orphans. Polling ``getppid``
    works on macOS too (``PR_SET_PDEATHSIG`` is Linux only)."""

    def run():
        while os.getppid() == parent:
            time.sleep(every)
        on_gone()

    threading.Thread(target=run, name="parent-watch", daemon=True).start()


def rank0_host() -> Optional[str]:
    """Rank 0's address from the ring's hostfile (``MLX_HOSTFILE``: one
    ``"ip:port"`` or a list of them per rank, as ``mlx.launch`` writes it)."""
    path = os.environ.get("MLX_HOSTFILE")
    try:
        hosts = json.loads(Path(path).read_text()) if path else None
        first = hosts[0][0] if isinstance(hosts[0], list) else hosts[0]
        return first.rsplit(":", 1)[0]
    except (OSError, ValueError, TypeError, IndexError, KeyError, AttributeError):
        return None


def exit_now(status: int) -> None:
    """Leave without interpreter teardown (MLX's threads may still be blocked)."""
    logging.shutdown()
    try:

        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(status)
