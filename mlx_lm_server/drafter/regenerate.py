"""``train --regenerate``: the target writes the answers its drafter learns from.

A drafter is scored on how often it guesses the target's own next tokens,
so the text to learn from is the target's, not whoever wrote the data's
answers (the recipe EAGLE-3 and DFlash trainers recommend). Each chat
record's conversation up to its last user turn, and each traffic record's
prompt, goes to the same batched scheduler that serves (continuous batching,
prompt-lookup speculation: greedy output unchanged), and the target's answer
replaces the data's. Text and source files are kept as they are.

The result is written once to ``OUT/regenerated.jsonl`` as traffic records
(prompt and output ids), which a resumed run reads instead of generating again.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Callable, Iterable

from ..decoding.sampling import SamplingParams
from ..serving.request import DoneEvent, ErrorEvent, GenerationRequest, TextEvent
from .data import jsonl_records

REGENERATED = "regenerated.jsonl"


def prompts_of(tokenizer, files: Iterable[str]) -> tuple[list[list[int]], list[str]]:
    """(the prompts of the JSONL records, in order; the other files, kept as text)."""
    prompts, others = [], []
    for name in files:
        path = Path(name)
        if path.suffix != ".jsonl":
            others.append(name)
            continue
        for line_no, record in enumerate(jsonl_records(path), 1):
            prompts.append(_prompt(tokenizer, record, f"{path} (record {line_no})"))
    return prompts, others


def _prompt(tokenizer, record: dict, where: str) -> list[int]:
    """A traffic record's prompt, or a chat up to its last user turn (the
    data's answers dropped: the target writes its own)."""
    if "prompt_ids" in record:
        return list(record["prompt_ids"])
    messages = record["messages"]
    while messages and messages[-1].get("role") != "user":
        messages.pop()
    if not messages:
        raise ValueError(f"{where}: no user turn to answer")
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True)


def regenerate(model, tokenizer, prompts: list[list[int]], max_tokens: int,
               temperature: float = 0.0, batch_size: int = 16,
               progress: Callable[[str], None] = print) -> list[list[int]]:
    """The target's answer to each prompt (token ids, in order), generated
    through the serving scheduler."""
    from ..assembly import make_scheduler
    from ..spec_decode import make_engine
    from ..spec_decode.config import SpecDecodeConfig

    engine = make_engine(model, SpecDecodeConfig(mode="ngram", calibration_seconds=0),
                         tokenizer)
    scheduler = make_scheduler(model, tokenizer, max_batch_size=batch_size,
                               max_queued_requests=len(prompts) + 1, engine=engine,
                               max_kv_memory=None)
    scheduler.start()
    done, tokens, tic = 0, 0, time.perf_counter()

    async def one(prompt):
        nonlocal done, tokens
        handle = scheduler.submit(GenerationRequest(
            prompt, max_tokens, SamplingParams(temperature=temperature)))
        ids = []
        while True:
            event = await handle.events.get()
            if isinstance(event, TextEvent):
                ids.extend(event.token_ids)
            elif isinstance(event, ErrorEvent):
                raise RuntimeError(f"regenerating an answer failed: {event.message}")
            elif isinstance(event, DoneEvent):
                done, tokens = done + 1, tokens + len(ids)
                if done % 10 == 0 or done == len(prompts):
                    rate = tokens / max(time.perf_counter() - tic, 1e-9)
                    progress(f"regenerated {done}/{len(prompts)} answers ({rate:.1f} tok/s)")
                return ids

    async def main():
        return await asyncio.gather(*[one(p) for p in prompts])

    try:
        return asyncio.run(main())
    finally:
        scheduler.shutdown()
        scheduler.join(timeout=10)


def regenerated_files(model, tokenizer, files: list[str], out: Path, max_tokens: int,
                      temperature: float, progress: Callable[[str], None] = print) -> list[str]:
    """The training files with the JSONL records' answers the target's own:
    ``out/regenerated.jsonl`` (written once, then reused) and the text files."""
    path = out / REGENERATED
    prompts, others = prompts_of(tokenizer, files)
    if path.exists():
        progress(f"reusing the target's answers in {path}")
        return [str(path)] + others
    if prompts:
        progress(f"the target answers {len(prompts)} prompts (at most {max_tokens} tokens each)")
        answers = regenerate(model, tokenizer, prompts, max_tokens, temperature,
                             progress=progress)
        partial = path.with_suffix(".partial")
        with partial.open("w") as f:
            for p, a in zip(prompts, answers):
                f.write(json.dumps({"prompt_ids": p, "output_ids": a}, separators=(",", ":")))
                f.write("\n")
        partial.rename(path)
        return [str(path)] + others
    return others
