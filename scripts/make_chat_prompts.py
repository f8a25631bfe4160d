#!/usr/bin/env python
"""Chat prompts to train a drafter on: questions about Python's standard
library, or open chat (stories, explanations, letters, plans, lists).

No chat dataset can be fetched here, and a drafter trained with
``--regenerate`` needs questions, not answers: the model writes those.
``--kind stdlib`` writes one chat record per question about a public function
of a standard library module ("Explain what json.dumps does...", "Write a
short example that uses ..."), split by module; ``--kind open`` crosses a
dozen kinds of request with a few dozen subjects each, split by subject. The
held-out file's questions are about modules or subjects never trained on.
None of them is a benchmark prompt (``bench/workloads.py``, ``bench/bench_server.py``):
the subjects those use are left out.

    .venv/bin/python scripts/make_chat_prompts.py --out bench_out/prompts
    .venv/bin/python scripts/make_chat_prompts.py --kind open --out bench_out/open_prompts
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


# Open chat: (request, subjects). The benchmarks' subjects (a lighthouse
# keeper, vaccines, the French Revolution, first snow, TCP and UDP, the guitar,
# the sky's colour, a medieval blacksmith, a painting robot, hash tables, the
# ocean, a council's plan, the water cycle, CSV parsing) are not among them.
OPEN = (
    ("Write a short story about {}.", (
        "a baker who discovers a secret recipe", "two friends lost in a desert",
        "a cat that can talk to birds", "an astronaut returning home after ten years",
        "a girl who builds a boat", "a detective solving a mystery on a train",
        "a dragon afraid of fire", "a musician who loses her hearing",
        "a village where it never stops raining", "an old clock that runs backwards",
        "a boy who finds a door in the forest", "a chess player facing a computer",
        "a farmer during a long drought", "a thief who returns everything he stole",
        "a penguin who wants to fly", "the last bookshop in a city")),
    ("Explain {} in simple terms.", (
        "how photosynthesis works", "what inflation is", "how black holes form",
        "how a refrigerator keeps food cold", "what DNA does", "how airplanes stay in the air",
        "how compound interest works", "what an earthquake is", "how the internet routes data",
        "how batteries store energy", "what a recession is", "how solar panels work",
        "how the heart pumps blood", "what machine learning is", "how tides work",
        "why leaves change colour in autumn")),
    ("Write a poem about {}.", (
        "a quiet morning at the sea", "an old oak tree", "the night sky over the desert",
        "a city waking up", "friendship", "a long train journey", "the smell of rain",
        "a forgotten garden", "the moon", "a mountain lake", "spring flowers",
        "a lost letter")),
    ("Give me a plan for {}.", (
        "running a marathon in six months", "learning Spanish in a year",
        "saving money for a house", "starting a vegetable garden",
        "writing a novel in three months", "getting better sleep",
        "organising a family reunion", "learning to cook healthy meals",
        "preparing for a job interview", "starting a small online business",
        "learning to swim as an adult", "reading fifty books in a year")),
    ("Describe a typical day of {}.", (
        "a nurse in a busy hospital", "a Roman soldier", "a lighthouse engineer in the Arctic",
        "a beekeeper", "a software engineer", "a fisherman in a small village",
        "a Victorian schoolteacher", "an airline pilot", "a zookeeper",
        "a farmer in ancient Egypt", "a chef in a restaurant kitchen", "a park ranger")),
    ("What were the main causes of {}? Answer in a few paragraphs.", (
        "the fall of the Roman Empire", "the First World War", "the Great Depression",
        "the Industrial Revolution", "the American Civil War", "the end of the Cold War",
        "the Renaissance", "the collapse of the Soviet Union", "the Black Death's spread",
        "the Protestant Reformation")),
    ("Write a letter to {}.", (
        "a neighbour asking them to keep the noise down",
        "a teacher thanking them for a great year", "a landlord about a broken heater",
        "a friend who moved to another country", "a company complaining about a late order",
        "your future self in ten years", "a local newspaper about the lack of parks",
        "a grandparent describing your new job", "a hotel asking for a refund",
        "a school inviting parents to a fair")),
    ("List ten {}, one per line, each with a short explanation.", (
        "tips for studying effectively", "healthy breakfast ideas", "famous inventions",
        "ways to reduce stress", "board games for families", "things to pack for a camping trip",
        "habits of successful people", "facts about the moon", "countries worth visiting",
        "ways to save energy at home", "classic novels everyone should read",
        "questions to ask before buying a car")),
    ("What is the difference between {}? Give an example of each.", (
        "weather and climate", "a virus and a bacterium", "stocks and bonds",
        "a simile and a metaphor", "speed and velocity", "an alligator and a crocodile",
        "renting and buying a home", "mass and weight", "a democracy and a republic",
        "baking soda and baking powder")),
    ("Why {}? Explain it to a curious child.", (
        "do we dream", "do cats purr", "is the ocean salty", "do we have seasons",
        "do stars twinkle", "do onions make us cry", "do birds migrate",
        "does ice float on water", "do we need to sleep", "do volcanoes erupt")),
    ("Describe {} as if you were a tour guide.", (
        "the city of Paris", "the Grand Canyon", "a rainforest", "the pyramids of Giza",
        "the streets of Tokyo", "an old castle in Scotland", "the Great Barrier Reef",
        "the city of Rome")),
    ("Give me advice on {}.", (
        "how to make new friends in a new city", "how to ask for a raise",
        "how to train a puppy", "how to give a good presentation",
        "how to deal with a difficult coworker", "how to start journaling",
        "how to choose a good laptop", "how to keep houseplants alive")),
)


# Each open question is asked plainly and in these manners, so a drafter
# sees the same subject written several ways.
MANNERS = ("", " Keep it short.", " Make it fun to read.", " Use simple words.")


def open_questions() -> list[tuple[str, str]]:
    """(subject, question) for every open-chat request, subject and manner."""
    return [(subject, ask.format(subject) + manner)
            for ask, subjects in OPEN for subject in subjects for manner in MANNERS]


def held_out(module_name: str, fraction: float) -> bool:
    digest = hashlib.sha256(module_name.encode()).digest()
    return digest[0] / 256 < fraction


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="bench_out/prompts", help="folder for train.jsonl and "
                   "held_out.jsonl")
    p.add_argument("--kind", choices=("stdlib", "open"), default="stdlib",
                   help="questions about the standard library, or open chat")
    p.add_argument("--held-out", type=float, default=0.15,
                   help="share of the modules (subjects) whose questions are held out")
    args = p.parse_args(argv)
    folder = Path(args.out)
    folder.mkdir(parents=True, exist_ok=True)
    if args.kind == "open":
        keyed = open_questions()
    else:
        keyed = [(m, q) for m in MODULES for q in questions(m)]
    counts = {}
    files = {name: (folder / f"{name}.jsonl").open("w") for name in ("train", "held_out")}
    for key, q in keyed:
        split = "held_out" if held_out(key, args.held_out) else "train"
        files[split].write(json.dumps({"messages": [{"role": "user", "content": q}]}) + "\n")
        counts[split] = counts.get(split, 0) + 1
    for f in files.values():
        f.close()
    print(json.dumps({"folder": str(folder), **counts}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
