"""Training text for a drafter, as token sequences of the target's tokenizer.

Chat JSONL (one ``{"messages": [...]}`` per line, OpenAI roles) goes through
the target's chat template, so the head learns the token sequences it will
see when serving; the server's recorded traffic (``--record-traffic``: one
``{"prompt_ids": [...], "output_ids": [...]}`` per line) is taken as the
token ids it holds, prompt then output; any other file (plain text, source
code) is tokenized as it is. Long sequences are cut into windows of at most
``max_len`` tokens.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Iterator

import mlx.core as mx
import numpy as np


def read_sequences(tokenizer, files: Iterable[str], max_len: int) -> list[list[int]]:
    """Every file's token windows, in order."""
    out = []
    for name in files:
        path = Path(name)
        if path.suffix == ".jsonl":
            for record in jsonl_records(path):
                out += _windows(_record_ids(tokenizer, record), max_len)
        else:
            out += _windows(tokenizer.encode(path.read_text()), max_len)
    return [s for s in out if len(s) >= 4]


def jsonl_records(path: Path) -> Iterator[dict]:
    """A JSONL file's records, each a traffic record (integer ``prompt_ids``
    and ``output_ids``) or a chat record (``messages``); anything else is a
    ``ValueError`` naming the file and line."""
    for line_no, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            if "prompt_ids" in record:
                record["output_ids"] = list(record.get("output_ids") or [])
                if not all(isinstance(i, int)
                           for i in [*record["prompt_ids"], *record["output_ids"]]):
                    raise ValueError("token ids must be integers")
            else:
                record["messages"] = list(record["messages"])
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path}:{line_no}: neither a chat record with messages nor a "
                             f"traffic record with prompt_ids ({e})") from None
        yield record


def _record_ids(tokenizer, record: dict) -> list[int]:
    """A record's token ids: a traffic record's prompt and output, or a chat
    through the template."""
    if "prompt_ids" in record:
        return list(record["prompt_ids"]) + record["output_ids"]
    text = tokenizer.apply_chat_template(record["messages"], tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def _windows(ids: list[int], max_len: int) -> list[list[int]]:
    return [ids[i:i + max_len] for i in range(0, len(ids), max_len)]


def draft_vocabulary(sequences: list[list[int]], size: int, vocab: int) -> mx.array:
    """The ``size`` most frequent token ids in the data, ascending (ties: the
    lower id); fewer if the data has fewer distinct tokens and ``size`` is
    the whole vocabulary."""
    counts = np.bincount(np.concatenate([np.asarray(s) for s in sequences]), minlength=vocab)
    size = min(size, vocab)
    top = np.argsort(-counts, kind="stable")[:size]
    return mx.array(np.sort(top).astype(np.int32))


def batches(sequences: list[list[int]], batch_size: int, rng: np.random.Generator):
    """Endless batches: (tokens [B, T], mask [B, T]) right-padded to the
    longest, sequences shuffled once per pass."""
    while True:
        order = rng.permutation(len(sequences))
        for start in range(0, len(order) - batch_size + 1 if len(order) >= batch_size else 1,
                           batch_size):
            yield pad([sequences[i] for i in order[start:start + batch_size]])


def pad(group: list[list[int]]) -> tuple[mx.array, mx.array]:
    width = max(len(s) for s in group)
    tokens = np.zeros((len(group), width), np.int32)
    mask = np.zeros((len(group), width), np.float32)
    for i, s in enumerate(group):
        tokens[i, :len(s)] = s
        mask[i, :len(s)] = 1.0
    return mx.array(tokens), mx.array(mask)
