"""The benchmarks' workloads: prompts built from real text no one here wrote
for them (this repository's sources at a fixed commit, Python's standard
library), shared by ``bench_spec.py``, ``bench_acceptance.py`` and
``profile_step.py``.

Workloads (chat-templated prompts, temperature 0 unless ``--temperature``):

- ``code-edit``: a real source file of this repository (100 to 140 lines, as of
  ``PROMPT_COMMIT``) and the task to rename one identifier everywhere and return
  the whole file, nothing else;
- ``extraction``: a document of 30 to 45 lines (a README excerpt, a generated
  CSV table, a generated log) and the task to copy the matching lines
  verbatim;
- ``chat``: ordinary open questions, where n-gram lookup has little to copy;
- ``repeated`` (asked for by name): one task, a JSON record with the same keys,
  on 130 standard-library functions' docstrings: outputs resemble earlier
  outputs, not their own prompt (best measured with ``--steady``);
- ``edit-and-chat`` (asked for by name): code-edit and chat prompts in turn,
  so that a batch holds rows that copy beside rows of open prose;
- ``agent-loop`` (asked for by name): the last turn of a coding agent's
  conversation on one of 30 standard-library functions: the task, a read_file call,
  the file's text as the tool result, a first edit the tool refused, and the
  request to emit the whole edited function again: the output copies the
  tool result, and its scaffolding repeats from conversation to conversation.
"""

from __future__ import annotations

import json
import random
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

WORKLOADS = ["code-edit", "extraction", "chat", "repeated", "agent-loop", "edit-and-chat"]


# (file as of PROMPT_COMMIT below, lines kept, identifier, new name)
CODE_EDITS = [
    ("mlx_lm_server/serving/scheduler.py", 120, "RequestHandle", "RequestStream"),
    ("mlx_lm_server/spec_decode/controller.py", 120, "expected_tokens", "emitted_per_step"),
    ("mlx_lm_server/spec_decode/metrics.py", 141, "SpecCounts", "SpeculationCounts"),
    ("mlx_lm_server/runtime/blas.py", 120, "find_openblas", "locate_openblas"),
    ("mlx_lm_server/spec_decode/proposer/ngram.py", 104, "NGramIndex", "SuffixIndex"),
    ("mlx_lm_server/spec_decode/cache_utils.py", 120, "RaggedKVCache", "ShrinkableKVCache"),
    ("mlx_lm_server/http/openai_schema.py", 120, "APIError", "RequestError"),
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


def code_edit_sources() -> list[str]:
    """The files of ``code_edit_prompts()``, in the same order, as their prompts
    hold them: what an edit's answer mostly copies (a Predicted Output)."""
    return ["".join(repo_file(path).splitlines(keepends=True)[:lines])
            for path, lines, _, _ in CODE_EDITS]


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


def agent_function(name: str) -> tuple[str, str, str]:
    """An ``AGENT_FUNCTIONS`` entry's (path as the agent names it, function
    name, source): what its read_file call returns."""
    import importlib
    import inspect

    module_name, _, attr = name.rpartition(".")
    module = importlib.import_module(module_name)
    source = inspect.getsource(getattr(module, attr))
    return inspect.getsourcefile(module).split("/lib/")[-1], attr, source


def agent_loop_prompts() -> list[list[dict]]:
    """Conversations, as chat messages (tool turns as text, so that any chat
    template takes them)."""
    out = []
    for name in AGENT_FUNCTIONS:
        path, attr, source = agent_function(name)
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
