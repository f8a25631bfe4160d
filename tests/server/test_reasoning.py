"""Reasoning apart from the answer, for models with thinking markers.

The pure pieces first (the splitter over token ids, the text a request
shows, the grammar that starts at the end marker), then the HTTP surface on
a tiny qwen3 whose output is fixed by construction: its layers add nothing
to the residual stream, so its logits depend on the last token only, and
seven tokens get one certain successor each:

    "\\n" -> <think> -> " Hmm" -> " ok" -> </think> -> "Paris" -> "!" -> <|im_end|>

Its template forces thinking (the prompt ends with ``<think>``) unless
``force_thinking`` is false (the model opens the block itself) or
``enable_thinking`` is false (the template writes a closed, empty block).
"""

import json

import httpx
import llguidance
import numpy as np
import pytest

from mlx_lm_server.decoding.structured import (
    GrammarError,
    GrammarTokenizer,
    after_thinking,
    json_schema_grammar,
    tool_call_grammar,
)
from mlx_lm_server.text.reasoning import ReasoningSplitter, Thinking, rfind, thinking_of

START, END = 3, 4  # <think>, </think> in the tiny model's tokenizer
EOS = 2

TEMPLATE = (
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{% endfor -%}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{%- if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>"
    "{%- elif force_thinking is not defined or force_thinking %}<think>{% endif %}"
    "{%- endif %}"
)

CITY = {"type": "object", "properties": {"city": {"const": "Paris"}}, "required": ["city"],
        "additionalProperties": False}


# ---- the splitter --------------------------------------------------------------------


def _split(thinking: Thinking, tokens: list[int]) -> tuple[list, list, int]:
    """(reasoning tokens shown, answer tokens shown, reasoning count)."""
    s = ReasoningSplitter(thinking)
    parts = {True: [], False: []}
    for t in tokens:
        part = s.reasoning
        parts[part] += s.feed(t)
    parts[s.reasoning] += s.close()
    return parts[True], parts[False], s.num_tokens


def test_single_token_markers_split_and_count():
    opened = Thinking((START,), (END,), in_reasoning=True)
    assert _split(opened, [10, 11, END, 12, 13]) == ([10, 11], [12, 13], 3)
    closed = Thinking((START,), (END,), in_reasoning=False)
    assert _split(closed, [START, 10, END, 12]) == ([10], [12], 3)
    assert _split(closed, [12, 13]) == ([], [12, 13], 0)
    # Cut off while thinking: everything is reasoning.
    assert _split(closed, [START, 10, 11]) == ([10, 11], [], 3)
    # A block after some answer is reasoning too, as upstream splits it.
    assert _split(closed, [12, START, 10, END, 13]) == ([10], [12, 13], 3)


def test_multi_token_markers_are_held_until_decided():
    t = Thinking((7, 8), (9, 8), in_reasoning=False)
    s = ReasoningSplitter(t)
    assert s.feed(7) == [] and not s.reasoning  # may begin the start marker
    assert s.feed(7) == [7]  # the first 7 was text; the second may begin it
    assert s.feed(8) == [] and s.reasoning
    assert s.feed(9) == [] and s.feed(5) == [9, 5]  # 9 then 5: not the end marker
    assert s.feed(9) == [] and s.feed(8) == [] and not s.reasoning
    assert s.num_tokens == 2 + 2 + 2
    # A marker cut off at the end is text of the part it was in.
    assert _split(t, [1, 7]) == ([], [1, 7], 0)
    assert _split(t, [7, 8, 1, 9]) == ([1, 9], [], 4)


def test_where_the_prompt_leaves_the_output():
    assert rfind([1, 3, 2, 3], [3]) == 3 and rfind([1, 2], [3]) == -1
    assert rfind([7, 8, 1, 7, 8], [7, 8]) == 3

    class Tok:
        has_thinking = True
        think_start_tokens, think_end_tokens = (START,), (END,)

    assert thinking_of(Tok(), [1, START]).in_reasoning
    assert thinking_of(Tok(), [1, START, 5, 6]).in_reasoning
    assert not thinking_of(Tok(), [1, START, 5, END, 6]).in_reasoning
    assert not thinking_of(Tok(), [1, 2]).in_reasoning
    assert thinking_of(object(), [1, START]) is None


# ---- the tiny thinking model ------------------------------------------------------------


@pytest.fixture(scope="module")
def thinking_path(tmp_path_factory, smollm2_path):
    """A qwen3 whose next token is fixed by the last one (see the module's doc).

    SmolLM2's tokenizer with two unused added tokens renamed ``<think>`` and
    ``</think>`` (not special, as in Qwen3's), and the template above."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten
    from mlx_lm.models import qwen3

    folder = tmp_path_factory.mktemp("tiny-thinking-qwen3")
    renamed = {"<repo_name>": "<think>", "<reponame>": "</think>"}
    tok = json.loads((smollm2_path / "tokenizer.json").read_text())
    for added in tok["added_tokens"]:
        if added["content"] in renamed:
            added.update(content=renamed[added["content"]], special=False)
    vocab = tok["model"]["vocab"]
    for old, new in renamed.items():
        vocab[new] = vocab.pop(old)
    (folder / "tokenizer.json").write_text(json.dumps(tok))
    cfg = json.loads((smollm2_path / "tokenizer_config.json").read_text())
    for added in cfg.get("added_tokens_decoder", {}).values():
        if added["content"] in renamed:
            added.update(content=renamed[added["content"]], special=False)
    cfg["chat_template"] = TEMPLATE
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))

    config = {
        "model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": 2,
        "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 32, "rms_norm_eps": 1e-6, "vocab_size": 49152,
        "max_position_embeddings": 2048, "rope_theta": 1000000.0,
        "tie_word_embeddings": False, "eos_token_id": [EOS],
    }
    mx.random.seed(0)
    model = qwen3.Model(qwen3.ModelArgs.from_dict(config))
    weights = dict(tree_flatten(model.parameters()))
    for name in weights:  # no layer writes to the residual stream
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name] = mx.zeros_like(weights[name])
    chain = [198, START, 41827, 10907, END, 38634, 17, EOS]
    embed = np.array(weights["model.embed_tokens.weight"])
    head = np.array(weights["lm_head.weight"])
    for dim, (token, successor) in enumerate(zip(chain, chain[1:])):
        embed[token] = 0.0
        embed[token, dim] = 1.0  # normed to 8 on this axis: logit 8 * head[:, dim]
        head[successor, dim] = 4.0  # 32 against about 1 for every other token
    weights["model.embed_tokens.weight"] = mx.array(embed)
    weights["lm_head.weight"] = mx.array(head)
    model.update(tree_unflatten(list(weights.items())))
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def thinking_tokenizer(thinking_path):
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    return load_tokenizer(thinking_path, eos_token_ids=[EOS])


def test_the_tiny_model_has_markers_and_the_template_forces_thinking(thinking_tokenizer):
    t = thinking_tokenizer
    assert (t.think_start_tokens, t.think_end_tokens) == ((START,), (END,))
    assert t.encode(" Hmm ok</think>Paris!", add_special_tokens=False) == [
        41827, 10907, END, 38634, 17]
    messages = [{"role": "user", "content": "hi"}]
    forced = t.apply_chat_template(messages, add_generation_prompt=True)
    assert forced[-1] == START and thinking_of(t, forced).in_reasoning
    free = t.apply_chat_template(messages, add_generation_prompt=True, force_thinking=False)
    assert free[-1] == 198 and not thinking_of(t, free).in_reasoning
    closed = t.apply_chat_template(messages, add_generation_prompt=True, enable_thinking=False)
    assert closed[-1] == END and not thinking_of(t, closed).in_reasoning


# ---- what a request shows -----------------------------------------------------------------


def _show(tokenizer, thinking, tokens, stops=(), eos=True):
    """(answer, reasoning, finish) from ``TextOutput``'s events, token by token."""
    from mlx_lm_server.serving.request_output import TextOutput

    out = TextOutput(tokenizer, list(stops), None, thinking)
    answer, reasoning, finish = "", "", None
    for i, t in enumerate(tokens + ([EOS] if eos else [])):
        last = i == len(tokens) - (0 if eos else 1)
        event, finish = out.add(t, None, ("stop" if eos else "length") if last else None)
        if event is not None:
            answer, reasoning = answer + event.text, reasoning + event.reasoning
        if finish is not None:
            break
    assert out.reasoning == reasoning
    return answer, reasoning, finish


def test_text_output_splits_reasoning_from_answer(thinking_tokenizer):
    t = thinking_tokenizer
    opened = Thinking((START,), (END,), True)
    enc = lambda s: t.encode(s, add_special_tokens=False)  # noqa: E731
    tokens = enc(" Let me think.\nDone") + [END] + enc("\n\nParis is big.")
    assert _show(t, opened, tokens) == ("Paris is big.", "Let me think.\nDone", "stop")
    # A lone space the detokenizer holds stays with the reasoning it ends.
    spaced = enc(" Done") + enc(" ") + [END] + enc("Paris")
    assert _show(t, opened, spaced) == ("Paris", "Done ", "stop")
    # Stop strings end the answer only; the reasoning may hold them.
    assert _show(t, opened, tokens, stops=["think", " is"]) == (
        "Paris", "Let me think.\nDone", "stop")
    # Cut off while thinking: no answer.
    assert _show(t, opened, enc(" Let me"), eos=False) == ("", "Let me", "length")
    # No markers: the text as it was, markers and all.
    assert _show(t, None, tokens)[:2] == ("Let me think.\nDone</think>\n\nParis is big.", "")


# ---- the grammar after the reasoning ---------------------------------------------------


def _matcher(grammar_tokenizer, grammar):
    return llguidance.LLMatcher(grammar_tokenizer.get(), grammar)


def test_grammar_starts_at_the_end_marker(thinking_tokenizer):
    t = thinking_tokenizer
    g = GrammarTokenizer(t, 49152)
    enc = lambda s: t.encode(s, add_special_tokens=False)  # noqa: E731
    answer = enc('{"city": "Paris"}')
    thought = enc(" I think {[ not JSON")
    schema = json_schema_grammar(CITY)
    opened = after_thinking(schema, Thinking((START,), (END,), True), g)
    free = after_thinking(schema, Thinking((START,), (END,), False), g)
    g.check(opened)
    g.check(free)

    def takes(grammar, tokens):
        m = _matcher(g, grammar)
        return m.try_consume_tokens(tokens) == len(tokens) and m.is_accepting()

    assert takes(opened, thought + [END] + answer)
    assert takes(opened, thought + [END] + enc("\n\n") + answer)  # Qwen3's newlines
    assert not takes(opened, answer)  # the thinking must end first
    assert not takes(opened, thought + [END] + enc('{"city": "Rome"}'))
    assert takes(free, answer) and takes(free, [START] + thought + [END] + answer)
    assert not takes(free, thought + [END] + answer)
    # Inside the thinking anything but a special token: no end of sequence.
    m = _matcher(g, opened)
    m.consume_tokens(thought)
    assert not m.validate_tokens([EOS]) and m.validate_tokens([END])
    mask = np.empty(((49152 + 31) // 32,), np.int32)
    m.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
    allowed = np.unpackbits(mask.view(np.uint8), bitorder="little")
    assert allowed[enc(" ok")[0]] and allowed[END] and not allowed[EOS] and not allowed[START]
    # Forced tool calls (a Lark grammar) wrap the same way.
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}}}}}]
    calls = after_thinking(tool_call_grammar(g, "<filename>", "<gh_stars>", tools, False),
                           Thinking((START,), (END,), True), g)
    call = [6] + enc('\n{"name": "f", "arguments": {"a": 1}}\n') + [7]
    assert takes(calls, thought + [END] + call) and not takes(calls, call)


def test_markers_of_several_tokens_bound_a_grammar(thinking_tokenizer):
    t = thinking_tokenizer
    g = GrammarTokenizer(t, 49152)
    enc = lambda s: t.encode(s, add_special_tokens=False)  # noqa: E731
    (word,) = enc("thought")
    grammar = after_thinking(json_schema_grammar(CITY), Thinking((START, word), (END,), False), g)
    m = _matcher(g, grammar)
    tokens = [START, word] + enc(" hi") + [END] + enc('{"city": "Paris"}')
    assert m.try_consume_tokens(tokens) == len(tokens) and m.is_accepting()
    assert _matcher(g, grammar).try_consume_tokens([START] + enc(" hi")) == 1


def test_markers_that_are_text_cannot_bound_a_grammar(thinking_tokenizer):
    g = GrammarTokenizer(thinking_tokenizer, 49152)
    with pytest.raises(GrammarError, match="special token"):
        after_thinking(json_schema_grammar(CITY), Thinking((START,), (81,), True), g)


def test_tool_calls_are_read_from_the_answer_only():
    from mlx_lm_server.http.openai_answer import ChatAnswer
    from mlx_lm_server.serving.request import DoneEvent, TextEvent
    from mlx_lm_server.text.tool_calls import ToolMarkers

    markers = ToolMarkers("<call>", "</call>", lambda text, tools: json.loads(text), [])
    call = '<call>{"name": "f", "arguments": {"a": 1}}</call>'
    events = [TextEvent("", reasoning="maybe " + call), TextEvent(call)]
    done = DoneEvent("stop", 5, 9, reasoning_tokens=4, reasoning="maybe " + call)
    streamed = ChatAnswer("m", False, markers)
    deltas = [c["choices"][0]["delta"] for e in events for c in streamed.text_chunks(e)]
    deltas += [c["choices"][0]["delta"] for c in streamed.done_chunks(done)]
    assert deltas[0] == {"reasoning": "maybe " + call, "reasoning_content": "maybe " + call}
    assert [d["tool_calls"][0]["function"] for d in deltas if "tool_calls" in d] == [
        {"name": "f", "arguments": '{"a": 1}'}]
    assert not any(d.get("content") for d in deltas)
    whole = ChatAnswer("m", False, markers).whole(call, [], done)
    message = whole["choices"][0]["message"]
    assert message["reasoning"] == "maybe " + call and message["content"] is None
    assert len(message["tool_calls"]) == 1 and whole["choices"][0]["finish_reason"] == "tool_calls"
    assert whole["usage"]["completion_tokens_details"] == {"reasoning_tokens": 4}


# ---- over HTTP -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(thinking_path):
    from conftest import LiveServer

    from mlx_lm_server.spec_decode.config import SpecDecodeConfig

    server = LiveServer(thinking_path, max_tokens=24,
                        spec=SpecDecodeConfig(mode="ngram", calibration_seconds=0))
    yield server
    server.close()


def _chat(server, **fields):
    # The prompt holds the chain, so n-gram drafts find it.
    body = {"model": server.model, "temperature": 0,
            "messages": [{"role": "user", "content": " Hmm ok</think>Paris!"}], **fields}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _stream(server, **fields):
    """(answer, reasoning, finish reason, usage) from the SSE chunks."""
    body = {"model": server.model, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": " Hmm ok</think>Paris!"}], **fields}
    answer, reasoning, finish, usage = "", "", None, None
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            usage = chunk.get("usage") or usage
            for choice in chunk["choices"]:
                delta = choice["delta"]
                assert delta.get("reasoning") == delta.get("reasoning_content")
                assert not (delta.get("reasoning") and delta.get("content"))
                answer += delta.get("content") or ""
                reasoning += delta.get("reasoning") or ""
                finish = choice["finish_reason"] or finish
    return answer, reasoning, finish, usage


def test_reasoning_apart_whole_and_streamed(server):
    body = _chat(server)
    message, usage = body["choices"][0]["message"], body["usage"]
    assert message["content"] == "Paris!"
    assert message["reasoning"] == message["reasoning_content"] == "Hmm ok"
    # " Hmm", " ok", </think> of 6 generated (the answer's two, the end of sequence).
    assert usage["completion_tokens"] == 6
    assert usage["completion_tokens_details"] == {"reasoning_tokens": 3}
    assert usage["spec_decode"]["accepted_tokens"] > 0  # speculation took part
    answer, reasoning, finish, streamed_usage = _stream(server)
    assert (answer, reasoning, finish) == ("Paris!", "Hmm ok", "stop")
    assert streamed_usage["completion_tokens_details"] == {"reasoning_tokens": 3}


def test_the_model_may_open_the_block_itself(server):
    body = _chat(server, chat_template_kwargs={"force_thinking": False})
    message = body["choices"][0]["message"]
    assert (message["content"], message["reasoning"]) == ("Paris!", "Hmm ok")
    assert body["usage"]["completion_tokens_details"] == {"reasoning_tokens": 4}


def test_enable_thinking_false_works_as_the_template_defines(server):
    body = _chat(server, chat_template_kwargs={"enable_thinking": False})
    message = body["choices"][0]["message"]
    assert message["content"] == "Paris!" and "reasoning" not in message
    assert body["usage"]["completion_tokens"] == 3
    assert body["usage"]["completion_tokens_details"] == {"reasoning_tokens": 0}


def test_stop_strings_end_the_answer_not_the_reasoning(server):
    message = _chat(server, stop=["ok", "!"])["choices"][0]["message"]
    assert (message["content"], message["reasoning"]) == ("Paris", "Hmm ok")


def test_response_format_holds_after_the_reasoning(server):
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}}
    for kwargs in ({}, {"chat_template_kwargs": {"force_thinking": False}}):
        body = _chat(server, response_format=fmt, **kwargs)
        message = body["choices"][0]["message"]
        assert message["reasoning"] == "Hmm ok"  # free: not JSON
        assert json.loads(message["content"]) == {"city": "Paris"}
        assert body["choices"][0]["finish_reason"] == "stop"
        assert body["usage"]["structured_output"]["forced_tokens"] > 0
        answer, reasoning, _, _ = _stream(server, response_format=fmt, **kwargs)
        assert (answer, reasoning) == (message["content"], "Hmm ok")


def test_speculation_and_the_prompt_cache_change_nothing(server):
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}}
    for fields in ({}, {"response_format": fmt}):
        plain = _chat(server, spec_decode=False, **fields)
        again = _chat(server, **fields)  # the same prompt: from the prompt cache
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        assert plain["choices"] == again["choices"]
        assert (plain["usage"]["completion_tokens_details"]
                == again["usage"]["completion_tokens_details"])
