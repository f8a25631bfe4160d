"""Tensor and pipeline parallel across processes: rank 0 decides, the other
ranks execute.

Every rank holds a shard of every layer (upstream's ``model.shard``) or,
with ``--pipeline``, a run of consecutive layers (upstream's
``model.model.pipeline``), and runs the same forward passes, joined by the
model's own collectives (all-reduces, or sends from stage to stage and a
final all-gather). Everything below holds for either split. Rank 0 alone serves
HTTP. Before each step it shares one small *plan*: the requests joining
(prompt ids, sampling parameters with a seed it chose, grammar) and leaving
(cancelled, finished) in the order it applied them, and whether it steps.
Inside a speculative step it shares the drafts and their count per row, and,
after verifying, the kept tokens and counts per row. So no follower consults
its own clock, random state, controller or proposer: the draft model and the
n-gram index live on rank 0 only. Plain steps need no plan: every rank samples
the same token from the same all-reduced logits with the same seeded key, as
upstream's distributed server does.

On the wire one plan is a pickle in a fixed 4 KiB all-sum (followers add
zeros), plus one more all-sum of exactly the overflow when a plan is bigger
(a joining prompt of more than about 1,000 tokens). A verify step at B=32,
k=16 shares about 2.5 KiB before the pass and 2.5 KiB after it. Every
collective runs on upstream's generation stream, so that plans and the
model's own all-reduces keep one order on every rank.

Each rank folds every plan it executed and every token it emitted into a
running CRC-32; every ``CHECK_EVERY`` plans the ranks compare them, and a
mismatch stops every rank with an error naming the step.

At rest the ranks sleep. A collective waits by spinning, so after an idle
plan (nothing joins or leaves, no step) rank 0 shares no further idle plan,
and before its next plan it rings a doorbell on the heartbeat's TCP
connection; a follower whose last plan was idle sleeps on that ring before
it enters the collective. Both sides know when from the plans they shared.
"""

from __future__ import annotations

import json
import logging
import pickle
import time
import zlib
from pathlib import Path
from typing import Callable, Optional

import mlx.core as mx
import numpy as np

from ..runtime import mlx_lm_adapter

log = logging.getLogger("mlx_lm_server.parallel.distributed")

HEADER_BYTES = 4096
CHECK_EVERY = 64  # plans between two lock-step comparisons
STOP = "stop"  # the plan that ends every follower
RING = b"!"  # on the heartbeat connection, rank 0 to a follower: a plan follows


class LockstepError(RuntimeError):
    """The ranks executed different plans or emitted different tokens."""


class Solo:
    """A single process: every decision is local, nothing is shared."""

    leader = True
    size = 1
    rank = 0

    def decide(self, fn: Callable):
        return fn()

    def fold_tokens(self, pairs) -> None:
        pass

    def status(self) -> Optional[dict]:
        return None


SOLO = Solo()


class Link:
    """Rank 0's decisions on every rank, and the running lock-step check."""

    def __init__(self, group, check_every: int = CHECK_EVERY, split: str = "tensor"):
        self.group = group
        self.split = split  # how the model is split: "tensor" (sharded layers) or "pipeline"
        self.rank = group.rank()
        self.size = group.size()
        self.leader = self.rank == 0
        self.check_every = check_every
        self.plans = 0  # plans executed (shared), the step count the checks name
        self.checksum = 0
        self.checked_at = 0  # plan count of the last comparison that agreed
        self.bytes_shared = 0
        self.seconds_shared = 0.0  # includes waiting for the slowest rank's pass
        self.fastest_share = float("inf")  # the wire's own cost, near enough
        self.last_progress = time.monotonic()
        self.closing = False  # a clean stop is under way: peers leaving is expected
        self.doorbell = None  # a liveness.Heartbeat, once it connects
        self.resting = True  # the last plan was idle (or none yet): followers sleep

    # ---- the wire ----------------------------------------------------------

    def _all_sum(self, data: np.ndarray) -> np.ndarray:
        with mx.stream(mlx_lm_adapter.generation_stream()):
            out = mx.distributed.all_sum(mx.array(data), group=self.group)
            mx.eval(out)
        return np.array(out, copy=False)

    def share(self, obj=None):
        """Rank 0's ``obj`` on every rank (the argument of the others is ignored)."""
        tic = time.perf_counter()
        head = np.zeros(HEADER_BYTES, np.uint8)
        data = b""
        if self.leader:
            data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
            head[:8] = np.frombuffer(len(data).to_bytes(8, "little"), np.uint8)
            first = data[: HEADER_BYTES - 8]
            head[8: 8 + len(first)] = np.frombuffer(first, np.uint8)
        head = self._all_sum(head)
        n = int.from_bytes(head[:8].tobytes(), "little")
        if n > HEADER_BYTES - 8:
            rest = np.zeros(n - (HEADER_BYTES - 8), np.uint8)
            if self.leader:
                rest[:] = np.frombuffer(data[HEADER_BYTES - 8:], np.uint8)
            rest = self._all_sum(rest)
            payload = head[8:].tobytes() + rest.tobytes()
        else:
            payload = head[8: 8 + n].tobytes()
        self.checksum = zlib.crc32(payload, self.checksum)
        self.bytes_shared += max(n + 8, HEADER_BYTES)
        took = time.perf_counter() - tic
        self.seconds_shared += took
        self.fastest_share = min(self.fastest_share, took)
        self.last_progress = time.monotonic()
        return obj if self.leader else pickle.loads(payload)

    def decide(self, fn: Callable):
        """``fn()`` on rank 0, its result on every rank; followers never call ``fn``."""
        return self.share(fn() if self.leader else None)

    def barrier(self) -> None:
        self._all_sum(np.ones(1, np.int32))

    # ---- lock-step -----------------------------------------------------------

    def fold_tokens(self, pairs) -> None:
        """Fold the (uid, token) pairs a step emitted into the checksum."""
        if pairs:
            self.checksum = zlib.crc32(np.asarray(pairs, np.int64).tobytes(), self.checksum)
        self.last_progress = time.monotonic()

    def share_plan(self, plan=None):
        """The step plan (see the module's docstring), compared across ranks
        every ``check_every`` plans; raises ``LockstepError`` on a mismatch.

        With a doorbell, an idle plan after an idle plan is not shared (rank
        0 gets it back), and the first plan after one is rung for."""
        if self.doorbell is not None and self.resting:
            if self.leader:
                if is_idle(plan):
                    return plan
                self.doorbell.ring()
            else:
                self.doorbell.wait()
        plan = self.share(plan)
        self.resting = is_idle(plan)
        self.plans += 1
        if self.plans % self.check_every == 0:
            self.check()
        return plan

    def check(self) -> None:
        mine = np.zeros(self.size, np.int64)
        mine[self.rank] = self.checksum
        every = self._all_sum(mine)
        if len(set(every.tolist())) > 1:
            raise LockstepError(f"ranks diverged by plan {self.plans}: checksums "
                                + ", ".join(f"rank {r} {c:08x}" for r, c in enumerate(every)))
        self.checked_at = self.plans
        log.info("lock-step ok at plan %d: checksum %08x on %d ranks (%.1f KiB shared, "
                 "%.2f ms per plan)", self.plans, self.checksum, self.size,
                 self.bytes_shared / 1024, 1e3 * self.seconds_shared / max(self.plans, 1))

    def status(self) -> dict:
        return {"rank": self.rank, "ranks": self.size, "split": self.split, "plans": self.plans,
                "checksum": f"{self.checksum:08x}", "checked_at": self.checked_at,
                "bytes_per_plan": round(self.bytes_shared / max(self.plans, 1)),
                "ms_per_plan": round(1e3 * self.seconds_shared / max(self.plans, 1), 3),
                "fastest_share_ms": round(1e3 * self.fastest_share, 3)
                if self.plans else None}


def is_idle(plan) -> bool:
    """A step plan ``(ops, step)`` with nothing to do: no op, no step."""
    return isinstance(plan, tuple) and not plan[0] and not plan[1]


def world():
    """The process group ``mlx.launch`` (or ``MLX_RANK``/``MLX_HOSTFILE``) set
    up; a group of one when started alone."""
    return mx.distributed.init()


def split_problem(model_path: str, size: int) -> Optional[str]:
    """Why the model in ``model_path`` cannot be split over ``size`` ranks, or None."""
    config = json.loads((Path(model_path) / "config.json").read_text())
    config = {**config.get("text_config", {}), **{k: v for k, v in config.items()
                                                 if k != "text_config"}}
    name = Path(model_path.rstrip("/")).name
    counts = {k: config[k] for k in ("num_attention_heads", "num_key_value_heads",
                                     "intermediate_size") if isinstance(config.get(k), int)}
    bad = {k: v for k, v in counts.items() if v % size}
    if bad:
        return (f"{name} cannot be split over {size} ranks: "
                + ", ".join(f"{k} = {v}" for k, v in counts.items())
                + f" must each be divisible by {size}")
    return None


def load_pipelined(model_path: str, group):
    """The model (this rank's consecutive layers, upstream's ``pipeline``)
    and tokenizer. Raises ``ValueError`` for a model class without a
    pipeline split, or with fewer layers than ranks.

    Rank 0 holds the last layers and the last rank the first; every rank
    keeps the embeddings, final norm and head. Each forward passes the
    hidden state from stage to stage and ends in an all-gather of rank 0's
    output, so every rank samples from the same logits, bit for bit. The
    weights load lazily: a rank reads only its own layers."""
    from mlx_lm import load

    model, tokenizer = load(model_path, lazy=True)
    name = Path(model_path.rstrip("/")).name
    inner = getattr(model, "model", None)
    if not hasattr(inner, "pipeline"):
        raise ValueError(f"{name}: mlx-lm's {type(model).__module__} has no pipeline split "
                         "(no model.pipeline(group)); serve it without --pipeline (tensor "
                         "parallel) or on one process")
    num_layers = len(inner.layers)
    if num_layers < group.size():
        raise ValueError(f"{name} cannot be pipelined over {group.size()} ranks: it has "
                         f"{num_layers} layers")
    inner.pipeline(group)
    mx.eval(model.parameters())
    log.info("pipeline: rank %d holds layers %d-%d of %d", group.rank(), inner.start_idx,
             inner.end_idx - 1, num_layers)
    return model, tokenizer


def load_sharded(model_path: str, group):
    """The model (this rank's shard) and tokenizer. Raises ``ValueError`` for
    a model that cannot be split over the group."""
    from mlx_lm.utils import load_model, sharded_load

    problem = split_problem(model_path, group.size())
    if problem:
        raise ValueError(problem)
    model, _ = load_model(Path(model_path), lazy=True, strict=False)
    if not hasattr(model, "shard"):
        raise ValueError(f"{Path(model_path).name} ({type(model).__module__}) has no "
                         "tensor-parallel split in mlx-lm")
    return sharded_load(model_path, tensor_group=group)
