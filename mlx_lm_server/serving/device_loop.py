"""The one inference thread of a server with several models.

MLX work stays on one thread: the device is one, and two threads stepping
two models would contend for it with no say in who goes first. This loop
shares the device's time between the models with work: each turn it steps
the one that has used the least time so far (a model that starts working
is placed level with the least-served busy one, so that it neither
starves the others nor waits for them to catch up). Steps in turn, one
each, would hold a small model to a big one's pace (SmolLM2's inter-token
latency was 4x its own beside Qwen2.5-0.5B on the CPU); shared time gives
each model's latency a bound near 2x with two models busy. Models without
requests are looked at every turn (their commands, a new request's first
step), and the jobs the model set gives it (loading a model in stages,
unloading one) run between turns. It sleeps while no model has work, until
a command to any of them (``Scheduler.attach``) or a job wakes it.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Generator
from concurrent.futures import Future
from typing import Callable, Optional

import mlx.core as mx

from ..runtime import mlx_lm_adapter
from .scheduler import Scheduler

log = logging.getLogger("mlx_lm_server.serving.device_loop")


class DeviceLoop:
    def __init__(self, on_round: Optional[Callable[[], None]] = None):
        self.wake = threading.Event()
        self.schedulers: dict[str, Scheduler] = {}
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._running: list[tuple] = []  # (generator, future): jobs in steps
        self.used: dict[str, float] = {}  # seconds of ticks per model, while it had work
        self._was_busy: set = set()
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
        self.used[name] = 0.0

    def remove(self, name: str) -> None:
        """Stop stepping a model (on the loop's thread): its batch closes."""
        scheduler = self.schedulers.pop(name, None)
        self.used.pop(name, None)
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
            busy = self._turn()
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

    def _turn(self) -> bool:
        """Idle models' commands, then one step of the busy model that has
        used the least time; whether any model has work."""
        for name, scheduler in list(self.schedulers.items()):
            if not scheduler.has_sequences:
                self._tick(name, scheduler)
        busy = [n for n, s in self.schedulers.items() if s.has_sequences]
        working = [n for n in busy if n in self._was_busy]
        if working:  # a model that started work: level with the least served
            floor = min(self.used[n] for n in working)
            for name in busy:
                if name not in self._was_busy:
                    self.used[name] = max(self.used[name], floor)
        self._was_busy = set(busy)
        if busy:
            name = min(busy, key=lambda n: self.used[n])
            if name in self.schedulers:
                self._tick(name, self.schedulers[name], finish=len(busy) > 1)
        return any(s.has_sequences for s in self.schedulers.values())

    def _tick(self, name: str, scheduler: Scheduler, finish: bool = False) -> None:
        """One tick, timed; ``finish``: wait for the work it queued, so that
        its time is its own (a step launches its forward and returns: the
        next model's step would wait for it and be charged for it)."""
        tic = time.perf_counter()
        if not scheduler.tick(block=False):
            self.remove(name)
            return
        if finish:
            mx.synchronize(mlx_lm_adapter.generation_stream())
        if scheduler.has_sequences:
            self.used[name] = self.used.get(name, 0.0) + time.perf_counter() - tic

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
