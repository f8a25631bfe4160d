"""Where requests cross from the HTTP side to the inference thread.

The HTTP side puts commands on one queue (a submit, a cancel, a shutdown:
each a call for the inference thread to make, or None for "exit"); the
inference thread takes them between steps. Both sides read the counts
kept here (queued, active) and the requests still open. Every open request
is listed so that a shutdown, or a tensor-parallel failure, ends every
stream at once from any thread, without waiting for the inference thread
(it may be inside a long prefill step).
"""

from __future__ import annotations

import queue
import threading
from functools import partial
from typing import Callable, Optional

from .request import Event, QueueFullError, RequestHandle, ShuttingDownError


class Intake:
    """The command queue, and the requests not finished yet, counted."""

    def __init__(self, max_queued_requests: int):
        self.max_queued_requests = max_queued_requests
        self.num_queued = 0  # submitted, no token yet
        self.num_active = 0  # producing tokens (changed on the inference thread only)
        self.stopping = False
        self._commands: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._open: set[RequestHandle] = set()
        # Set on every command when a device loop steps the scheduler (several
        # models, ``device_loop.py``) instead of a thread of its own.
        self._wake: Optional[threading.Event] = None

    def attach(self, wake: threading.Event) -> None:
        self._wake = wake

    def put(self, command: Optional[Callable[[], None]]) -> None:
        self._commands.put(command)
        if self._wake is not None:
            self._wake.set()

    def submit(self, handle: RequestHandle, insert: Callable[[RequestHandle], None]) -> None:
        """Queue ``insert(handle)``; raises ``QueueFullError`` or ``ShuttingDownError``."""
        with self._lock:
            if self.stopping:
                raise ShuttingDownError("the server is shutting down")
            if self.num_queued >= self.max_queued_requests:
                raise QueueFullError(
                    f"too many queued requests ({self.num_queued}); retry later"
                )
            self.num_queued += 1
            self._open.add(handle)
        self.put(partial(insert, handle))

    def close_all(self, event: Event) -> None:
        """Refuse new requests and end every open one with ``event`` now.
        Signal-safe; the inference thread forgets them at its next turn."""
        with self._lock:
            self.stopping = True
            handles = list(self._open)
        for h in handles:
            h.close(event)

    def take(self, block: bool) -> list:
        """Every command queued, in order; ``block``: wait up to half a
        second for the first."""
        try:
            commands = [self._commands.get(timeout=0.5) if block else self._commands.get_nowait()]
        except queue.Empty:
            return []
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    @property
    def idle(self) -> bool:
        """No request queued and no command waiting."""
        with self._lock:
            queued = self.num_queued
        return not queued and self._commands.empty()

    def started(self) -> None:
        """A request's first token: it is active, no longer queued."""
        self._left_queue()
        self.num_active += 1

    def refuse(self, handle: RequestHandle, event: Optional[Event]) -> None:
        """A request leaves before its first token: ``event`` is its last
        (None: cancelled, nobody listens)."""
        self.finished(handle, started=False)
        if event is not None:
            handle.close(event)

    def finished(self, handle: RequestHandle, started: bool) -> None:
        """A request has left (its last event posted, or none for a cancel)."""
        with self._lock:
            self._open.discard(handle)
        if started:
            self.num_active -= 1
        else:
            self._left_queue()

    def _left_queue(self) -> None:
        with self._lock:
            self.num_queued -= 1
