"""The one inference thread of a server with several models.

MLX work stays on one thread: the device is one, and two threads stepping
two models would contend for it with no say in who goes first. This loop
steps each loaded model's scheduler in turn (one ``Scheduler.tick`` each,
so every model with work gets a step per round, none starves), and runs the
jobs the model set gives it (loading a model, unloading one) between
rounds. It sleeps while no model has work, until a command to any of them
(``Scheduler.attach``) or a job wakes it.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Generator
from concurrent.futures import Future
from typing import Callable, Optional

from .scheduler import Scheduler

log = logging.getLogger("mlx_lm_server.serving.device_loop")


class DeviceLoop:
    def __init__(self, on_round: Optional[Callable[[], None]] = None):
        self.wake = threading.Event()
        self.schedulers: dict[str, Scheduler] = {}
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._running: list[tuple] = []  # (generator, future): jobs in steps
        self._on_round = on_round  # after every round, on the thread (keep-alive sweeps)
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="inference", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def call(self, job: Callable[[], object]) -> Future:
        """Run ``job`` on the loop's thread between rounds; its result (or
        exception) comes back in the future. A job that returns a generator
        runs in steps, one per round (the others' steps go in between), and
        its result is the generator's return value."""
        future: Future = Future()
        self._jobs.put((job, future))
        self.wake.set()
        return future

    def add(self, name: str, scheduler: Scheduler) -> None:
        """Step ``scheduler`` from now on (on the loop's thread)."""
        scheduler.attach(self.wake)
        if not scheduler.begin():
            raise RuntimeError(f"{name}: {scheduler.failed}")
        self.schedulers[name] = scheduler

    def remove(self, name: str) -> None:
        """Stop stepping a model (on the loop's thread): its batch closes."""
        scheduler = self.schedulers.pop(name, None)
        if scheduler is not None:
            scheduler.end()

    def stop(self, timeout: float = 10.0) -> None:
        """End every model's requests, close their batches, stop the thread."""
        self._stopping = True
        for scheduler in list(self.schedulers.values()):
            scheduler.shutdown()
        self.wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        while not self._stopping:
            self.wake.clear()
            self._run_jobs()
            busy = False
            for name, scheduler in list(self.schedulers.items()):
                if not scheduler.tick(block=False):
                    self.remove(name)
                    continue
                busy = busy or bool(scheduler._seqs)
            if self._on_round is not None:
                try:
                    self._on_round()
                except Exception:
                    log.exception("the model set's sweep failed")
            if not busy and not self._running:
                self.wake.wait(0.5)
        for scheduler in list(self.schedulers.values()):
            scheduler.tick(block=False)  # the shutdown commands: every stream ends
        for name in list(self.schedulers):
            self.remove(name)
        self._run_jobs()

    def _run_jobs(self) -> None:
        while True:
            try:
                job, future = self._jobs.get_nowait()
            except queue.Empty:
                break
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = job()
            except BaseException as e:  # to the caller, never the loop's end
                future.set_exception(e)
                continue
            if isinstance(result, Generator):
                self._running.append((result, future))
            else:
                future.set_result(result)
        for gen, future in list(self._running):  # one step of each job in steps
            try:
                next(gen)
            except StopIteration as done:
                self._running.remove((gen, future))
                future.set_result(done.value)
            except BaseException as e:
                self._running.remove((gen, future))
                future.set_exception(e)

    @property
    def working(self) -> bool:
        """A job in steps is under way (the loop does not sleep)."""
        return bool(self._running)
