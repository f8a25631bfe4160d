"""Prompts arriving together on a CPU: prefilled one after another, so the
first decodes while the next is prefilled (``default_prefill_batch_size``)."""

import asyncio

import mlx.core as mx
import pytest

from mlx_lm_server.assembly import make_scheduler
from mlx_lm_server.decoding.sampling import SamplingParams
from mlx_lm_server.serving.request import DoneEvent, GenerationRequest, TextEvent


def _arrivals(scheduler, requests) -> list[int]:
    """The index of the request each streamed token belongs to, in arrival order."""
    order: list[int] = []

    async def drain(i, handle):
        while True:
            event = await handle.events.get()
            if isinstance(event, TextEvent):
                order.extend([i] * len(event.token_ids))
            elif isinstance(event, DoneEvent):
                return
            else:
                raise AssertionError(event)

    async def main():
        handles = [scheduler.submit(r) for r in requests]  # back to back: one wave
        await asyncio.gather(*[drain(i, h) for i, h in enumerate(handles)])

    asyncio.run(main())
    return order


@pytest.mark.skipif(mx.default_device() != mx.cpu, reason="the CPU's default")
def test_on_a_cpu_the_first_prompt_decodes_while_the_next_is_prefilled(smollm2):
    """Two 480-token prompts at once, prefilled 128 tokens a step. Prefilled
    together (upstream's default, 8), both first tokens come out of the same
    step; one after another, the first prompt's row decodes a token beside
    each of the second's four prefill chunks before the second's first token."""
    model, tokenizer = smollm2
    scheduler = make_scheduler(model, tokenizer, max_batch_size=4, prefill_step_size=128)
    scheduler.start()
    try:
        words = tokenizer.encode(" ".join(f"item {i}," for i in range(400)))
        prompts = [words[:480], words[500:980]]
        greedy = SamplingParams(temperature=0)
        order = _arrivals(scheduler, [GenerationRequest(p, max_tokens=8, sampling=greedy)
                                      for p in prompts])
    finally:
        scheduler.shutdown()
        scheduler.join(10)
    assert sorted(order) == [0] * 8 + [1] * 8, order
    before = order.index(1 - order[0])  # tokens out before the second prompt's first
    assert before >= 3, order
