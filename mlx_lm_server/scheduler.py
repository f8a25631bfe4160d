"""One inference thread that owns the model and upstream's ``BatchGenerator``.

HTTP handlers never touch MLX: they ``submit`` a request and read events from
an asyncio queue. The thread takes new requests and cancellations between
decode steps, so sequences join and leave the running batch continuously, and
turns generated tokens into UTF-8-safe text deltas with stop strings applied.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import queue
import secrets
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any, Optional, Union

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, StopSequences

from .distributed import SOLO, STOP, LockstepError
from .sampling import SamplingParams, make_processors, make_sampler
from .output import find_stop, held_back
from .requests import DoneEvent, ErrorEvent, GenerationRequest, RequestHandle, TextEvent
from .spec_decode.metrics import SpecCounts, Throughput, log_line
from .structured import Constraint, GrammarProcessor, GrammarTokenizer, logits_width
from .upstream import next_within_cap, sequences_in_generator

log = logging.getLogger("mlx_lm_server.scheduler")


@dataclass
class _Sequence:
    """Inference-thread state of one request."""

    handle: RequestHandle
    uid: int
    detokenizer: Any
    started: bool = False
    completion_tokens: int = 0
    text: str = ""
    sent: int = 0
    unsent_ids: list[int] = field(default_factory=list)
    spec: SpecCounts = field(default_factory=SpecCounts)
    first_token_at: Optional[float] = None
    cached_tokens: int = 0
    constraint: Optional[Constraint] = None


def release_idle_memory() -> None:
    """Give MLX's buffer cache back to the system once no request is left.

    A burst of requests grows the cache by the batch's activations and KV
    (several hundred MB for a small model); an idle server should not keep
    holding it. The next request allocates afresh, a cost far below a step's.
    On Linux (the CPU and CUDA backends) glibc keeps freed pages mapped until
    it is asked to trim them.
    """
    mx.clear_cache()
    if _malloc_trim is not None:
        _malloc_trim(0)


def _find_malloc_trim():
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc (macOS, musl)
        return None


_malloc_trim = _find_malloc_trim()


class Scheduler:
    def __init__(
        self,
        model,
        tokenizer,
        *,
        max_batch_size: int = 32,
        prefill_batch_size: int = 8,
        prefill_step_size: int = 2048,
        max_queued_requests: int = 256,
        engine=None,
        spec_mode: str = "none",
        log_interval_s: float = 10.0,
        prompt_cache=None,
        grammar_tokenizer: Optional[GrammarTokenizer] = None,
        link=SOLO,
    ):
        self.model = model
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.prefill_batch_size = prefill_batch_size
        self.prefill_step_size = prefill_step_size
        self.max_queued_requests = max_queued_requests
        # A SpecDecodeEngine replaces upstream's decode step when given.
        self.engine = engine
        self.spec_mode = spec_mode if engine is not None else "none"
        # A PromptCache: finished sequences' caches, reused by later prompts.
        self.prompt_cache = prompt_cache
        if engine is not None:
            engine.keep_finished_caches = prompt_cache is not None
        # llguidance's tokenizer, for requests with a grammar.
        self.grammar_tokenizer = grammar_tokenizer or GrammarTokenizer(
            tokenizer, logits_width(model, tokenizer))
        # Finished requests with a grammar, their tokens, and those forced.
        self.structured_requests = self.structured_tokens = self.forced_tokens = 0
        self.spec_counts = SpecCounts()
        self.throughput = Throughput()
        self.log_interval_s = log_interval_s
        self._last_log = time.monotonic()
        # Called as on_finish(prompt_tokens, completion_tokens, finish_reason,
        # ttft_s, e2e_s) for every request that completes (Prometheus).
        self.on_finish = None
        # Tensor parallel (``distributed.py``): rank 0 runs this scheduler's
        # ``_run`` and shares what changes the generator; the others ``follow``.
        self.link = link
        self._ops: list = []  # generator changes since the last shared plan
        self._busy = False  # inside a plan or a step (the watchdog's concern)
        self.failed: Optional[str] = None  # why tensor parallel broke down
        # Called once with that reason (the server then exits non-zero).
        self.on_fatal = None
        self._eos_stops = StopSequences([[t] for t in sorted(tokenizer.eos_token_ids)])

        self._commands: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._num_queued = 0  # submitted, no token yet
        self._num_active = 0  # producing tokens
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="inference", daemon=True)
        self._seqs: dict[int, _Sequence] = {}
        self._by_handle: dict[int, int] = {}
        # Every request not finished yet, for a shutdown that cannot wait for
        # the inference thread (it may be inside a long prefill step).
        self._open_handles: set[RequestHandle] = set()
        self._gen: Optional[BatchGenerator] = None
        self._batch_counts = {"waiting": 0, "prefilling": 0, "decoding": 0}
        self.steps = 0

    # ---- HTTP side -------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def submit(self, request: GenerationRequest) -> RequestHandle:
        """Queue a request; raises ``QueueFullError`` or ``ShuttingDownError``."""
        handle = RequestHandle(request, asyncio.get_running_loop())
        with self._lock:
            if self._stopping:
                raise ShuttingDownError("the server is shutting down")
            if self._num_queued >= self.max_queued_requests:
                raise QueueFullError(
                    f"too many queued requests ({self._num_queued}); retry later"
                )
            self._num_queued += 1
            self._open_handles.add(handle)
        self._commands.put(("submit", handle))
        return handle

    def cancel(self, handle: RequestHandle) -> None:
        """The client is gone: drop its sequence at the next step (idempotent)."""
        self._commands.put(("cancel", handle))

    def shutdown(self) -> None:
        """End every request with an error event now; refuse new ones. Signal-safe."""
        with self._lock:
            self._stopping = True
            handles = list(self._open_handles)
        for h in handles:
            h.close(ErrorEvent("the server is shutting down", code="shutting_down"))
        self._commands.put(("shutdown", None))

    def join(self, timeout: Optional[float] = None) -> None:
        self._commands.put(("exit", None))
        self._thread.join(timeout)

    @property
    def stopping(self) -> bool:
        return self._stopping

    @property
    def busy(self) -> bool:
        """Inside a plan or a step (what the tensor-parallel watchdog times)."""
        return self._busy

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def stats(self) -> dict:
        out = {
            "active": self._num_active,
            "queued": self._num_queued,
            "sequences": len(self._seqs),
            "batch": dict(self._batch_counts),
            "steps": self.steps,
        }
        if self.distributed:
            out["tensor_parallel"] = self.link.status()
        if self.failed:
            out["error"] = self.failed
        return out

    @property
    def distributed(self) -> bool:
        return self.link.size > 1

    # ---- inference thread ------------------------------------------------

    def _new_generator(self) -> BatchGenerator:
        gen = BatchGenerator(
            self.model,
            completion_batch_size=self.max_batch_size,
            # Upstream decodes max(completion, prefill batch size) at once:
            # a prefill batch above the cap would lift it.
            prefill_batch_size=min(self.prefill_batch_size, self.max_batch_size),
            prefill_step_size=self.prefill_step_size,
        )
        if self.engine is not None:
            self.engine.install(gen)
        return gen

    def _calibrate(self) -> None:
        if self.engine is not None:
            try:
                self.engine.calibrate(self.max_batch_size)
            except Exception:  # a calibration failure costs only its figures
                if self.distributed:  # the ranks may no longer agree
                    raise
                log.exception("speculation cost calibration failed")

    def _run(self) -> None:
        self._gen = self._new_generator()
        try:
            self._calibrate()
        except Exception as e:
            return self.fail(f"calibration failed: {type(e).__name__}: {e}")
        stepped = False
        while True:
            try:
                if not self._handle_commands(block=not self._seqs):
                    break
                self._busy = True
                if self.distributed:
                    self.link.share_plan((self._ops, bool(self._seqs)))
                    self._ops = []
                if self._seqs:
                    self._step()
                    stepped = True
                if stepped and not self._seqs:  # finished or cancelled: now idle
                    release_idle_memory()
                    stepped = False
                self._busy = False
            except Exception as e:
                if self.distributed:  # the ranks may no longer agree: stop them all
                    return self.fail(f"{type(e).__name__}: {e}")
                # never let the inference thread die
                log.exception("unexpected error in the inference loop")
                self._fail_all("internal error in the inference loop")
        if self.distributed:
            try:
                self._busy = True
                self.link.closing = True
                self.link.share_plan(STOP)
                self.link.barrier()  # no rank leaves while another still needs it
            except Exception as e:
                return self.fail(f"stopping the other ranks failed: {e}")
        self._gen.close()
        # Pipelined decode leaves work queued on MLX's stream; finish it here,
        # not during interpreter teardown.
        mx.synchronize()

    def fail(self, reason: str) -> None:
        """Tensor parallel broke down: end every request with an error and
        tell the server to exit non-zero (no further collective is tried)."""
        log.error("tensor parallel stopped: %s", reason)
        with self._lock:
            self._stopping = True
            self.failed = reason
            handles = list(self._open_handles)
        for h in handles:
            h.close(ErrorEvent(f"tensor parallel stopped: {reason}", code="distributed_failure"))
        if self.on_fatal is not None:
            self.on_fatal(reason)

    # ---- a tensor-parallel follower --------------------------------------

    def follow(self) -> None:
        """A follower's inference loop (on ranks other than 0): execute rank
        0's plans until its stop plan. Raises on any failure; the caller exits."""
        self._gen = self._new_generator()
        self._calibrate()
        while True:
            plan = self.link.share_plan()
            if plan == STOP:
                self.link.closing = True
                self.link.barrier()
                break
            ops, step = plan
            for op in ops:
                self._apply(op)
            if step:
                self._follow_step()
            if (step or ops) and not self._seqs:
                release_idle_memory()
        self._gen.close()
        mx.synchronize()

    def _apply(self, op: tuple) -> None:
        if op[0] == "join":
            _, uid, cached, request = op
            got, got_cached, _ = self._start(request)
            if (got, got_cached) != (uid, cached):
                raise LockstepError(f"plan {self.link.plans}: rank 0 started request {uid} "
                                    f"with {cached} cached tokens, this rank {got} with "
                                    f"{got_cached}")
        else:
            _, uids, store = op
            self._end(uids, store)
            if self.engine is not None:
                for uid in uids:
                    self.engine.remove_sequence(uid)

    def _follow_step(self) -> None:
        _, responses = next_within_cap(self._gen)
        self.steps += 1
        self.link.fold_tokens([(r.uid, r.token) for r in responses])
        for r in responses:
            if r.finish_reason is not None:  # upstream removed it
                if self.prompt_cache is not None:
                    self.prompt_cache.store(r.all_tokens, r.prompt_cache)
                if self.engine is not None:
                    self.engine.remove_sequence(r.uid)

    def _handle_commands(self, block: bool) -> bool:
        """Apply queued submits/cancels; False when the thread must exit."""
        try:
            commands = [self._commands.get(timeout=0.5) if block else self._commands.get_nowait()]
        except queue.Empty:
            return True
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                break
        for kind, handle in commands:
            if kind == "submit":
                self._insert(handle)
            elif kind == "cancel":
                self._drop(id(handle))
            elif kind == "shutdown":
                self._fail_all("the server is shutting down", code="shutting_down")
            elif kind == "exit":
                return False
        self._refresh_counts()
        return True

    def _insert(self, handle: RequestHandle) -> None:
        req = handle.request
        if self._stopping:
            self._finish_queued()
            self._forget_handle(handle)
            handle.close(ErrorEvent("the server is shutting down", code="shutting_down"))
            return
        if self.distributed and not req.sampling.greedy and req.sampling.seed is None:
            # Every rank samples this request's plain steps itself: with one key.
            req.sampling = replace(req.sampling, seed=secrets.randbelow(1 << 31))
        try:
            uid, cached, constraint = self._start(req)
        except Exception as e:
            log.exception("could not insert a request")
            self._finish_queued()
            self._forget_handle(handle)
            handle.close(ErrorEvent(f"could not start generation: {e}"))
            return
        self._seqs[uid] = _Sequence(handle, uid, self.tokenizer.detokenizer, cached_tokens=cached,
                                    constraint=constraint)
        self._by_handle[id(handle)] = uid
        if self.distributed:
            self._ops.append(("join", uid, cached, req))

    def _start(self, req: GenerationRequest) -> tuple:
        """Put ``req`` into the generator (and the engine): (uid, prompt
        tokens taken from the prompt cache, its grammar's Constraint or None)."""
        processors, constraint = make_processors(req.sampling), None
        if req.grammar is not None:
            constraint = Constraint(self.grammar_tokenizer, req.grammar, len(req.prompt_tokens))
            processors.append(GrammarProcessor(constraint))
        cache, cached = None, 0
        if self.prompt_cache is not None:
            cache, cached = self.prompt_cache.fetch(req.prompt_tokens)
        (uid,) = self._gen.insert(
            [req.prompt_tokens[cached:]],
            max_tokens=[req.max_tokens],
            caches=[cache],
            all_tokens=[req.prompt_tokens[:cached]],
            samplers=[make_sampler(req.sampling)],
            logits_processors=[processors],
            stop_sequences=[self._eos_stops],
        )
        if self.engine is not None:
            self.engine.add_sequence(uid, req.sampling, len(req.prompt_tokens),
                                     logprobs=req.top_logprobs is not None,
                                     max_k=req.max_draft_tokens,
                                     constrained=constraint is not None)
        return uid, cached, constraint

    def _end(self, uids: list, store: bool) -> None:
        """Take ``uids`` out of the generator, their caches into the prompt
        cache when ``store`` (finished, not cancelled)."""
        if store and self.prompt_cache is not None:
            for cache, tokens in self._gen.extract_cache(uids).values():
                self.prompt_cache.store(tokens, cache)
        self._gen.remove(uids)
        if self.distributed:
            self._ops.append(("leave", list(uids), store))

    def _finish_queued(self) -> None:
        with self._lock:
            self._num_queued -= 1

    def _forget_handle(self, handle: RequestHandle) -> None:
        with self._lock:
            self._open_handles.discard(handle)

    def _release(self, seq: _Sequence) -> None:
        """Forget a sequence (already out of the generator)."""
        self._seqs.pop(seq.uid, None)
        self._by_handle.pop(id(seq.handle), None)
        self._forget_handle(seq.handle)
        if self.engine is not None:
            self.engine.remove_sequence(seq.uid)
        if seq.started:
            self._num_active -= 1
        else:
            self._finish_queued()

    def _drop(self, handle_id: int) -> None:
        uid = self._by_handle.get(handle_id)
        if uid is None:
            return
        self._end([uid], store=False)
        self._release(self._seqs[uid])

    def _fail_all(self, message: str, code: Optional[str] = None) -> None:
        for seq in list(self._seqs.values()):
            seq.handle.post(ErrorEvent(message, code=code))
            if self.distributed:  # every rank drops it; the generator stays
                self._end([seq.uid], store=False)
            self._release(seq)
        if self.distributed:
            self._refresh_counts()
            return
        # The generator may be mid-step and inconsistent: start afresh.
        try:
            self._gen.close()
        except Exception:
            pass
        self._gen = self._new_generator()
        self._refresh_counts()

    def _refresh_counts(self) -> None:
        self._batch_counts = sequences_in_generator(self._gen)

    def _step(self) -> None:
        try:
            _, responses = next_within_cap(self._gen)
        except Exception as e:
            if self.distributed:
                raise
            log.exception("generation step failed")
            self._fail_all(f"generation failed: {type(e).__name__}: {e}")
            return
        self.steps += 1
        if self.distributed:
            self.link.fold_tokens([(r.uid, r.token) for r in responses])
        finished = []
        emitted = 0
        for r in responses:
            seq = self._seqs.get(r.uid)
            if seq is None:
                continue
            emitted += 1
            draft_position = getattr(r, "draft_position", None)
            num_drafted = getattr(r, "num_drafted", 0)
            seq.spec.observe(draft_position, num_drafted)
            self.spec_counts.observe(draft_position, num_drafted)
            try:
                done = self._emit(seq, r.token, r.logprobs, r.finish_reason)
            except Exception as e:
                log.exception("failed to emit a token")
                seq.handle.post(ErrorEvent(f"generation failed: {type(e).__name__}: {e}"))
                done = True
            if done:
                # Upstream already dropped sequences it finished itself.
                if r.finish_reason is None:
                    finished.append(r.uid)
                elif self.prompt_cache is not None:
                    self.prompt_cache.store(r.all_tokens, r.prompt_cache)
                self._release(seq)
        if finished:
            self._end(finished, store=True)
        self._refresh_counts()
        self.throughput.add(emitted)
        self._maybe_log()

    def _maybe_log(self) -> None:
        now = time.monotonic()
        if self.engine is None or now - self._last_log < self.log_interval_s:
            return
        self._last_log = now
        log.info(log_line(self.spec_counts, self.engine, self.throughput.rate(now)))

    def _emit(self, seq: _Sequence, token: int, logprobs: mx.array, finish: Optional[str]) -> bool:
        """Turn one generated token into events; True when the request is done."""
        req = seq.handle.request
        if not seq.started:
            seq.first_token_at = time.monotonic()
            seq.started = True
            self._finish_queued()
            self._num_active += 1
        seq.completion_tokens += 1
        seq.unsent_ids.append(token)
        is_eos = finish == "stop"  # upstream's only stop sequences are EOS tokens
        if not is_eos:
            seq.detokenizer.add_token(token)
        if finish is not None:
            seq.detokenizer.finalize()
        seq.text += seq.detokenizer.last_segment

        entries = None
        if req.top_logprobs is not None and not is_eos:
            entries = [self._logprob_entry(token, logprobs, req.top_logprobs)]

        stop_at = find_stop(seq.text, seq.sent, req.stop) if req.stop else -1
        if stop_at >= 0:
            end, finish = stop_at, "stop"
        elif finish is not None:
            end = len(seq.text)
        else:
            end = len(seq.text) - held_back(seq.text[seq.sent:], req.stop)
        if end > seq.sent or entries or finish is not None:
            seq.handle.post(TextEvent(seq.text[seq.sent:end], entries, seq.unsent_ids))
            seq.unsent_ids = []
            seq.sent = max(seq.sent, end)
        if finish is None:
            return False
        usage = seq.spec.usage() if self.engine is not None else None
        if usage is not None and not req.sampling.speculable:
            usage["disabled_by"] = "xtc_probability"  # see SamplingParams.speculable
        forced = None
        if seq.constraint is not None:
            forced = seq.constraint.forced
            self.structured_requests += 1
            self.structured_tokens += seq.completion_tokens
            self.forced_tokens += forced
        seq.handle.post(DoneEvent(finish, len(req.prompt_tokens), seq.completion_tokens, usage,
                                  seq.cached_tokens, forced))
        if self.on_finish is not None:
            now = time.monotonic()
            self.on_finish(len(req.prompt_tokens), seq.completion_tokens, finish,
                           seq.first_token_at - seq.handle.submitted_at,
                           now - seq.handle.submitted_at)
        return True

    def _logprob_entry(self, token: int, logprobs: mx.array, top_n: int) -> dict:
        entry = {"token": self.tokenizer.decode([token]), "logprob": logprobs[token].item(), "top": []}
        if top_n > 0:
            top = mx.argpartition(-logprobs, kth=top_n - 1)[:top_n]
            values = logprobs[top]
            order = mx.argsort(-values)
            ids, vals = top[order].tolist(), values[order].tolist()
            # A grammar leaves fewer than top_n possible tokens: no -inf entries.
            entry["top"] = [
                {"token": self.tokenizer.decode([i]), "logprob": v}
                for i, v in zip(ids, vals) if v != float("-inf")
            ]
        return entry
