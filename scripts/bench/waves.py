"""Requests through a scheduler in this process, timed the one way every
in-process benchmark times them (``bench_spec``, ``bench_draft``,
``bench_kv_bits``, ``bench_structured``, ``bench_head_speedup``).

A record per request: its token ids and text, when its first token came and
when it ended (``time.perf_counter``), its finish reason, completion
tokens and the tokens its grammar forced. Decode speed leaves prefill out: the tokens after each request's
first, over the time from the wave's first first token to its last end.
"""

from __future__ import annotations

import asyncio
import time


async def collect(handle) -> dict:
    """One request's events until it is done; its record."""
    from mlx_lm_server.serving.request import DoneEvent, ErrorEvent, TextEvent

    ids, text, first = [], [], None
    while True:
        event = await handle.events.get()
        if isinstance(event, TextEvent):
            if event.token_ids and first is None:
                first = time.perf_counter()
            ids.extend(event.token_ids)
            text.append(event.text)
        elif isinstance(event, ErrorEvent):
            raise RuntimeError(f"request failed: {event.message}")
        elif isinstance(event, DoneEvent):
            done = time.perf_counter()
            return {"ids": ids, "text": "".join(text),
                    "first": first if first is not None else done, "done": done,
                    "finish": event.finish_reason, "tokens": event.completion_tokens,
                    "forced": event.forced_tokens}


async def submit_all(scheduler, requests) -> tuple[float, list[dict]]:
    """Every request submitted at once (a wave); when they were, and their records."""
    start = time.perf_counter()
    # No await between submits: the inference thread sees them all at once.
    handles = [scheduler.submit(r) for r in requests]
    return start, await asyncio.gather(*[collect(h) for h in handles])


def run_wave(scheduler, requests) -> list[dict]:
    return asyncio.run(submit_all(scheduler, requests))[1]


def run_one_by_one(scheduler, requests) -> list[dict]:
    """Each request alone, the next submitted when the last is done (B=1)."""
    async def main():
        return [await collect(scheduler.submit(r)) for r in requests]

    return asyncio.run(main())


def decode_tok_s(records: list[dict]) -> float:
    """Tokens after each request's first, over the first first token to the last end."""
    first = min(r["first"] for r in records)
    end = max(r["done"] for r in records)
    return sum(max(r["tokens"] - 1, 0) for r in records) / max(end - first, 1e-9)
