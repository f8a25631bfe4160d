#!/usr/bin/env python
"""Chat prompts about Python's standard library, to train a drafter on.

No chat dataset can be fetched here, and a drafter trained with
``--regenerate`` needs questions, not answers: the model writes those. This
writes one chat record per question about a public function of a standard
library module ("Explain what json.dumps does...", "Write a short example
that uses ..."), split by module into a training file and a held-out file,
so that held-out questions are about modules never trained on. None of them
is a benchmark prompt (``workloads.py``).

    .venv/bin/python scripts/make_chat_prompts.py --out bench_out/prompts
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import inspect
import json
import sys
from pathlib import Path

MODULES = ("abc argparse base64 bisect calendar collections colorsys contextlib copy csv "
           "dataclasses datetime decimal difflib enum fnmatch fractions functools glob gzip "
           "hashlib heapq hmac html itertools json keyword math operator os.path pathlib "
           "pickle platform pprint queue random re secrets shlex shutil statistics string "
           "struct tempfile textwrap threading time timeit tokenize traceback types typing "
           "unicodedata urllib.parse uuid warnings weakref zipfile zlib").split()

ASKS = ("Explain what `{name}` does in Python, with a short example.",
        "Write a small Python function that uses `{name}`, and explain it.",
        "When would I use `{name}`? Give one realistic example.")


def questions(module_name: str) -> list[str]:
    module = importlib.import_module(module_name)
    names = sorted(n for n, f in vars(module).items()
                   if not n.startswith("_") and (inspect.isfunction(f) or inspect.isbuiltin(f)
                                                 or inspect.isclass(f))
                   and (getattr(f, "__module__", None) or "").lstrip("_").split(".")[0]
                   == module.__name__.lstrip("_").split(".")[0])
    out = []
    for i, name in enumerate(names[:12]):
        out.append(ASKS[i % len(ASKS)].format(name=f"{module_name}.{name}"))
    return out


def held_out(module_name: str, fraction: float) -> bool:
    digest = hashlib.sha256(module_name.encode()).digest()
    return digest[0] / 256 < fraction


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="bench_out/prompts", help="folder for train.jsonl and "
                   "held_out.jsonl")
    p.add_argument("--held-out", type=float, default=0.15,
                   help="share of the modules whose questions are held out")
    args = p.parse_args(argv)
    folder = Path(args.out)
    folder.mkdir(parents=True, exist_ok=True)
    counts = {}
    files = {name: (folder / f"{name}.jsonl").open("w") for name in ("train", "held_out")}
    for module_name in MODULES:
        split = "held_out" if held_out(module_name, args.held_out) else "train"
        for q in questions(module_name):
            files[split].write(json.dumps({"messages": [{"role": "user", "content": q}]}) + "\n")
            counts[split] = counts.get(split, 0) + 1
    for f in files.values():
        f.close()
    print(json.dumps({"folder": str(folder), **counts}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
