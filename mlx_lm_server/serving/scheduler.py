"""The inference thread: admission and the step loop.

HTTP handlers never touch MLX: they ``submit`` a request and read its events
from an asyncio queue (``request.py``). The thread takes new requests and
cancellations between steps (``intake.py``), so sequences join and leave the
running batch (``batch.py``) continuously; each step's tokens become text
events (``request_output.py``). In tensor parallel, rank 0 shares its joins,
leaves and steps as plans that the other ranks follow
(``parallel/follower.py``).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from functools import partial
from typing import Callable, Optional

import mlx.core as mx

from ..parallel.distributed import SOLO
from ..parallel.follower import follow, shared_seed, stop_followers
from ..spec_decode.metrics import SpecStats
from .batch import RunningBatch
from .intake import Intake
from .kv_budget import KVBudget, WaitingForMemory
from .memory import is_out_of_memory, memory_stats, release_idle_memory
from .request import ErrorEvent, GenerationRequest, RequestHandle
from .request_output import RequestOutput

log = logging.getLogger("mlx_lm_server.serving.scheduler")


class Scheduler:
    """Owns the inference thread and everything on it; the HTTP side calls
    only ``submit``, ``cancel``, ``shutdown`` and reads ``stats``."""

    def __init__(self, batch: RunningBatch, *, max_queued_requests: int = 256,
                 budget: Optional[KVBudget] = None, on_finish: Optional[Callable] = None,
                 recorder=None, link=SOLO, on_fatal: Optional[Callable[[str], None]] = None,
                 log_interval_s: float = 10.0):
        # The running batch (upstream's generator, the engine, the prompt
        # cache): built by the assembly, changed only by this thread.
        self.batch = batch
        self.engine = batch.engine
        self.prompt_cache = batch.prompt_cache
        # The commands from the HTTP side, and the counts both sides read.
        self.intake = Intake(max_queued_requests)
        # Finished requests with a grammar, and their tokens the grammar forced.
        self.structured_requests = self.forced_tokens = 0
        # What speculation is doing: the one object the metrics route,
        # Prometheus and the log line read.
        self.spec_stats = self.engine.stats if self.engine is not None else SpecStats()
        self.log_interval_s = log_interval_s
        self._last_log = time.monotonic()
        # Called as on_finish(prompt_tokens, completion_tokens, finish_reason,
        # ttft_s, e2e_s) for every request that completes (Prometheus).
        self.on_finish = on_finish
        # ``--record-traffic``: finished requests' token ids (``traffic.py``).
        self.recorder = recorder
        # Tensor parallel (``parallel/distributed.py``): rank 0 runs this
        # scheduler's ``_run`` and shares its joins, leaves and steps; the
        # others ``follow``.
        self.link = link
        self.distributed = link.size > 1
        self.busy = False  # inside a plan or a step (what the tensor-parallel watchdog times)
        self._begun = False  # calibrated: steps can run (see ``begin``)
        self.failed: Optional[str] = None  # why tensor parallel broke down
        # Called once with that reason (the server then exits non-zero).
        self.on_fatal = on_fatal

        self._thread = threading.Thread(target=self._run, name="inference", daemon=True)
        self._seqs: dict[int, RequestOutput] = {}
        self._by_handle: dict[int, int] = {}
        self._batch_counts = {"waiting": 0, "prefilling": 0, "decoding": 0}  # after each turn
        self.steps = 0
        # Bytes of KV cache for admitted requests (None: no budget); requests
        # that do not fit yet, or whose prefix is read from disk, wait here,
        # in order of arrival.
        self.budget = budget
        self._waiting = WaitingForMemory(budget, self.prompt_cache, self._seqs)
        self._stepped = False
        self.last_active = time.monotonic()  # the last step with sequences in it

    # ---- HTTP side -------------------------------------------------------

    def start(self) -> None:
        """Run on an inference thread of its own (one model per process)."""
        self._thread.start()

    def attach(self, wake: threading.Event) -> None:
        """Be stepped by a device loop (``tick``) that waits on ``wake``."""
        self.intake.attach(wake)

    @property
    def has_sequences(self) -> bool:
        """Requests in the batch: the next tick steps."""
        return bool(self._seqs)

    @property
    def idle(self) -> bool:
        """Nothing running, waiting or queued: it may be unloaded."""
        return not self._seqs and self.intake.idle

    def submit(self, request: GenerationRequest) -> RequestHandle:
        """Queue a request; raises ``QueueFullError`` or ``ShuttingDownError``."""
        handle = RequestHandle(request, asyncio.get_running_loop())
        self.intake.submit(handle, self._insert)
        return handle

    def cancel(self, handle: RequestHandle) -> None:
        """The client is gone: drop its sequence at the next step (idempotent)."""
        self.intake.put(partial(self._drop, handle))

    def shutdown(self) -> None:
        """End every request with an error event now; refuse new ones. Signal-safe."""
        self.intake.close_all(ErrorEvent("the server is shutting down", code="shutting_down"))
        self.intake.put(self._shut_down)

    def join(self, timeout: Optional[float] = None) -> None:
        self.intake.put(None)  # the inference thread ends
        if self._thread.is_alive():
            self._thread.join(timeout)
        if self.recorder is not None:
            self.recorder.close()

    @property
    def stopping(self) -> bool:
        return self.intake.stopping

    @property
    def starting(self) -> bool:
        """Not serving yet: speculation's start-up calibration runs (seconds;
        a request sent now waits for it)."""
        return not self._begun and self.failed is None

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def stats(self) -> dict:
        out = {
            "active": self.intake.num_active,
            "queued": self.intake.num_queued,
            "sequences": len(self._seqs),
            "batch": dict(self._batch_counts),
            "steps": self.steps,
            "memory": memory_stats(self.budget, self.prompt_cache, len(self._waiting)),
        }
        if self.distributed:
            out["tensor_parallel"] = self.link.status()
        if self.failed:
            out["error"] = self.failed
        return out

    # ---- inference thread ------------------------------------------------

    def _calibrate(self) -> None:
        if self.engine is not None:
            try:
                self.engine.calibrate(self.batch.max_batch_size)
            except Exception:  # a calibration failure costs only its figures
                if self.distributed:  # the ranks may no longer agree
                    raise
                log.exception("speculation cost calibration failed")

    def _run(self) -> None:
        if not self.begin():
            return
        while self.tick(block=not self._seqs):
            pass
        self.end()

    def begin(self) -> bool:
        """Before the first step (on the inference thread): calibration."""
        try:
            self._calibrate()
        except Exception as e:
            self.fail(f"calibration failed: {e.__class__.__name__}: {e}")
            return False
        self._begun = True
        return True

    def tick(self, block: bool = False) -> bool:
        """One turn of the inference loop: commands, admission, one step.
        False when the loop must stop (an exit command, or tensor parallel
        broken down). ``block``: wait for a command while there is no work."""
        try:
            if not self._handle_commands(block=block):
                return False
            self.busy = True
            self._waiting.admit(self._join)
            ops = self.batch.take_ops()
            if self.distributed:
                self.link.share_plan((ops, bool(self._seqs)))
            if self._seqs:
                self._step()
                self._stepped = True
                self.last_active = time.monotonic()
            if self._stepped and not self._seqs:  # finished or cancelled: now idle
                release_idle_memory()
                self._stepped = False
            self.busy = False
        except Exception as e:
            if self.distributed:  # the ranks may no longer agree: stop them all
                self.fail(f"{type(e).__name__}: {e}")
                return False
            # never let the inference thread die
            log.exception("unexpected error in the inference loop")
            self._fail_all("internal error in the inference loop")
        return True

    def end(self) -> None:
        """After the last step (on the inference thread): the other ranks
        stopped, the batch closed, MLX's queued work finished."""
        if self.failed:
            return
        if self.distributed:
            try:
                self.busy = True
                stop_followers(self.link)
            except Exception as e:
                return self.fail(f"stopping the other ranks failed: {e}")
        self.batch.close()
        # Pipelined decode leaves work queued on MLX's stream; finish it here,
        # not during interpreter teardown.
        mx.synchronize()

    def fail(self, reason: str) -> None:
        """Tensor parallel broke down: end every request with an error and
        tell the server to exit non-zero (no further collective is tried)."""
        log.error("tensor parallel stopped: %s", reason)
        self.failed = reason
        self.intake.close_all(ErrorEvent(f"tensor parallel stopped: {reason}",
                                         code="distributed_failure"))
        if self.on_fatal is not None:
            self.on_fatal(reason)

    def follow(self) -> None:
        """A follower's inference loop (ranks other than 0, see ``parallel/follower.py``)."""
        follow(self.batch, self.link, self._calibrate, release_idle_memory)

    def _handle_commands(self, block: bool) -> bool:
        """Apply queued submits, cancels and shutdowns; False when the thread must exit."""
        commands = self.intake.take(block)
        if not commands:
            return True
        for command in commands:
            if command is None:  # from ``join``
                return False
            command()
        self._batch_counts = self.batch.counts()
        return True

    def _shut_down(self) -> None:
        """End what the batch holds and what waits for memory (their streams have ended)."""
        self._fail_all("the server is shutting down", code="shutting_down")
        for waiting in self._waiting.take_all():
            self.intake.refuse(waiting, ErrorEvent("the server is shutting down",
                                                   code="shutting_down"))

    def _insert(self, handle: RequestHandle) -> None:
        req = handle.request
        if self.intake.stopping:
            self.intake.refuse(handle, ErrorEvent("the server is shutting down",
                                                  code="shutting_down"))
            return
        if self.distributed:
            req.sampling = shared_seed(req.sampling)
        if self.budget is not None:
            problem = self.budget.refusal(len(req.prompt_tokens), req.max_tokens)
            if problem is not None:  # Service.prepare refuses these first (a 400)
                self.intake.refuse(handle, ErrorEvent(problem, type="invalid_request_error",
                                                      code="kv_memory_exceeded"))
                return
        self._waiting.add(handle)  # admitted in order, as memory frees and disk reads finish

    def _join(self, handle: RequestHandle) -> None:
        req = handle.request
        try:
            uid, cached, constraint = self.batch.join(req)
        except Exception as e:
            log.exception("could not insert a request")
            self.intake.refuse(handle, ErrorEvent(f"could not start generation: {e}"))
            return
        self._seqs[uid] = RequestOutput(handle, uid, self.batch.tokenizer, cached, constraint,
                                        speculating=self.engine is not None,
                                        keep_ids=self.recorder is not None)
        self._by_handle[id(handle)] = uid
        if self.budget is not None:
            self.budget.reserve(uid, self.budget.length(len(req.prompt_tokens), req.max_tokens))

    def _release(self, seq: RequestOutput) -> None:
        """Forget a sequence (already out of the batch)."""
        self._seqs.pop(seq.uid, None)
        self._by_handle.pop(id(seq.handle), None)
        self.intake.finished(seq.handle, seq.started)
        if self.budget is not None:
            self.budget.release(seq.uid)

    def _drop(self, handle: RequestHandle) -> None:
        uid = self._by_handle.get(id(handle))
        if uid is None:
            waiting = self._waiting.take(id(handle))
            if waiting is not None:
                self.intake.refuse(waiting, None)
            return
        self.batch.leave([uid], store=False)
        self._release(self._seqs[uid])

    def _fail_all(self, message: str, code: Optional[str] = None) -> None:
        for seq in list(self._seqs.values()):
            seq.handle.post(ErrorEvent(message, code=code))
            if self.distributed:  # every rank drops it; the generator stays
                self.batch.leave([seq.uid], store=False)
            self._release(seq)
        if not self.distributed:
            # The generator may be mid-step and inconsistent: start afresh.
            self.batch.reset()
        self._batch_counts = self.batch.counts()

    def _step(self) -> None:
        try:
            responses = self.batch.step()
        except Exception as e:
            if self.distributed:
                raise
            log.exception("generation step failed")
            if is_out_of_memory(e):
                self._fail_all(f"out of memory during generation ({e}); the requests in "
                               "flight were ended, the server keeps serving (a lower "
                               "--max-kv-memory leaves more room)", code="out_of_memory")
            else:
                self._fail_all(f"generation failed: {type(e).__name__}: {e}")
            return  # now idle: _run gives the memory back
        self.steps += 1
        if self.distributed:
            self.link.fold_tokens([(r.uid, r.token) for r in responses])
        finished, emitted = [], 0
        for r in responses:
            if r.finish_reason is not None:  # upstream already removed it
                self.batch.finished(r)
            seq = self._seqs.get(r.uid)
            if seq is None:
                continue
            emitted += 1
            drafted = (getattr(r, "draft_position", None), getattr(r, "num_drafted", 0),
                       getattr(r, "proposer", None))
            seq.spec.observe(*drafted)
            self.spec_stats.tokens.observe(*drafted)
            try:
                done = self._emit(seq, r.token, r.logprobs, r.finish_reason)
            except Exception as e:
                log.exception("failed to emit a token")
                seq.handle.post(ErrorEvent(f"generation failed: {type(e).__name__}: {e}"))
                done = True
            if done:
                if r.finish_reason is None:
                    finished.append(r.uid)
                self._release(seq)
        if finished:
            self.batch.leave(finished, store=True)
        self._batch_counts = self.batch.counts()
        self.spec_stats.throughput.add(emitted)
        self._maybe_log()

    def _maybe_log(self) -> None:
        now = time.monotonic()
        if self.engine is None or now - self._last_log < self.log_interval_s:
            return
        self._last_log = now
        log.info(self.spec_stats.log_line(now))

    def _emit(self, seq: RequestOutput, token: int, logprobs: mx.array,
              finish: Optional[str]) -> bool:
        """Turn one generated token into events; True when the request is done."""
        if not seq.started:
            seq.first_token_at = time.monotonic()
            seq.started = True
            self.intake.started()
        finish = seq.add(token, logprobs, finish)
        if finish is None:
            return False
        if seq.constraint is not None:
            self.structured_requests += 1
            self.forced_tokens += seq.constraint.forced
        if self.on_finish is not None:
            submitted = seq.handle.submitted_at
            self.on_finish(len(seq.handle.request.prompt_tokens), seq.completion_tokens, finish,
                           seq.first_token_at - submitted, time.monotonic() - submitted)
        if self.recorder is not None:
            self.recorder.record(seq.handle.request.prompt_tokens, seq.token_ids, finish)
        return True

