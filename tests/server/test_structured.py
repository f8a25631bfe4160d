"""Structured output: grammar masks, drafts walked through a grammar, outputs
that validate, greedy parity and the exact constrained distribution under
speculation, and the HTTP surface (response_format, 400s, tool_choice)."""

import json

import httpx
import jsonschema
import mlx.core as mx
import numpy as np
import pytest
from test_prompt_cache import _stop
from test_spec_engine import _assert_same_or_near_tie, _run

from mlx_lm_server.assembly import make_scheduler
from mlx_lm_server.decoding.sampling import SamplingParams
from mlx_lm_server.decoding.structured import (
    Constraint,
    allowed_counts,
    apply_masks,
    response_format_grammar,
)
from mlx_lm_server.serving.request import GenerationRequest
from mlx_lm_server.spec_decode import make_engine
from mlx_lm_server.spec_decode.config import SpecDecodeConfig
from mlx_lm_server.spec_decode.grammar import constrain_drafts, draft_masks


def _schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "out", "schema": schema, "strict": True}}


PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24},
    "age": {"type": "integer", "minimum": 0, "maximum": 130},
    "city": {"type": "string", "maxLength": 16}},
    "required": ["name", "age", "city"], "additionalProperties": False}
ORDER = {"type": "object", "properties": {
    "item": {"enum": ["apple", "bread", "milk"]},
    "quantity": {"type": "integer", "minimum": 1, "maximum": 9},
    "express": {"type": "boolean"},
    "notes": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 2}},
    "required": ["item", "quantity", "express", "notes"], "additionalProperties": False}
SCHEMAS = [PERSON, ORDER]
DOCUMENTS = [
    "Alice Smith is 42 years old and lives in Paris.",
    "Order: two loaves of bread, express delivery please, leave at the door.",
    "Bob Jones, aged 31, moved to Oslo last year.",
    "Please send 3 bottles of milk, no rush. Ring twice.",
]


def _unpacked(masks: np.ndarray, V: int) -> np.ndarray:
    return np.unpackbits(masks.view(np.uint8), axis=-1, bitorder="little")[..., :V].astype(bool)


# ---- masks and drafts -----------------------------------------------------------


def test_masks_forbid_exactly_what_the_grammar_forbids(grammar_tokenizer):
    rng = np.random.default_rng(0)
    V = grammar_tokenizer.vocab_size
    words = (V + 31) // 32
    masks = rng.integers(-2**31, 2**31, size=(3, 2, words), dtype=np.int64).astype(np.int32)
    logits = mx.array(rng.standard_normal((3, 2, V)).astype(np.float32))
    out = np.asarray(apply_masks(logits, masks))
    allowed = _unpacked(masks, V)
    assert np.array_equal(np.isneginf(out), ~allowed)
    assert np.array_equal(out[allowed], np.asarray(logits)[allowed])
    assert np.array_equal(allowed_counts(masks), allowed.sum(-1) + _unpacked(
        masks, words * 32)[..., V:].sum(-1))


def test_a_constraint_follows_the_tokens_through_rollbacks(smollm2, grammar_tokenizer):
    tokenizer = smollm2[1]
    grammar = response_format_grammar(_schema_format(PERSON))
    a = tokenizer.encode('{"name": "Ann", "age": 3', add_special_tokens=False)
    b = tokenizer.encode('{"name": "Anna", "age": 41, "city": "R', add_special_tokens=False)
    c = Constraint(grammar_tokenizer, grammar, prompt_len=0)
    row, fresh_row = (np.empty(c.words, np.int32) for _ in range(2))
    for tokens in (a, b, a[:3], b):
        c.sync(tokens)
        fresh = Constraint(grammar_tokenizer, grammar, prompt_len=0)
        fresh.consume(tokens)
        c.fill(row)
        fresh.fill(fresh_row)
        assert c.tokens == tokens and np.array_equal(row, fresh_row)


def test_drafts_are_cut_at_the_first_token_the_grammar_forbids(smollm2, grammar_tokenizer):
    tokenizer = smollm2[1]
    grammar = response_format_grammar(_schema_format(PERSON))
    c = Constraint(grammar_tokenizer, grammar, prompt_len=0)
    c.consume(tokenizer.encode('{"name": "Ann", "age": ', add_special_tokens=False))
    good = tokenizer.encode("41, ", add_special_tokens=False)
    bad = tokenizer.encode("x", add_special_tokens=False)
    drafts = good + bad + good
    # One-hot drafts stop before the forbidden token; sampled ones keep it
    # (the verifier must reject it and draw from the residual).
    assert constrain_drafts(c, drafts, 10, one_hot=True) == (good, False)
    assert constrain_drafts(c, drafts, 10, one_hot=False) == (good + bad, False)
    assert constrain_drafts(c, drafts, 1, one_hot=True) == (good[:1], False)
    # Forced tokens replace one-hot drafts that disagree with them.
    c.consume(good)
    forced = c.forced_tokens()
    assert tokenizer.decode(forced).startswith('"city":')
    assert constrain_drafts(c, bad, 10, one_hot=True) == (forced, False)
    assert constrain_drafts(c, bad, 10, one_hot=False) == (bad, False)
    assert c.tokens[-len(good):] == good  # walking drafts consumed nothing
    # Drafts that complete the document say so; what follows is cut.
    end = tokenizer.encode('"city": "Rome"}', add_special_tokens=False)
    newline = tokenizer.encode("\n", add_special_tokens=False)
    assert constrain_drafts(c, end + newline, 20, one_hot=True) == (end, True)
    assert constrain_drafts(c, end + newline, 20, one_hot=False) == (end + newline, True)


def test_draft_masks_are_the_masks_one_position_at_a_time(smollm2, grammar_tokenizer):
    tokenizer = smollm2[1]
    grammar = response_format_grammar(_schema_format(ORDER))
    text = '{"item": "milk", "quantity": 3, "express": false, "notes": []}'
    ids = tokenizer.encode(text, add_special_tokens=False)
    newline = tokenizer.encode("\n", add_special_tokens=False)
    rows = [Constraint(grammar_tokenizer, grammar, 0) for _ in range(3)]
    rows[1].consume(ids[:4])
    rows[2].consume(ids[:-3])
    # The third row's drafts complete the document, then a newline follows
    # (kept, as a draft model's would be, for the verifier to reject): the
    # mask after the end must allow only the end of sequence.
    drafts = [ids[:6], ids[4:7], ids[-3:] + newline]
    K = 8
    masks = draft_masks(rows, drafts, K, [False, False, True])
    assert masks.shape == (3, K + 1, rows[0].words)
    eos = sorted(tokenizer.eos_token_ids)
    assert np.nonzero(_unpacked(masks[2, 3], masks.shape[-1] * 32))[0].tolist() == eos
    for r, (c, d) in enumerate(zip(rows, drafts)):
        before = list(c.tokens)
        one = np.empty(c.words, np.int32)
        d = d[:3] if r == 2 else d
        for j in range(len(d) + 1):
            probe = Constraint(grammar_tokenizer, grammar, 0)
            probe.consume(before + d[:j])
            probe.fill(one)
            assert np.array_equal(masks[r, j], one), (r, j)
        assert (masks[r, len(d) + 1:] == -1).all()  # past the drafts: all allowed
        assert c.tokens == before


# ---- scheduler: outputs validate, speculation changes nothing --------------------


def _requests(tokenizer, grammar_tokenizer, n: int, temperature: float) -> list:
    reqs = []
    for i in range(n):
        schema = SCHEMAS[i % 2]
        doc = DOCUMENTS[i % len(DOCUMENTS)]
        messages = [{"role": "user", "content": f"Extract the fields as JSON.\n{doc}"}]
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        grammar = response_format_grammar(_schema_format(schema))
        reqs.append(GenerationRequest(prompt, 80, SamplingParams(temperature=temperature, seed=i),
                                      grammar=grammar))
    return reqs


def _engine(model, tokenizer, mode, draft_path):
    """None, n-gram, or a draft model."""
    if mode == "none":
        return None
    extra = {"draft_model_path": str(draft_path)} if mode == "draft" else {}
    return make_engine(model, SpecDecodeConfig(mode=mode, num_speculative_tokens=6,
                                               dynamic=False, adaptive_k=False, **extra),
                       tokenizer, "target")


@pytest.fixture(scope="module")
def constrained_runs(smollm2, smollm2_path, grammar_tokenizer):
    """Per mode: 4 greedy and 4 sampled requests (each document once each
    way, so both schemas), one batch."""
    model, tokenizer = smollm2
    runs = {}
    for mode in ("none", "ngram", "draft"):
        s = make_scheduler(model, tokenizer, max_batch_size=32, grammar_tokenizer=grammar_tokenizer,
                      engine=_engine(model, tokenizer, mode, smollm2_path))
        s.start()
        try:
            reqs = (_requests(tokenizer, grammar_tokenizer, len(DOCUMENTS), 0.0)
                    + _requests(tokenizer, grammar_tokenizer, len(DOCUMENTS), 1.0))
            runs[mode] = (reqs, _run(s, reqs), s.spec_stats.tokens.num_drafts)
        finally:
            _stop(s)
    return runs


@pytest.mark.parametrize("mode", ["none", "ngram", "draft"])
def test_every_output_parses_and_validates(constrained_runs, mode):
    reqs, out, _ = constrained_runs[mode]
    assert len(out) == 2 * len(DOCUMENTS)
    for i, ((ids, text, done), req) in enumerate(zip(out, reqs)):
        assert done.finish_reason == "stop", (i, text)
        jsonschema.validate(json.loads(text), SCHEMAS[i % 2])
        assert 0 < done.forced_tokens < done.completion_tokens


def test_greedy_constrained_output_is_the_same_with_speculation(constrained_runs, smollm2):
    model, tokenizer = smollm2
    reqs, plain, _ = constrained_runs["none"]
    for mode in ("ngram", "draft"):
        _, spec, num_drafts = constrained_runs[mode]
        assert num_drafts > 0, mode
        for (a, _, _), (b, _, _), req in zip(plain, spec, reqs):
            if req.sampling.greedy:
                _assert_same_or_near_tie(model, req.prompt_tokens, a, b)


# ---- the exact constrained distribution ----------------------------------------


COLOURS = {"enum": ["red", "green", "blue"]}


def _exact_outputs(model, tokenizer, grammar_tokenizer, prompt, grammar, floor=1e-5) -> dict:
    """Text -> probability of the constrained model at temperature 1,
    summed over every tokenisation the grammar allows (paths below
    ``floor`` dropped)."""
    from mlx_lm.models.cache import make_prompt_cache

    eos = set(tokenizer.eos_token_ids)
    out = {}

    def walk(tokens, p):
        c = Constraint(grammar_tokenizer, grammar, 0)
        c.consume(tokens)
        row = np.empty(c.words, np.int32)
        c.fill(row)
        logits = model(mx.array([prompt + tokens]), cache=make_prompt_cache(model))[0, -1]
        masked = apply_masks(logits.astype(mx.float32), row)
        probs = np.asarray(mx.softmax(masked))
        for t in np.nonzero(probs * p > floor)[0].tolist():
            if t in eos:
                text = tokenizer.decode(tokens)
                out[text] = out.get(text, 0.0) + p * probs[t]
            else:
                walk(tokens + [t], p * probs[t])

    walk([], 1.0)
    return out


def test_a_sampled_draft_the_grammar_forbids_is_rejected_not_dropped(smollm2,
                                                                     grammar_tokenizer):
    """The rule of ``constrain_drafts`` for drafts sampled from q, on the real
    grammar and the real rejection sampler: a forbidden draft kept as the
    last draft (and rejected) gives exactly the constrained p; dropping it
    (drawing from p at that position) would not."""
    from mlx_lm_server.spec_decode.verifier import rejection_sample

    tokenizer = smollm2[1]
    c = Constraint(grammar_tokenizer, response_format_grammar(_schema_format(COLOURS)), 0)
    c.consume(tokenizer.encode('"', add_special_tokens=False))
    row = np.empty(c.words, np.int32)
    c.fill(row)
    allowed = np.nonzero(_unpacked(row, grammar_tokenizer.vocab_size))[0]
    forbidden = tokenizer.encode("x", add_special_tokens=False)[0]
    vocab = allowed.tolist() + [forbidden]  # the verifier works over these only
    rng = np.random.default_rng(0)
    p = np.append(rng.dirichlet(np.ones(len(allowed))), 0.0)
    q = np.append(0.5 * rng.dirichlet(np.ones(len(allowed))), 0.5)
    n = 20000
    drawn = rng.choice(len(vocab), size=n, p=q)
    index = {t: i for i, t in enumerate(vocab)}
    verified = [constrain_drafts(c, [vocab[d]], 4, one_hot=False)[0] for d in drawn]
    num = np.array([len(v) for v in verified], np.int32)
    drafts = np.array([index[v[0]] if v else 0 for v in verified], np.int32)
    assert num[drawn == len(allowed)].all()  # forbidden drafts were kept
    out, _ = rejection_sample(
        mx.array(np.tile(p, (n, 2, 1)).astype(np.float32)), mx.array(drafts[:, None]),
        mx.array(num), mx.array(rng.random((n, 1)).astype(np.float32)),
        mx.random.gumbel((n, len(vocab)), key=mx.random.key(0)),
        mx.array(np.tile(q, (n, 1, 1)).astype(np.float32)))
    first = np.asarray(out)[:, 0]
    tv = 0.5 * np.abs(np.bincount(first, minlength=len(vocab)) / n - p).sum()
    assert tv < 0.02, tv


# The draft-model variant (54 s) runs with --run-slow (and under scripts/mutants.py):
# the constrained rejection path is the same, n-gram covers it in the default run.
@pytest.mark.parametrize("mode", ["ngram", pytest.param("draft", marks=pytest.mark.slow)])
def test_sampled_constrained_output_keeps_the_exact_distribution(
        smollm2, smollm2_path, tiny_qwen3_path, grammar_tokenizer, mode):
    """End to end at temperature 1. The draft is a random-weight model with
    SmolLM2's tokenizer: fast, and its q is nothing like p, so most of its
    drafts are forbidden ones the verifier must reject."""
    model, tokenizer = smollm2
    prompt = tokenizer.encode("Favourite colour (red, green or blue), as JSON: ")
    grammar = response_format_grammar(_schema_format(COLOURS))
    exact = _exact_outputs(model, tokenizer, grammar_tokenizer, prompt, grammar)
    assert len(exact) == 3 and sum(exact.values()) > 0.99, exact
    n = 300  # in two waves: a step's cost here is mostly per row (sampling over the vocabulary)
    s = make_scheduler(model, tokenizer, max_batch_size=n // 2, prefill_batch_size=n // 2,
                       max_queued_requests=1000,
                  grammar_tokenizer=grammar_tokenizer,
                  engine=_engine(model, tokenizer, mode, tiny_qwen3_path))
    s.start()
    try:
        out = _run(s, [GenerationRequest(prompt, 12, SamplingParams(temperature=1.0, seed=i),
                                         grammar=grammar) for i in range(n)])
    finally:
        _stop(s)
    assert s.spec_stats.tokens.num_drafts > 0
    counts = {}
    for _, text, done in out:
        counts[text] = counts.get(text, 0) + 1
    tv = 0.5 * sum(abs(counts.get(k, 0) / n - exact.get(k, 0.0)) for k in set(exact) | set(counts))
    assert tv < 0.08, (tv, counts, exact)


# ---- HTTP ------------------------------------------------------------------------


def _chat(server, **fields):
    body = {"model": server.model, "max_tokens": 96, "temperature": 0,
            "messages": [{"role": "user", "content": "Extract the fields as JSON.\n"
                          + DOCUMENTS[0]}], **fields}
    return httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120)


@pytest.fixture(scope="module")
def ngram_server(smollm2_path):
    from conftest import LiveServer

    server = LiveServer(smollm2_path, spec=SpecDecodeConfig(mode="ngram", calibration_seconds=0))
    yield server
    server.close()


def _forced_total(server) -> float:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    (line,) = [x for x in text.splitlines()
               if x.startswith("structured_output_forced_tokens_total")]
    return float(line.split()[-1])


def test_response_format_over_http_streamed_and_not(ngram_server):
    for response_format, schema in ((_schema_format(PERSON), PERSON),
                                    ({"type": "json_object"}, {"type": "object"})):
        before = _forced_total(ngram_server)
        r = _chat(ngram_server, response_format=response_format)
        assert r.status_code == 200, r.text
        body = r.json()
        jsonschema.validate(json.loads(body["choices"][0]["message"]["content"]), schema)
        forced = body["usage"]["structured_output"]["forced_tokens"]
        # Keys and separators are certain under a schema; any object has none.
        assert (forced > 0) == (schema is PERSON) and forced < body["usage"]["completion_tokens"]
        assert _forced_total(ngram_server) - before == forced
        with httpx.stream("POST", ngram_server.url + "/v1/chat/completions", timeout=120, json={
                "model": ngram_server.model, "max_tokens": 96, "temperature": 0, "stream": True,
                "response_format": response_format,
                "messages": [{"role": "user", "content": "Extract the fields as JSON.\n"
                              + DOCUMENTS[0]}]}) as s:
            chunks = [json.loads(line[6:]) for line in s.iter_lines()
                      if line.startswith("data: {")]
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
        assert text == body["choices"][0]["message"]["content"]


def test_completions_take_response_format_and_logprobs_stay_finite(ngram_server):
    r = httpx.post(ngram_server.url + "/v1/completions", timeout=120, json={
        "model": ngram_server.model, "prompt": "Favourite colour, as JSON: ", "max_tokens": 8,
        "temperature": 0, "logprobs": 5, "response_format": _schema_format(COLOURS)})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert json.loads(choice["text"]) in COLOURS["enum"]
    for top in choice["logprobs"]["top_logprobs"]:
        assert all(np.isfinite(v) for v in top.values())
    # Where the grammar forces a token, it is the only alternative offered.
    assert min(len(top) for top in choice["logprobs"]["top_logprobs"]) == 1


@pytest.mark.parametrize("response_format,says", [
    ({"type": "xml"}, "response_format.type"),
    ({"type": "json_schema"}, "json_schema must be an object"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}, "schema"),
    (_schema_format({"type": "string", "format": "uri-reference"}), "uri-reference"),
    (_schema_format({"type": "string", "pattern": "(?=a)b"}), "look-around"),
    (_schema_format({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}),
     "missing"),
])
def test_schemas_the_engine_cannot_enforce_are_a_400(ngram_server, response_format, says):
    r = _chat(ngram_server, response_format=response_format)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "response_format" and says in error["message"], error
