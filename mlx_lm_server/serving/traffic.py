"""Finished requests' token ids, kept on disk to train a drafter on (``--record-traffic``).

A drafter learns best from the sequences its target serves: the prompts
users send and the outputs the target wrote. With ``--record-traffic DIR``
every finished request becomes one JSON line, ``{"prompt_ids": [...],
"output_ids": [...], "finish_reason": ..., "time": ...}``, in
``DIR/traffic-<start>-<n>.jsonl``; ``mlx-lm-server-drafter train --data``
reads these files as they are. This stores what users sent, as token ids
(which decode to their text): it is off by default, and the folder should be
treated as the prompts themselves.

Bounded: a file is closed at ``file_bytes`` and the oldest files are
deleted while the folder's recorded files exceed ``max_bytes``, but never a
file a recorder is writing: each holds a lock on its open file, so neither
its own pruning nor another recorder's (each model of a set records into
the same folder, and so may another server) deletes what is being written.
Lines are written by a thread of their own, so a long prompt's encoding
never stalls the inference thread's step.
"""

from __future__ import annotations

import fcntl
import json
import logging
import queue
import threading
import time
from pathlib import Path
from typing import Optional

log = logging.getLogger("mlx_lm_server.serving.traffic")

_STOP = object()


class TrafficRecorder:
    def __init__(self, folder: str, max_bytes: int = 1 << 30, file_bytes: Optional[int] = None):
        if max_bytes <= 0:
            raise ValueError(f"the traffic record's size must be above 0, got {max_bytes}")
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.file_bytes = file_bytes or max(1, min(64 << 20, max_bytes // 8))
        self._stamp = time.strftime("%Y%m%d-%H%M%S")
        self._index = 0
        self._file = None
        self._written = 0
        self.records = 0
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._write_loop, name="traffic-recorder",
                                        daemon=True)
        self._thread.start()

    def record(self, prompt_ids: list, output_ids: list, finish_reason: str) -> None:
        """Queue one finished request (any thread; returns at once)."""
        self._queue.put((list(prompt_ids), list(output_ids), finish_reason, time.time()))

    def close(self, timeout: float = 10.0) -> None:
        """Write what is queued, then stop."""
        self._queue.put(_STOP)
        self._thread.join(timeout)

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                break
            try:
                self._write(*item)
            except OSError as e:  # a full disk must not take the server down
                log.warning("could not record a request's traffic: %s", e)
        if self._file is not None:
            self._file.close()

    def _write(self, prompt_ids, output_ids, finish_reason, when) -> None:
        line = json.dumps({"prompt_ids": prompt_ids, "output_ids": output_ids,
                           "finish_reason": finish_reason, "time": round(when, 3)},
                          separators=(",", ":")) + "\n"
        if self._file is None or self._written >= self.file_bytes:
            self._next_file()
        self._file.write(line)
        self._file.flush()
        self._written += len(line)
        self.records += 1
        self._prune()

    def _next_file(self) -> None:
        """A file of this recorder's own (a name no other recorder has: two
        started in the same second share a stamp), locked while it is written."""
        if self._file is not None:
            self._file.close()  # its lock goes with it: prunable from now on
        while True:
            self._index += 1
            path = self.folder / f"traffic-{self._stamp}-{self._index:05d}.jsonl"
            try:
                self._file = path.open("x")
                break
            except FileExistsError:
                continue
        fcntl.flock(self._file, fcntl.LOCK_EX)
        self._written = 0

    def _prune(self) -> None:
        """Delete the oldest recorded files while all of them exceed the bound
        (never one being written, this recorder's or another's)."""
        files = sorted(self.folder.glob("traffic-*.jsonl"), key=lambda p: p.name)
        sizes = [_size(p) for p in files]
        total = sum(sizes)
        for path, size in zip(files, sizes):
            if total <= self.max_bytes:
                break
            if being_written(path):
                continue
            path.unlink(missing_ok=True)
            total -= size


def being_written(path: Path) -> bool:
    """Whether a recorder, of this process or another, holds ``path``'s lock
    (a lock taken through a second open file conflicts with the first even
    in one process)."""
    try:
        with path.open("rb") as f:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released as it closes
    except BlockingIOError:
        return True
    except FileNotFoundError:  # pruned by another recorder meanwhile
        pass
    return False


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:  # pruned by another recorder meanwhile
        return 0
