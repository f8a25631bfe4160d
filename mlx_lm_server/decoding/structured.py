"""Structured output: a grammar per request, enforced as a token mask per step.

A request's ``response_format`` (or a tool choice) becomes an llguidance
grammar; its ``Constraint`` follows exactly the tokens fed to the model and
gives, for the next position, the bitmask of tokens the grammar allows
(``[ceil(V / 32)]`` int32 words, bit ``t % 32`` of word ``t // 32`` for
token t). Masks are filled on the host, while the device runs the forward
they apply to, and applied on the device, so the distribution every sampler
and the verifier see is the constrained one: speculation stays exact.

llguidance was chosen by measurement (``scripts/bench/bench_grammar.py``): at
Qwen2.5's 151,936-token vocabulary and batch 32 it fills a step's masks in
0.6 ms (0.4 ms with its thread pool) and compiles a schema in 0.4 ms;
outlines-core needs 2.4 ms per step and 0.75 s to compile each schema;
xgrammar's Linux wheels need PyTorch and the CUDA toolkit.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any, Optional

import mlx.core as mx
import numpy as np

from ..runtime.mlx_lm_adapter import hf_tokenizer
from ..text.reasoning import Thinking

# JSON as ``json.dumps`` writes it: ", " and ": " between items, no other
# whitespace. Free whitespace lets small models loop on newlines forever,
# and fixed separators make more tokens forced (free to speculate).
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """A schema or grammar the engine cannot enforce (the message names why)."""


def json_schema_grammar(schema: Any) -> str:
    """The llguidance grammar of a JSON schema (``True`` or ``{}``: any JSON
    value; ``{"type": "object"}``: any object)."""
    import llguidance

    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    except (ValueError, TypeError) as e:
        raise GrammarError(f"invalid JSON schema: {e}") from None


def lark_grammar(lark: str) -> str:
    import llguidance

    return llguidance.LLMatcher.grammar_from_lark(lark)


def logits_width(model, tokenizer) -> int:
    """V of the model's logits: its configured vocabulary, which can exceed
    the tokenizer's (Qwen2.5: 151,936 logits for 151,665 tokens)."""
    args = getattr(model, "args", None)
    return int(getattr(args, "vocab_size", None) or len(tokenizer))


class GrammarTokenizer:
    """llguidance's view of a model's tokenizer, built once (about a second
    for a 150k vocabulary) on first use."""

    def __init__(self, tokenizer, vocab_size: int):
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        # Host time spent filling masks, over every request (benchmarks).
        self.mask_seconds = 0.0
        self._built = None
        self._lock = threading.Lock()

    def get(self):
        with self._lock:
            if self._built is None:
                import llguidance.hf

                hf = hf_tokenizer(self._tokenizer)
                eos = sorted(getattr(self._tokenizer, "eos_token_ids", None)
                             or [hf.eos_token_id])
                self._built = llguidance.hf.from_tokenizer(hf, n_vocab=self.vocab_size,
                                                           eos_token=eos)
            return self._built

    def literal(self, text: str) -> str:
        """``text`` as a Lark terminal: the token itself where ``text`` is one
        special token (Qwen's ``<tool_call>``: llguidance never matches
        special tokens by their text), else the string."""
        hf = hf_tokenizer(self._tokenizer)
        ids = hf.encode(text, add_special_tokens=False)
        if len(ids) == 1 and self.get().is_special_token(ids[0]):
            return f"<[{ids[0]}]>"
        return json.dumps(text)

    def check(self, grammar: str) -> None:
        """Raise ``GrammarError`` naming what the engine cannot enforce."""
        import llguidance

        message = llguidance.LLMatcher.validate_grammar(grammar, self.get())
        if message:
            # Its multi-line errors (a regex with a caret under the fault) in one line.
            raise GrammarError(" ".join(line.strip() for line in message.splitlines()
                                        if line.strip().strip("^"))[:500])


class Constraint:
    """One request's grammar state, following the generated tokens fed to the
    model (``tokens``). Not thread-safe: the inference thread owns it."""

    def __init__(self, tokenizer: GrammarTokenizer, grammar: str, prompt_len: int):
        import llguidance

        self.source = tokenizer
        self.matcher = llguidance.LLMatcher(tokenizer.get(), grammar)
        if self.matcher.is_error():
            raise GrammarError(self.matcher.get_error())
        self.words = (tokenizer.vocab_size + 31) // 32
        self.prompt_len = prompt_len
        self.tokens: list[int] = []
        self.forced = 0  # emitted tokens that were the only one the grammar allowed

    def sync(self, tokens: list[int]) -> None:
        """Follow ``tokens`` (the generated tokens fed so far): roll back to the
        common prefix, consume the rest."""
        have = self.tokens
        common = 0
        if tokens[: len(have)] == have:
            common = len(have)
        else:
            limit = min(len(have), len(tokens))
            while common < limit and have[common] == tokens[common]:
                common += 1
        if common < len(have):
            if not self.matcher.rollback(len(have) - common):
                raise RuntimeError(f"grammar rollback failed: {self.matcher.get_error()}")
            del have[common:]
        self.consume(tokens[common:])

    def consume(self, tokens: list[int]) -> None:
        # One at a time: llguidance's consume_tokens refuses the end of
        # sequence once the grammar is complete; consume_token takes it.
        for t in tokens:
            if not self.matcher.consume_token(t):
                raise RuntimeError(f"token {t} was fed where the grammar forbids it: "
                                   f"{self.matcher.get_error().splitlines()[0]}")
            self.tokens.append(t)

    def forced_tokens(self) -> list[int]:
        """The tokens the grammar forces next, whatever the model would say."""
        return self.matcher.compute_ff_tokens()

    def fill(self, row: np.ndarray) -> None:
        """The next position's mask into ``row`` ([words] int32, contiguous)."""
        tic = time.perf_counter()
        self.matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        self.source.mask_seconds += time.perf_counter() - tic


def allowed_counts(masks: np.ndarray) -> np.ndarray:
    """Per mask row, how many tokens it allows."""
    if hasattr(np, "bitwise_count"):
        return np.bitwise_count(masks.view(np.uint32)).sum(axis=-1)
    bits = np.unpackbits(masks.view(np.uint8), axis=-1)
    return bits.sum(axis=-1)


def apply_masks(logits: mx.array, masks: np.ndarray) -> mx.array:
    """``logits`` [..., V] with every token a mask ([..., words]) forbids at -inf."""
    V = logits.shape[-1]
    words = mx.array(masks.view(np.uint32))
    bits = (words[..., None] >> mx.arange(32, dtype=mx.uint32)) & 1
    allowed = bits.reshape(*words.shape[:-1], -1)[..., :V].astype(mx.bool_)
    return mx.where(allowed, logits, mx.array(-mx.inf, logits.dtype))


class GrammarProcessor:
    """A constraint as an upstream logits processor, for plain decode steps.

    Upstream calls it with the row's fed tokens (prompt first), the step's
    forward built but not run. The forward is started, then the mask filled
    on the host while the device computes. The grammar must first take the
    token this step feeds: when the engine has given it already (it reads
    the batch's pending tokens once, before the step), nothing waits here;
    otherwise it is read from the context, which waits for the forward.
    """

    def __init__(self, constraint: Constraint):
        self.constraint = constraint
        self._row = np.empty((constraint.words,), np.int32)

    def __call__(self, context: mx.array, logits: mx.array) -> mx.array:
        mx.async_eval(logits)
        c = self.constraint
        generated = context.shape[0] - c.prompt_len
        if generated == len(c.tokens) + 1:
            c.consume([context[-1].item()])
        elif generated != len(c.tokens):
            c.sync(context[c.prompt_len:].tolist())
        c.fill(self._row)
        if allowed_counts(self._row) == 1:
            c.forced += 1
        return apply_masks(logits, self._row)


def tool_call_grammar(tokenizer: GrammarTokenizer, start: str, end: str, tools: list[dict],
                      multiple: bool) -> str:
    """Tool calls only, each ``start {"name": ..., "arguments": {...}} end``
    (mlx-lm's JSON tool format, Qwen's among others), its arguments held to
    the function's parameter schema; one call, or one or more."""
    calls = []
    for tool in tools:
        fn = tool["function"]
        calls.append({
            "type": "object",
            "properties": {"name": {"const": fn["name"]},
                           "arguments": fn.get("parameters") or {"type": "object"}},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        })
    body = {"anyOf": calls} if len(calls) > 1 else calls[0]
    body["x-guidance"] = JSON_OPTIONS
    newline = json.dumps("\n")
    return lark_grammar(
        f"start: call{f' ({newline} call)*' if multiple else ''}\n"
        f"call: {tokenizer.literal(start)} {newline} body {newline} {tokenizer.literal(end)}\n"
        f"body: %json {json.dumps(body)}\n")


def response_format_grammar(response_format: Optional[dict]) -> Optional[str]:
    """The grammar an OpenAI ``response_format`` asks for (None: free text)."""
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return json_schema_grammar({"type": "object"})
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict):
            raise GrammarError("response_format.json_schema must be an object "
                               "with 'name' and 'schema'")
        schema = spec.get("schema", {})
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise GrammarError(f"response_format.json_schema.schema is not JSON: {e}") from None
        if not isinstance(schema, (dict, bool)):
            raise GrammarError("response_format.json_schema.schema must be a JSON schema object")
        return json_schema_grammar(schema)
    raise GrammarError(f"response_format.type must be 'text', 'json_object' or 'json_schema', "
                       f"got {kind!r}")


def after_thinking(grammar: str, thinking: Thinking, tokenizer: GrammarTokenizer) -> str:
    """``grammar`` applied from the thinking's end marker on; the thinking
    before it is free text (any token but a special one: no end of
    sequence, no other marker). A prompt inside an open block starts there;
    otherwise the output may open a block first, or answer at once. Up to
    four whitespace characters may follow the end marker (Qwen3 writes
    ``"\\n\\n"``); the answer shown drops them (``serving/request_output.py``)."""
    llg = tokenizer.get()
    if not all(llg.is_special_token(t) for t in thinking.start[:1] + thinking.end[:1]):
        raise GrammarError("this model's thinking markers do not begin with a special token, "
                           "so a grammar cannot tell where its reasoning ends")
    start, end = (" ".join(f"<[{t}]>" for t in m) for m in (thinking.start, thinking.end))
    thought = f"THINK {end} WS?"
    head = thought if thinking.in_reasoning else f"({start} {thought})?"
    try:
        top = json.loads(grammar)
    except json.JSONDecodeError:  # Lark text, as grammar_from_lark leaves it
        top = {"grammars": [{"lark_grammar": grammar}]}
    first, *rest = top["grammars"]
    lark = (f"start: {head} @answer\n"
            "THINK: /(?s:.*)/\n"
            "WS: /[ \\t\\r\\n]{1,4}/\n")
    return json.dumps({**top, "grammars": [{"name": "thinking", "lark_grammar": lark},
                                           {**first, "name": "answer"}, *rest]})
