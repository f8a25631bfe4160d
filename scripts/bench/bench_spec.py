"""Benchmark n-gram speculative decoding against plain decoding, in process.

For each model, workload and batch size B, one run drives the scheduler
directly (no HTTP) with the same loaded model and the same prompts under
several configurations, side by side:

- ``none``: no speculation (``--spec-decode none``);
- ``ngram``: n-gram speculation with the dynamic controller on (the default
  ``SpecDecodeConfig(mode="ngram")``, at most ``--k`` drafts per step);
- ``suffix`` (with ``--suffix``): the suffix proposer (prompt lookup, else
  earlier requests' outputs), controller on;
- ``k=N`` (with ``--sweep-k``): n-gram speculation at a fixed k, controller off;
  ``eagle3 k=N`` too with ``--eagle3``: the head drafting k every step
  (``dynamic=False, adaptive_k=False, num_speculative_tokens=N``);
- ``none2`` (with ``--aa``): a second scheduler without speculation, an A/A
  check of the harness: its ratio to none is what order and drift alone read;
- ``eplain`` (with ``--engine-plain``): n-gram's engine whose controller
  decides every step and never verifies: what the engine's plain path costs;
- ``draft`` and ``ngram,draft`` (with ``--draft MODEL``; ``suffix,draft`` too
  with ``--suffix``): the draft model alone, and mixed per row with the cheap
  proposer (``proposer/mixed.py``), controller on.

Workloads: see ``workloads.py`` (chat-templated prompts, temperature 0 unless
``--temperature``).

A wave submits B requests at once (the workload's prompts in turn, each
repeat's from where the last one's ended) to a
scheduler that batches and prefills all B together, and records for every
request the time of its first token and of its end. Per wave:

- decode tok/s = sum(tokens - 1) / (last end - first first-token): decoding
  only, prefill excluded;
- wall tok/s = sum(tokens) / (last end - submission): prefill included;
- from the scheduler's ``SpecCounts`` (a delta over the wave): mean accepted
  length (1 + accepted drafts per sequence-step that had drafts), overall
  acceptance rate and acceptance per draft position, tokens per sequence-step;
- from the engine's stats: the fraction of batch steps that verified drafts
  (``steps / (steps + fallback_steps)``) and the controller's k choices;
- whether each request's token ids equal those of ``none`` (same B, same
  repeat). At temperature 0 they should; a divergence can only come from a
  float near-tie, so for a few divergences the top-2 logit gap at the first
  differing token is computed (one full forward pass of the prompt).

A wave ends with its slowest request: speculation that saves a few steps on
some rows of a batch and none on others saves nothing on the wave, though it
frees those rows' slots early in a server that has more work. ``--steady S``
measures that server instead (as serving benchmarks with a fixed concurrency
do): B clients, each sending its next request (the workload's prompts in turn)
as soon as its last one ends, so the batch stays full. The window opens when
every client has its first token and lasts S seconds; tok/s counts the tokens
streamed inside it (prefill of the requests that join is included: it is part
of serving), the speculation counters are a delta over it, requests still
running when it closes are cancelled, and identical outputs are checked on the
requests both configurations finished. The stream ratio leaves prefill out:
each request's tokens after its first over the time from its first token to
its last, for the requests that started and ended inside the window, against
none's (a request that decodes faster also prefills more often in a window).

Each configuration has its own scheduler (batch and prefill width = the
largest B), warmed up with one short request before anything is timed. Each (B, configuration) wave runs ``--repeats``
times, configurations interleaved and their order turned every other repeat
(none, ngram, ..., ngram, none, ...): the configuration that runs first in a
repeat has read a few percent slower on this machine, so an even number of
repeats cancels that in the mean of the per-repeat ratios; tables show medians
over repeats, and sums over repeats for the speculation counters and the
identical-output counts.

Run it from the repository root (re-executes itself with OpenBLAS preloaded):

    .venv/bin/python scripts/bench/bench_spec.py
    .venv/bin/python scripts/bench/bench_spec.py --models qwen2.5-coder-0.5b-instruct \\
        --workloads code-edit --batch-sizes 1 --sweep-k 2 4 6 8 10 12
    .venv/bin/python scripts/bench/bench_spec.py --models smollm2-135m-instruct \\
        --workloads chat --batch-sizes 1 4 16 --chat-max-tokens 64

Results also go to ``bench_out/bench_spec.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUT_DIR = ROOT / "bench_out"
sys.path.insert(0, str(ROOT))

from intervals import ratio_interval  # noqa: E402
from waves import decode_tok_s, submit_all  # noqa: E402
from workloads import WORKLOADS, chat_tokens, workload_prompts  # noqa: E402

from mlx_lm_server.runtime.blas import ensure_fast_blas  # noqa: E402  (no MLX import)

DEFAULT_MODELS = ["smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct"]


def progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---------------------------------------------------------------- prompts

WARMUP = "Repeat exactly: one two three four five six seven eight nine ten."


def head_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, check=True,
                              capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


# ---------------------------------------------------------------- configurations

def configurations(args) -> list[tuple[str, object]]:
    """(name, SpecDecodeConfig or None) in the order they run within a repeat."""
    from mlx_lm_server.spec_decode.config import SpecDecodeConfig

    ngram = SpecDecodeConfig(mode="ngram", num_speculative_tokens=args.k)
    configs = [("none", None)] + ([("eplain", ngram)] if args.engine_plain else [])
    configs.append(("ngram", ngram))
    if args.suffix:
        configs.append(("suffix", SpecDecodeConfig(mode="suffix", num_speculative_tokens=args.k)))
    if args.draft:
        draft = str(model_path(args.draft))
        for mode in ("draft", "ngram,draft") + (("suffix,draft",) if args.suffix else ()):
            configs.append((mode, SpecDecodeConfig(mode=mode, num_speculative_tokens=args.k,
                                                   draft_model_path=draft)))
    if args.mtp:
        for mode in ("mtp", "ngram,mtp") + (("suffix,mtp",) if args.suffix else ()):
            configs.append((mode, SpecDecodeConfig(mode=mode, num_speculative_tokens=args.k)))
    if args.eagle3:
        for mode in ("eagle3",) + (("suffix,eagle3",) if args.suffix else ("ngram,eagle3",)):
            configs.append((mode, SpecDecodeConfig(mode=mode, num_speculative_tokens=args.k,
                                                   draft_model_path=args.eagle3)))
    if args.dflash:
        for mode in ("dflash",) + (("suffix,dflash",) if args.suffix else ("ngram,dflash",)):
            configs.append((mode, SpecDecodeConfig(mode=mode, num_speculative_tokens=args.k,
                                                   draft_model_path=args.dflash)))
    if args.aa:
        configs.append(("none2", None))
    for k in args.sweep_k or []:
        configs.append((f"k={k}", SpecDecodeConfig(mode="ngram", num_speculative_tokens=k,
                                                   dynamic=False, adaptive_k=False)))
        if args.eagle3:  # the head drafting every step: what the controller weighs
            configs.append((f"eagle3 k={k}", SpecDecodeConfig(
                mode="eagle3", num_speculative_tokens=k, dynamic=False, adaptive_k=False,
                draft_model_path=args.eagle3)))
    if args.tree_width > 1:  # each speculative configuration again, drafting trees
        from dataclasses import replace

        configs += [(f"{name} tree", replace(spec, tree_width=args.tree_width,
                                             tree_budget=args.tree_budget))
                    for name, spec in list(configs) if spec is not None and name != "eplain"]
    return configs


def make_scheduler(model, tokenizer, spec, width: int, never_verify: bool = False,
                   path: str = "target"):
    """``never_verify``: the engine's controller decides every step, and the
    step stays plain (``--engine-plain``); ``path``: the model's folder (an
    MTP head's weights are read from it)."""
    from mlx_lm_server.assembly import make_scheduler
    from mlx_lm_server.spec_decode import make_engine

    engine = make_engine(model, spec, tokenizer, path) if spec is not None else None
    if never_verify:
        from bench_plain_path import plain_only

        plain_only(engine.controller)
    if engine is not None and TRACE is not None:
        import step_trace

        step_trace.attach(engine, TRACE["records"], TRACE["label"])
    s = make_scheduler(model, tokenizer, max_batch_size=width, prefill_batch_size=width,
                  max_queued_requests=10_000, engine=engine)
    s.start()
    return s


def suffix_proposer(scheduler):
    """The scheduler's suffix proposer (a mixed proposer's cheap one), or None."""
    from mlx_lm_server.spec_decode.proposer.suffix import SuffixProposer

    proposer = getattr(scheduler.engine, "proposer", None)
    proposer = getattr(proposer, "lookup", proposer)
    return proposer if isinstance(proposer, SuffixProposer) else None


def forget_earlier_outputs(scheduler) -> None:
    """Empty a suffix proposer's global index (the scheduler is idle). A
    workload's prompts repeat across waves and repeats, and the index would
    copy each answer from the same prompt's answer before: for work whose
    text is new, that is not what a server sees."""
    from mlx_lm_server.spec_decode.proposer.suffix import SuffixIndex

    proposer = suffix_proposer(scheduler)
    if proposer is not None:
        index = proposer.index
        proposer.index = SuffixIndex(index.max_tokens, index.min_order, index.max_order)


def serve_earlier(scheduler, runs: list[dict]) -> None:
    """A suffix proposer's global index as after answering ``runs`` (prompt
    and greedy output each, recorded once): a server that has already done
    that many such requests, without spending the window's time on them."""
    proposer = suffix_proposer(scheduler)
    if proposer is not None:
        for r in runs:
            proposer.index.add((r["prompt"] if proposer.index_prompts else []) + r["output"])


def stop_scheduler(s) -> None:
    s.shutdown()
    s.join(30)


# ---------------------------------------------------------------- one wave

def wait_idle(scheduler, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while scheduler.stats()["sequences"] and time.monotonic() < deadline:
        time.sleep(0.01)


def snapshot(scheduler) -> dict:
    c = scheduler.spec_stats.tokens
    snap = {"seq_steps": c.steps, "drafts": c.num_drafts, "draft_tokens": c.num_draft_tokens,
            "accepted": c.num_accepted_tokens, "per_pos": list(c.accepted_per_pos),
            "verify_steps": 0, "plain_steps": 0, "k_counts": {}, "gen_steps": scheduler.steps,
            "verify_s": 0.0, "propose_s": 0.0, "rollback_s": 0.0, "new_shapes": 0,
            "verify_first_s": 0.0, "matching_steps": 0}
    e = scheduler.engine
    if e is not None:
        snap.update(verify_steps=e.steps.verify_steps, plain_steps=e.steps.plain_steps,
                    k_counts=dict(e.steps.k_counts), verify_s=e.steps.time_verify,
                    propose_s=e.steps.time_propose, rollback_s=e.steps.time_rollback,
                    new_shapes=e.timer.shapes_run, verify_first_s=e.steps.time_verify_first,
                    matching_steps=e.steps.matching_steps)
    return snap


COUNTERS = ("seq_steps", "drafts", "draft_tokens", "accepted", "verify_steps", "plain_steps",
            "verify_s", "propose_s", "rollback_s", "new_shapes", "verify_first_s",
            "matching_steps")


def controller_costs(scheduler, B: int) -> dict:
    """The controller's estimate of a verify pass in plain steps, c(B, k), after the wave."""
    e = scheduler.engine
    if e is None:
        return {}
    c = e.controller
    from mlx_lm_server.spec_decode.control.costs import k_buckets

    return {k: round(c.cost(B, k), 2) for k in k_buckets(c.max_k)}


def proposer_stats(scheduler) -> dict:
    """The proposer's own counters so far (a mix: how often its draft model
    ran, was skipped, or was priced out)."""
    e = scheduler.engine
    return {} if e is None else e.proposer.stats()


def delta(after: dict, before: dict) -> dict:
    out = {k: after[k] - before[k] for k in COUNTERS + ("gen_steps",)}
    pos = before["per_pos"] + [0] * (len(after["per_pos"]) - len(before["per_pos"]))
    out["per_pos"] = [a - b for a, b in zip(after["per_pos"], pos)]
    keys = set(after["k_counts"]) | set(before["k_counts"])
    out["k_counts"] = {k: after["k_counts"].get(k, 0) - before["k_counts"].get(k, 0)
                       for k in sorted(keys)}
    out["k_counts"] = {k: n for k, n in out["k_counts"].items() if n}
    return out


# --trace: every engine's steps, recorded by scripts/bench/step_trace.py.
TRACE = None

# --temperature: requests sample at it, request i with seed i (greedy when 0).
TEMPERATURE = 0.0


def sampling(i: int):
    from mlx_lm_server.decoding.sampling import SamplingParams

    if TEMPERATURE == 0.0:
        return SamplingParams(temperature=0.0)
    return SamplingParams(temperature=TEMPERATURE, seed=i)


def run_wave(scheduler, prompts: list[list[int]], max_tokens: int) -> dict:
    from mlx_lm_server.serving.request import GenerationRequest

    reqs = [GenerationRequest(p, max_tokens=max_tokens, sampling=sampling(i))
            for i, p in enumerate(prompts)]
    wait_idle(scheduler)
    before = snapshot(scheduler)
    start, results = asyncio.run(submit_all(scheduler, reqs))
    wait_idle(scheduler)
    spec = delta(snapshot(scheduler), before)
    spec["controller_costs"] = controller_costs(scheduler, len(prompts))
    spec["proposer"] = proposer_stats(scheduler)
    first = min(r["first"] for r in results)
    end = max(r["done"] for r in results)
    tokens = sum(r["tokens"] for r in results)
    return {
        "tokens": tokens,
        "decode_tok_s": decode_tok_s(results),
        "wall_tok_s": tokens / max(end - start, 1e-9),
        "wall_s": end - start,
        "ttft_mean_s": statistics.mean(r["first"] - start for r in results),
        "first_token_spread_s": max(r["first"] for r in results) - first,
        # Decode window over generator steps after the prefill one: plain or verify.
        "ms_per_decode_step": 1e3 * (end - first) / max(spec["gen_steps"] - 1, 1),
        "finish": [r["finish"] for r in results],
        "ids": [r["ids"] for r in results],
        "spec": spec,
    }


async def steady_clients(scheduler, prompts: list[list[int]], B: int, max_tokens: int,
                         seconds: float) -> dict:
    """B clients back to back; token times and counter snapshots of one window."""
    from mlx_lm_server.serving.request import DoneEvent, ErrorEvent, GenerationRequest, TextEvent

    start = time.perf_counter()
    stamps: list[tuple[float, int]] = []  # (time, tokens) of every streamed event
    finished: dict[int, dict] = {}  # request index -> record
    firsts: list[float] = []
    started = asyncio.Event()
    handles: dict[int, object] = {}
    asked: set[int] = set()  # indices of the requests submitted
    spans: dict[int, tuple] = {}  # request index -> (first token, end, tokens)

    async def client(c: int) -> None:
        for j in range(1_000_000):
            i = j * B + c  # request i gets prompt i, as in a wave of any size
            asked.add(i)
            handles[c] = h = scheduler.submit(GenerationRequest(
                prompts[i % len(prompts)], max_tokens=max_tokens, sampling=sampling(i)))
            ids = []
            while True:
                event = await h.events.get()
                if isinstance(event, TextEvent) and event.token_ids:
                    if not ids:
                        first = time.perf_counter()
                    if not ids and j == 0:
                        firsts.append(first)
                        if len(firsts) == B:
                            started.set()
                    stamps.append((time.perf_counter(), len(event.token_ids)))
                    ids.extend(event.token_ids)
                elif isinstance(event, ErrorEvent):
                    raise RuntimeError(f"request failed: {event.message}")
                elif isinstance(event, DoneEvent):
                    finished[i] = {"ids": ids, "finish": event.finish_reason}
                    if ids:
                        spans[i] = (first, time.perf_counter(), len(ids))
                    break

    tasks = [asyncio.create_task(client(c)) for c in range(B)]
    await started.wait()
    t0, before = time.perf_counter(), snapshot(scheduler)
    await asyncio.sleep(seconds)
    t1, after = time.perf_counter(), snapshot(scheduler)
    for t in tasks:
        t.cancel()
    for h in handles.values():
        scheduler.cancel(h)
    await asyncio.gather(*tasks, return_exceptions=True)
    return {"start": start, "t0": t0, "t1": t1, "before": before, "after": after,
            "stamps": stamps, "finished": finished, "firsts": firsts, "spans": spans,
            "repeated_prompts": sum(i >= len(prompts) for i in asked)}


def run_steady(scheduler, prompts: list[list[int]], B: int, max_tokens: int,
               seconds: float) -> dict:
    wait_idle(scheduler)
    r = asyncio.run(steady_clients(scheduler, prompts, B, max_tokens, seconds))
    wait_idle(scheduler)
    t0, t1 = r["t0"], r["t1"]
    spec = delta(r["after"], r["before"])
    spec["controller_costs"] = controller_costs(scheduler, B)
    spec["proposer"] = proposer_stats(scheduler)
    tokens = sum(n for t, n in r["stamps"] if t0 <= t < t1)
    # Each request's own decoding, prefill excluded: the requests that
    # started and ended inside the window, from first token to last.
    inside = [(f, e, n) for f, e, n in r["spans"].values() if t0 <= f and e <= t1 and n > 1]
    stream_s = sum(e - f for f, e, n in inside)
    n = max(r["finished"], default=-1) + 1
    ids = [r["finished"][i]["ids"] if i in r["finished"] else None for i in range(n)]
    return {
        "tokens": tokens,
        "decode_tok_s": tokens / (t1 - t0),
        "wall_tok_s": tokens / (t1 - t0),
        "wall_s": t1 - r["start"],
        "stream_tok_s": sum(n - 1 for f, e, n in inside) / stream_s if stream_s else None,
        "ttft_mean_s": statistics.mean(f - r["start"] for f in r["firsts"]),
        "first_token_spread_s": max(r["firsts"]) - min(r["firsts"]),
        "ms_per_decode_step": 1e3 * (t1 - t0) / max(spec["gen_steps"], 1),
        "finish": [r["finished"][i]["finish"] if i in r["finished"] else None
                   for i in range(n)],
        "ids": ids,
        "spec": spec,
        # requests that asked a prompt an earlier request of the window asked:
        # a suffix index may copy that answer (not new work)
        "repeated_prompts": r["repeated_prompts"],
    }


def batch_prompts(prompts: list[list[int]], B: int, start: int = 0) -> list[list[int]]:
    """A wave's B prompts, the workload's in turn from ``start``."""
    return [prompts[(start + i) % len(prompts)] for i in range(B)]


# ---------------------------------------------------------------- summaries

def spec_summary(spec: dict) -> dict:
    drafts = spec["drafts"]
    steps = spec["verify_steps"] + spec["plain_steps"]
    emitted = spec["seq_steps"] + spec["accepted"]
    return {
        "mean_accepted_length": 1.0 + spec["accepted"] / drafts if drafts else 1.0,
        "acceptance_rate": spec["accepted"] / spec["draft_tokens"] if spec["draft_tokens"] else 0.0,
        "acceptance_per_position": [n / drafts for n in spec["per_pos"]] if drafts else [],
        "tokens_per_seq_step": emitted / spec["seq_steps"] if spec["seq_steps"] else 0.0,
        "spec_step_fraction": spec["verify_steps"] / steps if steps else 0.0,
        "verify_ms_per_step": 1e3 * spec["verify_s"] / spec["verify_steps"]
        if spec["verify_steps"] else None,
    }


def pass_details(w: dict) -> str:
    """Where a window's verification time went: passes of shapes new to the
    process (compiling, on a GPU) against the rest, and the controller's prices."""
    sp = w["spec"]
    if not sp["verify_steps"]:
        return ""
    steps = sp["verify_steps"] + sp["plain_steps"]
    mix = sp.get("proposer", {})
    model = (f"; draft model so far: ran {mix['draft_model_steps']}, skipped "
             f"{mix['draft_model_skipped_steps']}, priced out "
             f"{mix['draft_model_priced_out_steps']} steps" if "draft_model_steps" in mix else "")
    return (f"; {w['ms_per_decode_step']:.1f} ms/step, verify {1e3 * sp['verify_s']:.0f} ms "
            f"over {sp['verify_steps']} of {steps} steps ({sp['matching_steps']} for rows "
            f"copying their shadow draft), {sp['new_shapes']} new shapes "
            f"taking {1e3 * sp['verify_first_s']:.0f} ms; c(B, k) {sp['controller_costs']}"
            f"{model}")


def add_spec(total: dict, spec: dict) -> dict:
    if not total:
        return {**spec, "per_pos": list(spec["per_pos"]), "k_counts": dict(spec["k_counts"])}
    out = {k: total[k] + spec[k] for k in COUNTERS + ("gen_steps",)}
    n = max(len(total["per_pos"]), len(spec["per_pos"]))
    pad = lambda xs: xs + [0] * (n - len(xs))  # noqa: E731
    out["per_pos"] = [a + b for a, b in zip(pad(total["per_pos"]), pad(spec["per_pos"]))]
    out["k_counts"] = dict(total["k_counts"])
    for k, v in spec["k_counts"].items():
        out["k_counts"][k] = out["k_counts"].get(k, 0) + v
    return out


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def top2_gap(model, tokens: list[int]) -> float:
    import mlx.core as mx
    import numpy as np
    from mlx_lm.models.cache import make_prompt_cache

    logits = model(mx.array([tokens]), cache=make_prompt_cache(model))[0, -1].astype(mx.float32)
    top = np.sort(np.asarray(logits))[-2:]
    return float(top[1] - top[0])


def compare_outputs(waves: dict, prompts: list[list[int]]) -> list[dict]:
    """Every request whose ids differ from none's in the same (B, repeat)
    (greedy runs only: sampled outputs differ by design, their distribution
    does not)."""
    diffs = []
    if TEMPERATURE > 0:
        return diffs
    for (name, B), reps in waves.items():
        if name == "none":
            continue
        for r, wave in enumerate(reps):
            base = waves[("none", B)][r]
            wave.setdefault("identical", 0)
            wave["compared"] = 0
            for i, (a, b) in enumerate(zip(base["ids"], wave["ids"])):
                if a is None or b is None:  # steady: not finished by both
                    continue
                wave["compared"] += 1
                wave["identical"] += a == b
                if a != b:
                    diffs.append({"config": name, "B": B, "repeat": r, "request": i,
                                  "position": first_difference(a, b),
                                  "len_none": len(a), "len_config": len(b),
                                  "prompt": prompts[(r * B + i) % len(prompts)]})
    return diffs


def check_gaps(model, diffs: list[dict], waves: dict, limit: int) -> None:
    for d in diffs[:limit]:
        base = waves[("none", d["B"])][d["repeat"]]["ids"][d["request"]]
        d["top2_logit_gap"] = top2_gap(model, d["prompt"] + base[: d["position"]])
        progress(f"  divergence: {d['config']} B={d['B']} request {d['request']} at token "
                 f"{d['position']}: top-2 logit gap {d['top2_logit_gap']:.2e}")


def stream_ratio(reps: list[dict], none: list[dict]):
    """Median over repeats of a steady window's per-request decoding rate
    (prefill excluded) over none's; None for waves, or where no request
    fitted in a window."""
    ratios = [w["stream_tok_s"] / n["stream_tok_s"] for w, n in zip(reps, none)
              if w.get("stream_tok_s") and n.get("stream_tok_s")]
    return statistics.median(ratios) if ratios else None


def summarise(waves: dict, configs, batch_sizes) -> list[dict]:
    rows = []
    for B in batch_sizes:
        none = waves[("none", B)]
        none_dec = statistics.median(w["decode_tok_s"] for w in none)
        none_wall = statistics.median(w["wall_tok_s"] for w in none)
        for name, _ in configs:
            reps = waves[(name, B)]
            spec = {}
            for w in reps:
                spec = add_spec(spec, w["spec"])
            dec = statistics.median(w["decode_tok_s"] for w in reps)
            wall = statistics.median(w["wall_tok_s"] for w in reps)
            per_repeat = [w["decode_tok_s"] / n["decode_tok_s"] for w, n in zip(reps, none)]
            low, high = ratio_interval(per_repeat)
            row = {
                "B": B, "config": name, "repeats": len(reps),
                "decode_tok_s": dec, "wall_tok_s": wall,
                "decode_ratio": dec / none_dec, "wall_ratio": wall / none_wall,
                "stream_ratio": stream_ratio(reps, none),
                "repeat_ratios": per_repeat, "ratio_ci95": [low, high],
                "tokens": [w["tokens"] for w in reps],
                "first_token_spread_s": max(w["first_token_spread_s"] for w in reps),
                "ms_per_decode_step": statistics.median(w["ms_per_decode_step"] for w in reps),
                "controller_costs": reps[-1]["spec"].get("controller_costs", {}),
                "identical": (None if name == "none" or TEMPERATURE > 0
                              else sum(w["identical"] for w in reps)),
                "requests": sum(w.get("compared", len(w["ids"])) for w in reps),
                "spec": spec, **spec_summary(spec),
            }
            rows.append(row)
    return rows


def print_tables(model: str, workload: str, max_tokens: int, k: int, rows: list[dict],
                 steady: float = 0.0) -> None:
    what = (f"tok/s of B clients back to back over {steady:g} s (prefill included)" if steady
            else "waves, decode tok/s (prefill excluded)")
    print(f"\n{model} / {workload}: max_tokens {max_tokens}, ngram k <= {k}, "
          f"medians of {rows[0]['repeats']} repeat(s), {what}")
    print(f"{'B':>4} {'none':>8} {'ngram':>8} {'ratio':>6} {'95% CI':>11} {'wall ratio':>10} "
          f"{'mean acc len':>12} {'accept':>7} {'spec steps':>10} {'identical':>9}")
    by = {(r["config"], r["B"]): r for r in rows}
    for B in sorted({r["B"] for r in rows}):
        n, g = by[("none", B)], by[("ngram", B)]
        print(f"{B:>4} {n['decode_tok_s']:>8.2f} {g['decode_tok_s']:>8.2f} "
              f"{g['decode_ratio']:>6.2f} {'%.2f-%.2f' % tuple(g['ratio_ci95']):>11} "
              f"{g['wall_ratio']:>10.2f} "
              f"{g['mean_accepted_length']:>12.2f} {g['acceptance_rate']:>7.2f} "
              f"{g['spec_step_fraction']:>10.0%} "
              f"{'-' if g['identical'] is None else g['identical']:>4}/{g['requests']:<4}")
    for B in sorted({r["B"] for r in rows}):
        g = by[("ngram", B)]
        pos = " ".join(f"{x:.2f}" for x in g["acceptance_per_position"])
        vms = g["verify_ms_per_step"]
        print(f"  B={B} ngram acceptance per position: [{pos}]; k choices {g['spec']['k_counts']}")
        print(f"  B={B} ms per decode step: none {by[('none', B)]['ms_per_decode_step']:.0f}, "
              f"ngram {g['ms_per_decode_step']:.0f} (verify pass "
              f"{'n/a' if vms is None else f'{vms:.0f}'}, pass shapes run for the first "
              f"time {g['spec']['new_shapes']}); controller c(B, k) {g['controller_costs']}")
    if any(r["config"] not in ("none", "ngram") for r in rows):  # every configuration
        print(f"\n{'B':>4} {'config':>7} {'tok/s':>8} {'ratio':>6} {'95% CI':>13} "
              f"{'wall ratio':>10} {'mean acc len':>12} {'accept':>7} {'tok/step':>8} "
              f"{'spec steps':>10} {'identical':>9} {'ms/step':>7} {'stream ratio':>12}")
        for r in rows:
            ident = "" if r["identical"] is None else f"{r['identical']:>4}/{r['requests']:<4}"
            lo, hi = r["ratio_ci95"]
            stream = "-" if r["stream_ratio"] is None else f"{r['stream_ratio']:.2f}"
            print(f"{r['B']:>4} {r['config']:>7} {r['decode_tok_s']:>8.2f} "
                  f"{r['decode_ratio']:>6.2f} {f'{lo:.2f}-{hi:.2f}':>13} {r['wall_ratio']:>10.2f} "
                  f"{r['mean_accepted_length']:>12.2f} {r['acceptance_rate']:>7.2f} "
                  f"{r['tokens_per_seq_step']:>8.2f} {r['spec_step_fraction']:>10.0%} {ident:>9} "
                  f"{r['ms_per_decode_step']:>7.0f} {stream:>12}")
    sys.stdout.flush()


# ---------------------------------------------------------------- driver

def model_path(name: str) -> Path:
    p = Path(name)
    return p if p.exists() else ROOT / "models" / name


def bench_workload(model, tokenizer, model_name: str, workload: str, args,
                   path: str = "target") -> dict:
    texts = workload_prompts(workload)
    prompts = [chat_tokens(tokenizer, t) for t in texts]
    max_tokens = args.chat_max_tokens if workload == "chat" else args.max_tokens
    earlier = []
    if args.served_before:
        from bench_acceptance import record

        earlier = record(model_name, workload, max_tokens, model, tokenizer)[:args.served_before]
        prompts = prompts[args.served_before:]
    lengths = [len(p) for p in prompts]
    progress(f"[{model_name} / {workload}] {len(prompts)} prompts of {min(lengths)} to "
             f"{max(lengths)} tokens, max_tokens {max_tokens}")
    configs = configurations(args)
    width = max(args.batch_sizes)
    schedulers = {}
    try:
        for name, spec in configs:
            schedulers[name] = make_scheduler(model, tokenizer, spec, width,
                                              never_verify=name == "eplain",
                                              path=path)
            tic = time.perf_counter()
            run_wave(schedulers[name], [chat_tokens(tokenizer, WARMUP)], 16)
            progress(f"  warm-up {name}: {time.perf_counter() - tic:.1f}s")
        waves = {}
        for B in args.batch_sizes:
            for rep in range(args.repeats):
                # Each repeat's wave starts where the last one's ended: at
                # B=1 the repeats go through the prompts, not one of them.
                batch = batch_prompts(prompts, B, start=rep * B)
                for name, _ in (configs if rep % 2 == 0 else configs[::-1]):
                    if args.cold_index or earlier:
                        forget_earlier_outputs(schedulers[name])
                        serve_earlier(schedulers[name], earlier)
                    if TRACE is not None:
                        TRACE["label"][0] = f"{workload} B={B} repeat {rep + 1} {name}"
                    if args.steady:
                        w = run_steady(schedulers[name], prompts, B, max_tokens, args.steady)
                    else:
                        w = run_wave(schedulers[name], batch, max_tokens)
                    waves.setdefault((name, B), []).append(w)
                    s = spec_summary(w["spec"])
                    rates = (f"{w['decode_tok_s']:.2f} tok/s in the window" if args.steady else
                             f"decode {w['decode_tok_s']:.2f} tok/s, wall "
                             f"{w['wall_tok_s']:.2f} tok/s")
                    if w.get("repeated_prompts"):
                        rates += f" ({w['repeated_prompts']} requests repeated a prompt)"
                    progress(f"  B={B} repeat {rep + 1}/{args.repeats} {name:>6}: {w['tokens']} "
                             f"tokens in {w['wall_s']:.1f}s, {rates}, mean acc len "
                             f"{s['mean_accepted_length']:.2f}, spec steps "
                             f"{s['spec_step_fraction']:.0%}{pass_details(w)}")
    finally:
        for s in schedulers.values():
            stop_scheduler(s)
    if TRACE is not None:
        import step_trace

        print("\n".join(step_trace.summarise(TRACE["records"])))
    diffs = compare_outputs(waves, prompts)
    check_gaps(model, diffs, waves, args.max_gap_checks)
    rows = summarise(waves, configs, args.batch_sizes)
    print_tables(model_name, workload, max_tokens, args.k, rows, args.steady)
    for d in diffs:
        d.pop("prompt")
    return {"model": model_name, "workload": workload, "max_tokens": max_tokens,
            "prompt_tokens": lengths, "rows": rows, "divergences": diffs,
            "finish_reasons": {f"{n} B={B}": [w["finish"] for w in reps]
                               for (n, B), reps in waves.items()}}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=DEFAULT_MODELS,
                   help="model folder names under models/, or paths")
    p.add_argument("--workloads", nargs="+", default=WORKLOADS[:3], choices=WORKLOADS)
    p.add_argument("--suffix", action="store_true",
                   help="also run --spec-decode suffix (controller on, at most --k drafts)")
    p.add_argument("--mtp", action="store_true",
                   help="also run --spec-decode mtp and ngram,mtp (suffix,mtp with --suffix): "
                        "the checkpoint's own MTP layer")
    p.add_argument("--eagle3", metavar="HEAD",
                   help="also run --spec-decode eagle3 with this head, and suffix,eagle3 "
                        "(with --suffix) or ngram,eagle3")
    p.add_argument("--dflash", metavar="DRAFTER",
                   help="also run --spec-decode dflash with this DFlash drafter, and "
                        "suffix,dflash (with --suffix) or ngram,dflash")
    p.add_argument("--cold-index", action="store_true",
                   help="empty the suffix index before every wave or window: the prompts "
                        "repeat across repeats, and their earlier answers would be copied")
    p.add_argument("--served-before", type=int, default=0, metavar="N",
                   help="before every wave or window the suffix index holds the first N "
                        "prompts' greedy outputs (recorded once, as bench_acceptance.py "
                        "does), and the requests start at prompt N: a server that has "
                        "already answered N such requests")
    p.add_argument("--draft", default=None, metavar="MODEL",
                   help="also run the draft model alone and mixed per row with ngram "
                        "(and suffix, with --suffix)")
    p.add_argument("--engine-plain", action="store_true",
                   help="also run 'eplain': n-gram's engine, whose controller decides every "
                        "step and never verifies (shadow drafts on): what the engine's plain "
                        "path costs through the whole server")
    p.add_argument("--aa", action="store_true",
                   help="also run 'none2': a second scheduler without speculation (an A/A "
                        "check: what the harness's order and drift read on their own)")
    p.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 4, 16])
    p.add_argument("--k", type=int, default=8, help="max drafts per step for ngram (controller on)")
    p.add_argument("--sweep-k", nargs="*", type=int, default=[],
                   help="also run fixed-k configurations (controller off) for these k")
    p.add_argument("--tree-width", type=int, default=1,
                   help="also run every speculative configuration with trees of this width "
                        "(named '... tree')")
    p.add_argument("--tree-budget", type=int, default=None,
                   help="with --tree-width: nodes a row (default: the controller's k)")
    p.add_argument("--max-tokens", type=int, default=256, help="for code-edit and extraction")
    p.add_argument("--chat-max-tokens", type=int, default=128, help="for chat")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sample at this temperature (request i seeded with i); outputs are "
                        "compared only at 0")
    p.add_argument("--steady", type=float, default=0.0, metavar="SECONDS",
                   help="instead of waves, B clients back to back; measure this many seconds")
    p.add_argument("--max-gap-checks", type=int, default=4,
                   help="divergences to diagnose with a top-2 logit gap (a forward pass each)")
    p.add_argument("--trace", default=None, metavar="FILE",
                   help="record every speculative step's timings (scripts/bench/step_trace.py) "
                        "into FILE and print where verification steps' time went")
    p.add_argument("--out", default=str(OUT_DIR / "bench_spec.json"))
    return p.parse_args(argv)


def main(argv=None) -> int:
    global TEMPERATURE, TRACE
    ensure_fast_blas()
    args = parse_args(argv)
    TEMPERATURE = args.temperature
    if args.trace:
        TRACE = {"records": [], "label": ["warm-up"]}
    import mlx.core as mx
    from mlx_lm import load

    from mlx_lm_server.runtime.blas import openblas_loaded

    if not openblas_loaded():
        progress("warning: OpenBLAS is not loaded; MLX's CPU matmul will be very slow")
    out = {"command": " ".join(sys.argv), "commit": head_commit(), "args": vars(args),
           "device": str(mx.default_device()), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
           "results": []}
    tic = time.perf_counter()
    for name in args.models:
        path = model_path(name)
        progress(f"loading {path}")
        model, tokenizer = load(str(path))
        for workload in args.workloads:
            out["results"].append(bench_workload(model, tokenizer, path.name, workload, args,
                                              str(path)))
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(out, indent=1))
        del model, tokenizer
        mx.clear_cache()
    out["total_s"] = time.perf_counter() - tic
    if TRACE is not None:
        Path(args.trace).write_text(json.dumps(TRACE["records"]))
    Path(args.out).write_text(json.dumps(out, indent=1))
    progress(f"done in {out['total_s'] / 60:.1f} min; results in {args.out}")
    return 0


if __name__ == "__main__":
    from mlx_lm_server.parallel.liveness import exit_now

    # Without interpreter teardown: the schedulers' inference threads are
    # still alive, and tearing MLX down under them aborted the process
    # ("terminate called without an active exception", status 134) after
    # complete results.
    exit_now(main())
