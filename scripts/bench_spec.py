"""Benchmark n-gram speculative decoding against plain decoding, in process.

For each model, workload and batch size B, one run drives the scheduler
directly (no HTTP) with the same loaded model and the same prompts under
several configurations, side by side:

- ``none``: no speculation (``--spec-decode none``);
- ``ngram``: n-gram speculation with the dynamic controller on (the default
  ``SpecDecodeConfig(mode="ngram")``, at most ``--k`` drafts per step);
- ``suffix`` (with ``--suffix``): the suffix proposer (prompt lookup, else
  earlier requests' outputs), controller on;
- ``k=N`` (with ``--sweep-k``): n-gram speculation at a fixed k, controller off
  (``dynamic=False, adaptive_k=False, num_speculative_tokens=N``);
- ``draft`` and ``ngram,draft`` (with ``--draft MODEL``; ``suffix,draft`` too
  with ``--suffix``): the draft model alone, and mixed per row with the cheap
  proposer (``proposer/mixed.py``), controller on.

Workloads (chat-templated prompts, temperature 0 unless ``--temperature``):

- ``code-edit``: a real source file of this repository (100 to 140 lines, as of
  ``PROMPT_COMMIT``) and the task to rename one identifier everywhere and return
  the whole file, nothing else;
- ``extraction``: a document of 30 to 45 lines (a README excerpt, a generated
  CSV table, a generated log) and the task to copy the matching lines
  verbatim;
- ``chat``: ordinary open questions, where n-gram lookup has little to copy;
- ``repeated`` (asked for by name): one task, a JSON record with the same keys,
  on 24 standard-library functions' docstrings: outputs resemble earlier
  outputs, not their own prompt (best measured with ``--steady``);
- ``edit-and-chat`` (asked for by name): code-edit and chat prompts in turn,
  so that a batch holds rows that copy beside rows of open prose;
- ``agent-loop`` (asked for by name): the last turn of a coding agent's
  conversation on a standard-library function: the task, a read_file call,
  the file's text as the tool result, a first edit the tool refused, and the
  request to emit the whole edited function again: the output copies the
  tool result, and its scaffolding repeats from conversation to conversation.

A wave submits B requests at once (the workload's prompts in turn) to a
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
times, configurations interleaved (none, ngram, ..., none, ngram, ...) to
spread drift over all of them; tables show medians over repeats, and sums over
repeats for the speculation counters and the identical-output counts.

Run it from the repository root (re-executes itself with OpenBLAS preloaded):

    .venv/bin/python scripts/bench_spec.py
    .venv/bin/python scripts/bench_spec.py --models qwen2.5-coder-0.5b-instruct \\
        --workloads code-edit --batch-sizes 1 --sweep-k 2 4 6 8 10 12
    .venv/bin/python scripts/bench_spec.py --models smollm2-135m-instruct \\
        --workloads chat --batch-sizes 1 4 16 --chat-max-tokens 64

Results also go to ``bench_out/bench_spec.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT_DIR = ROOT / "bench_out"
sys.path.insert(0, str(ROOT))

from mlx_lm_server.blas import ensure_fast_blas  # noqa: E402  (no MLX import)

DEFAULT_MODELS = ["smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct"]
WORKLOADS = ["code-edit", "extraction", "chat", "repeated", "agent-loop", "edit-and-chat"]


def progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---------------------------------------------------------------- prompts

# (file as of PROMPT_COMMIT below, lines kept, identifier, new name)
CODE_EDITS = [
    ("mlx_lm_server/scheduler.py", 120, "RequestHandle", "RequestStream"),
    ("mlx_lm_server/spec_decode/controller.py", 120, "expected_tokens", "emitted_per_step"),
    ("mlx_lm_server/spec_decode/metrics.py", 141, "SpecCounts", "SpeculationCounts"),
    ("mlx_lm_server/blas.py", 120, "find_openblas", "locate_openblas"),
    ("mlx_lm_server/spec_decode/proposer/ngram.py", 104, "NGramIndex", "SuffixIndex"),
    ("mlx_lm_server/spec_decode/cache_utils.py", 120, "RaggedKVCache", "ShrinkableKVCache"),
    ("mlx_lm_server/api.py", 120, "APIError", "RequestError"),
    ("mlx_lm_server/spec_decode/verifier.py", 114, "greedy_verify", "verify_greedy"),
]

CHAT = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how vaccines train the immune system, in simple terms.",
    "What are the main causes of the French Revolution? Answer in a few paragraphs.",
    "Write a poem about the first snow of winter in a big city.",
    "Explain the difference between TCP and UDP, with an example of when to use each.",
    "Give me a plan for learning to play the guitar in three months.",
    "Why is the sky blue? Explain it to a curious twelve-year-old.",
    "Describe a typical day of a medieval blacksmith.",
]


# Short, and repetitive enough that n-gram configurations verify drafts.
WARMUP = "Repeat exactly: one two three four five six seven eight nine ten."


# The code-edit prompts are these files as of this commit, so that runs at
# different commits (before and after a change) edit the same text.
PROMPT_COMMIT = "9456031"


def repo_file(path: str) -> str:
    """The file as of ``PROMPT_COMMIT`` (else HEAD, else as on disk)."""
    for rev in (PROMPT_COMMIT, "HEAD"):
        try:
            return subprocess.run(["git", "show", f"{rev}:{path}"], cwd=ROOT, check=True,
                                  capture_output=True, text=True).stdout
        except (OSError, subprocess.CalledProcessError):
            continue
    return (ROOT / path).read_text()


def head_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, check=True,
                              capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def code_edit_prompts() -> list[str]:
    out = []
    for path, lines, old, new in CODE_EDITS:
        src = "".join(repo_file(path).splitlines(keepends=True)[:lines])
        if old not in src:
            raise SystemExit(f"error: {old!r} is not in the first {lines} lines of {path}")
        out.append(
            f"Here is a Python file:\n\n```python\n{src}```\n\n"
            f"Rename `{old}` to `{new}` everywhere in this file (definition, uses, "
            "comments and docstrings). Output the complete modified file, from its first "
            "line to its last, in one ```python code block, and nothing else."
        )
    return out


def csv_table(n: int = 30) -> str:
    rng = random.Random(0)
    first = ["Anna", "Ben", "Chloe", "David", "Emma", "Felix", "Grace", "Hugo", "Ines", "Jonas"]
    last = ["Martin", "Schmidt", "Rossi", "Dubois", "Novak", "Silva", "Berg", "Costa"]
    cities = ["Berlin", "Lyon", "Porto", "Milan", "Vienna", "Ghent"]
    depts = ["sales", "research", "support", "finance", "legal"]
    rows = ["id,name,city,department,salary,start_date"]
    for i in range(n):
        rows.append(
            f"{1000 + i},{rng.choice(first)} {rng.choice(last)},{rng.choice(cities)},"
            f"{rng.choice(depts)},{rng.randrange(38, 120) * 1000},"
            f"20{rng.randrange(10, 25)}-{rng.randrange(1, 13):02d}-{rng.randrange(1, 29):02d}"
        )
    return "\n".join(rows)


def log_text(n: int = 30) -> str:
    rng = random.Random(1)
    levels = ["INFO"] * 6 + ["WARN"] * 2 + ["ERROR"]
    events = [
        "request {r} finished in {ms} ms", "cache miss for key user:{r}",
        "connection from 10.0.{a}.{b} closed", "retrying upload of chunk {r} (attempt {a})",
        "disk usage at {a}% on /var/data", "worker {a} restarted after {ms} ms",
        "timeout talking to db-{a} after {ms} ms", "queue depth {r} above limit",
    ]
    lines = []
    for i in range(n):
        ev = rng.choice(events).format(r=rng.randrange(100, 9999), ms=rng.randrange(5, 3000),
                                       a=rng.randrange(1, 99), b=rng.randrange(1, 254))
        lines.append(f"2026-11-21 09:{i // 60:02d}:{i % 60:02d} {rng.choice(levels):5} "
                     f"[svc-{rng.randrange(1, 6)}] {ev}")
    return "\n".join(lines)


def extraction_prompts() -> list[str]:
    # The README's request and behaviour notes (lines 38 to 80).
    readme = "".join(repo_file("README.md").splitlines(keepends=True)[37:80])
    table, log = csv_table(), log_text()

    def lines_with(doc, word):
        return (f"Copy, verbatim and in their original order, every line of the document "
                f"below that contains the word \"{word}\". Output only those lines, one per "
                f"line, nothing else.\n\nDocument:\n\n{doc}")

    def rows_with(city):
        return (f"From the CSV table below, copy every row whose city is {city}, verbatim, "
                f"with the header line first. Output only CSV, nothing else.\n\n{table}")

    return [
        lines_with(readme, "request"),
        rows_with("Lyon"),
        lines_with(log, "ERROR"),
        lines_with(readme, "token"),
        rows_with("Vienna"),
        lines_with(log, "WARN"),
    ]


# Functions of Python's standard library whose docstrings the repeated task
# reads: the first 24 make a wave, the rest keep steady clients from asking
# about one function twice within a window (suffix would copy its own
# earlier answer: not the work this task stands for). Names missing from
# this Python are skipped.
REPEATED_FUNCTIONS = [
    "textwrap.wrap", "textwrap.fill", "textwrap.dedent", "textwrap.indent", "json.dumps",
    "json.loads", "os.path.join", "os.path.splitext", "os.path.relpath", "shutil.copyfile",
    "shutil.rmtree", "shutil.which", "shutil.make_archive", "shutil.disk_usage",
    "random.choices", "random.sample", "statistics.median", "statistics.quantiles",
    "fnmatch.fnmatch", "glob.glob", "base64.b64encode", "difflib.unified_diff",
    "heapq.merge", "bisect.insort_left",
    # steady clients only
    "textwrap.shorten", "json.dump", "json.load", "shutil.copy", "shutil.copy2",
    "shutil.copymode", "shutil.copystat", "shutil.copytree", "shutil.get_terminal_size",
    "shutil.move", "shutil.unpack_archive", "shutil.register_archive_format",
    "statistics.correlation", "statistics.covariance", "statistics.fmean",
    "statistics.geometric_mean", "statistics.harmonic_mean", "statistics.linear_regression",
    "statistics.mean", "statistics.median_grouped", "statistics.mode", "statistics.multimode",
    "statistics.pvariance", "statistics.variance", "glob.iglob", "base64.a85encode",
    "base64.b32decode", "base64.b64decode", "base64.urlsafe_b64encode", "difflib.context_diff",
    "difflib.get_close_matches", "difflib.ndiff", "difflib.restore", "string.capwords",
    "re.findall", "re.split", "re.sub", "re.subn", "urllib.parse.parse_qs",
    "urllib.parse.parse_qsl", "urllib.parse.quote", "urllib.parse.unquote",
    "urllib.parse.urlencode", "urllib.parse.urlparse", "urllib.parse.urlunparse", "html.escape",
    "html.unescape", "functools.lru_cache", "functools.singledispatch",
    "functools.update_wrapper", "tempfile.NamedTemporaryFile", "tempfile.TemporaryFile",
    "tempfile.mkdtemp", "tempfile.mkstemp", "logging.basicConfig", "logging.getLevelName",
    "subprocess.check_output", "subprocess.getstatusoutput", "subprocess.list2cmdline",
    "subprocess.run", "email.utils.formataddr", "email.utils.formatdate",
    "email.utils.make_msgid", "mimetypes.guess_extension", "mimetypes.guess_type",
    "ipaddress.collapse_addresses", "ipaddress.ip_address", "ipaddress.ip_network",
    "ipaddress.summarize_address_range", "secrets.token_bytes", "secrets.token_hex",
    "secrets.token_urlsafe", "uuid.uuid1", "hmac.new", "gzip.compress", "gzip.open",
    "inspect.getattr_static", "inspect.getcallargs", "inspect.getclosurevars",
    "inspect.getfullargspec", "inspect.getsource", "inspect.unwrap", "ast.dump",
    "ast.get_docstring", "ast.literal_eval", "tokenize.detect_encoding", "tokenize.untokenize",
    "dis.get_instructions", "traceback.format_exception", "traceback.print_exception",
    "traceback.walk_stack", "warnings.filterwarnings", "warnings.simplefilter",
    "contextlib.contextmanager", "dataclasses.asdict", "dataclasses.field",
    "dataclasses.make_dataclass", "dataclasses.replace", "typing.get_type_hints",
    "typing.overload", "typing.cast", "platform.platform", "platform.uname",
    "urllib.request.urlopen", "urllib.request.urlretrieve", "codecs.open",
]


def repeated_prompts() -> list[str]:
    """The same task on functions' docstrings (text nobody here wrote): a
    JSON record with the same keys each time, no ``response_format``. The
    outputs resemble earlier outputs more than their own prompt."""
    import importlib
    import inspect

    out = []
    for name in REPEATED_FUNCTIONS:
        module, _, attr = name.rpartition(".")
        function = getattr(importlib.import_module(module), attr, None)
        if function is None:
            continue
        doc = inspect.getdoc(function) or ""
        doc = "\n".join(doc.splitlines()[:25])
        out.append(
            f"Here is the documentation of the Python function `{name}`:\n\n{doc}\n\n"
            "Write a JSON object describing it, with exactly these keys in this order: "
            '"name" (the full name), "summary" (one sentence), "parameters" (a list of '
            'objects with "name" and "description"), "returns" (one sentence), "raises" '
            "(a list of exception names, possibly empty). Output only the JSON object.")
    return out


# Standard-library functions of 10 to 40 lines for the agent loop.
AGENT_FUNCTIONS = [
    "textwrap.indent", "shlex.quote", "fnmatch.filter", "json.dumps", "glob.escape",
    "string.capwords", "base64.b64encode", "html.escape", "textwrap.dedent",
    "urllib.parse.urldefrag", "difflib.get_close_matches", "shutil.copyfileobj",
    # More, so that a long window at B=4 meets no conversation twice (the
    # index would hold its earlier answer).
    "textwrap.fill", "textwrap.shorten", "shlex.split", "calendar.monthrange",
    "calendar.leapdays", "statistics.mean", "statistics.median", "statistics.mode",
    "glob.glob", "html.unescape", "base64.b64decode", "colorsys.rgb_to_hsv",
    "colorsys.hsv_to_rgb", "ipaddress.ip_address", "fnmatch.fnmatch", "random.shuffle",
    "urllib.parse.quote", "json.loads",
]


def agent_loop_prompts() -> list[list[dict]]:
    """Conversations, as chat messages (tool turns as text, so that any chat
    template takes them)."""
    import importlib
    import inspect

    out = []
    for name in AGENT_FUNCTIONS:
        module_name, _, attr = name.rpartition(".")
        module = importlib.import_module(module_name)
        source = inspect.getsource(getattr(module, attr))
        path = inspect.getsourcefile(module).split("/lib/")[-1]
        call = json.dumps({"name": "read_file", "arguments": {"path": path, "symbol": attr}})
        out.append([
            {"role": "system", "content": "You are a coding agent. Tools: read_file(path, "
             "symbol), edit_file(path, old, new). Call a tool as <tool_call>JSON</tool_call>."},
            {"role": "user", "content": f"Add type hints to `{name}` and keep its "
             "behaviour. Read it first."},
            {"role": "assistant", "content": f"<tool_call>{call}</tool_call>"},
            {"role": "user", "content": f"<tool_result>\n{source}</tool_result>"},
            {"role": "assistant", "content": "I will add the type hints with edit_file."},
            {"role": "user", "content": "<tool_result>error: edit_file: the old text was not "
             "found (whitespace differs)</tool_result>\nEmit the whole edited function "
             "instead, in one Python code block, nothing else."},
        ])
    return out


def workload_prompts(name: str) -> list:
    return {"code-edit": code_edit_prompts, "extraction": extraction_prompts,
            "chat": lambda: list(CHAT), "repeated": repeated_prompts,
            "agent-loop": agent_loop_prompts, "edit-and-chat": edit_and_chat_prompts}[name]()


def edit_and_chat_prompts() -> list[str]:
    """Code edits and open questions in turn: a batch holds both kinds."""
    return [p for pair in zip(code_edit_prompts(), CHAT) for p in pair]


def chat_tokens(tokenizer, text) -> list[int]:
    """A user text, or a whole conversation (a list of messages)."""
    messages = text if isinstance(text, list) else [{"role": "user", "content": text}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(prompt, add_special_tokens=False)


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
    for k in args.sweep_k or []:
        configs.append((f"k={k}", SpecDecodeConfig(mode="ngram", num_speculative_tokens=k,
                                                   dynamic=False, adaptive_k=False)))
    return configs


def make_scheduler(model, tokenizer, spec, width: int, never_verify: bool = False):
    """``never_verify``: the engine's controller decides every step, and the
    step stays plain (``--engine-plain``)."""
    from mlx_lm_server.scheduler import Scheduler
    from mlx_lm_server.spec_decode import make_engine

    engine = make_engine(model, spec, tokenizer) if spec is not None else None
    if never_verify:
        from bench_plain_path import plain_only

        plain_only(engine.controller)
    if engine is not None and TRACE is not None:
        import step_trace

        step_trace.attach(engine, TRACE["records"], TRACE["label"])
    s = Scheduler(model, tokenizer, max_batch_size=width, prefill_batch_size=width,
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

async def collect(handle) -> dict:
    from mlx_lm_server.requests import DoneEvent, ErrorEvent, TextEvent

    ids, first = [], None
    while True:
        event = await handle.events.get()
        if isinstance(event, TextEvent):
            if event.token_ids and first is None:
                first = time.perf_counter()
            ids.extend(event.token_ids)
        elif isinstance(event, ErrorEvent):
            raise RuntimeError(f"request failed: {event.message}")
        elif isinstance(event, DoneEvent):
            done = time.perf_counter()
            return {"ids": ids, "first": first if first is not None else done, "done": done,
                    "finish": event.finish_reason, "tokens": event.completion_tokens}


async def submit_all(scheduler, requests) -> tuple[float, list[dict]]:
    start = time.perf_counter()
    # No await between submits: the inference thread sees them all at once.
    handles = [scheduler.submit(r) for r in requests]
    return start, await asyncio.gather(*[collect(h) for h in handles])


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
    from mlx_lm_server.spec_decode.config import k_buckets

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


# --trace: every engine's steps, recorded by scripts/step_trace.py.
TRACE = None

# --temperature: requests sample at it, request i with seed i (greedy when 0).
TEMPERATURE = 0.0


def sampling(i: int):
    from mlx_lm_server.sampling import SamplingParams

    if TEMPERATURE == 0.0:
        return SamplingParams(temperature=0.0)
    return SamplingParams(temperature=TEMPERATURE, seed=i)


def run_wave(scheduler, prompts: list[list[int]], max_tokens: int) -> dict:
    from mlx_lm_server.requests import GenerationRequest

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
    decode_tokens = sum(max(r["tokens"] - 1, 0) for r in results)
    return {
        "tokens": tokens,
        "decode_tok_s": decode_tokens / max(end - first, 1e-9),
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
    from mlx_lm_server.requests import DoneEvent, ErrorEvent, GenerationRequest, TextEvent

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


def batch_prompts(prompts: list[list[int]], B: int) -> list[list[int]]:
    return [prompts[i % len(prompts)] for i in range(B)]


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
                                  "prompt": prompts[i % len(prompts)]})
    return diffs


def check_gaps(model, diffs: list[dict], waves: dict, limit: int) -> None:
    for d in diffs[:limit]:
        base = waves[("none", d["B"])][d["repeat"]]["ids"][d["request"]]
        d["top2_logit_gap"] = top2_gap(model, d["prompt"] + base[: d["position"]])
        progress(f"  divergence: {d['config']} B={d['B']} request {d['request']} at token "
                 f"{d['position']}: top-2 logit gap {d['top2_logit_gap']:.2e}")


# Two-sided 95% Student t quantiles by degrees of freedom.
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306,
       9: 2.262, 10: 2.228, 15: 2.131, 20: 2.086, 30: 2.042}


def ratio_interval(ratios: list[float]) -> tuple[float, float]:
    """95% confidence interval of the mean of per-repeat ratios (each repeat's
    configurations run back to back, so drift mostly cancels within a repeat)."""
    n = len(ratios)
    mean = statistics.fmean(ratios)
    if n < 2:
        return mean, mean
    t = T95[max(d for d in T95 if d <= n - 1)]
    half = t * statistics.stdev(ratios) / n ** 0.5
    return mean - half, mean + half


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


def bench_workload(model, tokenizer, model_name: str, workload: str, args) -> dict:
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
                                              never_verify=name == "eplain")
            tic = time.perf_counter()
            run_wave(schedulers[name], [chat_tokens(tokenizer, WARMUP)], 16)
            progress(f"  warm-up {name}: {time.perf_counter() - tic:.1f}s")
        waves = {}
        for B in args.batch_sizes:
            batch = batch_prompts(prompts, B)
            for rep in range(args.repeats):
                for name, _ in configs:
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
    p.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 4, 16])
    p.add_argument("--k", type=int, default=8, help="max drafts per step for ngram (controller on)")
    p.add_argument("--sweep-k", nargs="*", type=int, default=[],
                   help="also run fixed-k configurations (controller off) for these k")
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
                   help="record every speculative step's timings (scripts/step_trace.py) "
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

    from mlx_lm_server.blas import openblas_loaded

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
            out["results"].append(bench_workload(model, tokenizer, path.name, workload, args))
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
    sys.exit(main())
