"""Fail loudly when upstream mlx-lm moves under the pieces this package relies on."""

import dataclasses
import inspect
from importlib.metadata import version

import pytest
from mlx_lm.generate import BatchGenerator, GenerationBatch

from mlx_lm_server.runtime.mlx_lm_adapter import sequences_in_generator


def test_pinned_versions():
    assert version("mlx-lm") == "0.32.2"
    assert version("mlx") == "0.32.4"


def test_batch_generator_api_used_by_the_scheduler():
    params = inspect.signature(BatchGenerator.__init__).parameters
    for name in ("completion_batch_size", "prefill_batch_size", "prefill_step_size"):
        assert name in params
    insert = inspect.signature(BatchGenerator.insert).parameters
    for name in ("prompts", "max_tokens", "samplers", "logits_processors", "stop_sequences"):
        assert name in insert
    fields = {f.name for f in dataclasses.fields(GenerationBatch.Response)}
    assert {"uid", "token", "logprobs", "finish_reason"} <= fields


def test_sequences_in_generator_follows_each_stage(smollm2):
    model, tokenizer = smollm2
    gen = BatchGenerator(model, prefill_step_size=4)
    assert sequences_in_generator(gen) == {"waiting": 0, "prefilling": 0, "decoding": 0}
    (uid,) = gen.insert([tokenizer.encode("one two three four five six seven")], max_tokens=[3])
    assert sequences_in_generator(gen)["waiting"] == 1
    gen.next()
    assert sequences_in_generator(gen)["prefilling"] == 1
    seen = []
    while not any(r.finish_reason for r in seen):
        _, responses = gen.next()
        seen.extend(responses)
        if responses:
            assert sequences_in_generator(gen)["decoding"] in (0, 1)
    assert sequences_in_generator(gen) == {"waiting": 0, "prefilling": 0, "decoding": 0}
    gen.close()


def test_generation_batch_private_state_the_engine_relies_on(smollm2):
    """The speculative engine reads and writes these; upstream renames break it here first."""
    from mlx_lm_server.runtime import mlx_lm_adapter

    model, tokenizer = smollm2
    gen = BatchGenerator(model)
    batch = mlx_lm_adapter.generation_batch(gen)
    assert isinstance(batch, GenerationBatch)
    gen.insert([tokenizer.encode("one two three")], max_tokens=[4])
    while not len(mlx_lm_adapter.generation_batch(gen)):
        gen.next()
    batch = mlx_lm_adapter.generation_batch(gen)
    for name in ("_next_tokens", "_next_logprobs", "_token_context", "_num_tokens",
                 "_matchers", "tokens", "max_tokens", "logits_processors", "prompt_cache",
                 "uids"):
        assert hasattr(batch, name), name
    assert mlx_lm_adapter.pending_tokens(batch).shape == (1,)
    assert len(mlx_lm_adapter.pending_logprobs(batch)) == 1
    assert mlx_lm_adapter.tokens_left(batch, 0) == 4

    seen = []
    mlx_lm_adapter.install_generation_step(gen, lambda b: seen.append(b) or mlx_lm_adapter.plain_step(b))
    _, responses = gen.next()
    assert seen == [batch] and len(responses) == 1
    assert mlx_lm_adapter.tokens_left(batch, 0) == 3
    gen.close()


def test_batch_kv_cache_write_index_the_ragged_cache_relies_on(smollm2):
    """``RaggedKVCache`` keeps upstream's write index at its largest row end and
    refuses a cache with right padding not yet rolled in."""
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache

    from mlx_lm_server.runtime import mlx_lm_adapter

    model, _ = smollm2
    cache = [BatchKVCache([1, 0]) for _ in model.layers]
    model(mx.array([[0, 5, 6], [7, 8, 9]]), cache=cache)
    assert mlx_lm_adapter.write_index(cache[0]) == 3
    cache[0].trim(1)
    assert mlx_lm_adapter.write_index(cache[0]) == 2
    mlx_lm_adapter.set_write_index(cache[0], 3)
    assert cache[0].keys_and_values()[0].shape[2] == 3
    assert not mlx_lm_adapter.has_pending_right_padding(cache[1])
    fresh = BatchKVCache([0, 0])
    fresh.prepare(right_padding=[0, 2])
    assert mlx_lm_adapter.has_pending_right_padding(fresh)


def test_rotating_cache_ring_state_the_window_cache_relies_on():
    """``rotating_state`` says where upstream's batch ring starts (write index,
    rotation), so that the window cache re-lays it in temporal order, and
    ``rotating_cache`` builds what upstream's own ``extract`` returns."""
    import mlx.core as mx
    from mlx_lm.models.cache import BatchRotatingKVCache

    from mlx_lm_server.kv import RaggedWindowKVCache
    from mlx_lm_server.runtime import mlx_lm_adapter

    ring = BatchRotatingKVCache(4, [0])
    prefill = mx.arange(-5, 1, dtype=mx.float32).reshape(1, 1, 6, 1) * mx.ones((1, 1, 6, 2))
    steps = [prefill] + [mx.full((1, 1, 1, 2), float(t)) for t in range(1, 4)]
    for keys in steps:  # a 6-token prefill, then three one-token steps: the ring rotates
        ring.update_and_fetch(keys, keys)
    max_size, keys, values, offset, idx, rotated = mlx_lm_adapter.rotating_state(ring)
    assert (max_size, offset.tolist(), rotated) == (4, [9], True) and 0 < idx <= 4
    want = ring.extract(0)
    got = RaggedWindowKVCache.from_batch(ring).extract(0)
    assert type(got) is type(want) and got.offset == want.offset == 9
    assert got.keys.tolist() == want.keys.tolist()  # the last four, oldest first
    assert got.keys[0, 0, :, 0].tolist() == [0.0, 1.0, 2.0, 3.0]


def test_batch_cache_as_carries_every_field_of_the_cache():
    """``RaggedKVCache.from_batch`` takes a ``BatchKVCache`` over whole, its
    private fields included: the same objects, under the subclass's verbs."""
    import mlx.core as mx
    import pytest
    from mlx_lm.models.cache import BatchKVCache, KVCache

    from mlx_lm_server.kv import RaggedKVCache
    from mlx_lm_server.runtime import mlx_lm_adapter

    cache = BatchKVCache([1, 0])
    cache.update_and_fetch(mx.ones((2, 1, 3, 4)), mx.ones((2, 1, 3, 4)))
    assert {"_idx", "_right_padding", "keys", "values", "offset", "left_padding"} <= set(vars(cache))
    ragged = mlx_lm_adapter.batch_cache_as(RaggedKVCache, cache)
    assert type(ragged) is RaggedKVCache
    assert all(getattr(ragged, name) is value for name, value in vars(cache).items())
    assert mlx_lm_adapter.write_index(ragged) == 3
    with pytest.raises(TypeError, match="does not extend KVCache"):
        mlx_lm_adapter.batch_cache_as(RaggedKVCache, KVCache())


def test_recurrent_states_and_pass_lengths_the_replay_relies_on():
    """A recurrent layer's states live in ``ArraysCache.cache``; the right
    padding of a pass in ``lengths``, which its mask and ``advance`` follow."""
    import mlx.core as mx
    from mlx_lm.models.cache import ArraysCache

    from mlx_lm_server.runtime import mlx_lm_adapter

    cache = ArraysCache(2, left_padding=[0, 0])
    states = [mx.zeros((2, 3)), mx.ones((2, 4))]
    mlx_lm_adapter.set_recurrent_states(cache, states)
    assert cache[0] is states[0] and cache[1] is states[1] and cache.state[0] == states
    assert all(a is b for a, b in zip(mlx_lm_adapter.recurrent_states(cache), states))
    mlx_lm_adapter.set_pass_lengths(cache, mx.array([2, 3]))
    assert cache.make_mask(3).tolist() == [[True, True, False], [True, True, True]]
    cache.advance(1)
    assert cache.make_mask(2).tolist() == [[True, False], [True, True]]
    mlx_lm_adapter.set_pass_lengths(cache, None)
    assert cache.make_mask(3).tolist() == [[True] * 3] * 2


def test_recorded_mixers_compute_the_same_and_hand_each_call_to_the_hook():
    """The modules a layer hands its cache to are its children whose call
    takes ``mask`` and ``cache`` (lfm2: each short convolution and attention);
    a recorded one keeps its class's name, parameters and outputs and hands
    every call, arguments bound, to the hook, once however often recorded."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import lfm2
    from mlx_lm.models.cache import make_prompt_cache
    from tiny_models import CONFIGS

    from mlx_lm_server.runtime import mlx_lm_adapter

    model = lfm2.Model(lfm2.ModelArgs.from_dict(dict(CONFIGS["lfm2"], vocab_size=256)))
    mixers = mlx_lm_adapter.cache_mixers(model)
    assert [type(m).__name__ for m in mixers] == ["ShortConv", "Attention"] * 2
    names = [k for k, _ in tree_flatten(model.parameters())]
    x = mx.array([[1, 2, 3]])
    want = model(x, cache=make_prompt_cache(model))
    seen = []
    for _ in range(2):
        for m in mixers:
            mlx_lm_adapter.record_calls(m, lambda m, args, kwargs: seen.append(
                (m, mlx_lm_adapter.bind_call(m, args, kwargs))))
    assert [id(m) for m in mlx_lm_adapter.cache_mixers(model)] == [id(m) for m in mixers]
    assert isinstance(mixers[0], lfm2.ShortConv) and type(mixers[0]).__name__ == "ShortConv"
    caches = make_prompt_cache(model)
    assert mx.array_equal(model(x, cache=caches), want)
    assert [k for k, _ in tree_flatten(model.parameters())] == names
    assert [id(m) for m, _ in seen] == [id(m) for m in mixers]
    assert [id(b.arguments["cache"]) for _, b in seen] == [id(c) for c in caches]
    assert all("mask" in b.arguments and b.arguments["self"] is m for m, b in seen)


def _upstream_private_names() -> set:
    """Private attribute names mlx-lm's batching and cache modules use."""
    import ast
    import importlib.util
    from pathlib import Path

    names = set()
    for module in ("mlx_lm.generate", "mlx_lm.models.cache"):
        tree = ast.parse(Path(importlib.util.find_spec(module).origin).read_text())
        names |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)
                  and n.attr.startswith("_") and not n.attr.startswith("__")}
    return names


def _violations(tree, upstream_names: set, upstream_classes: set) -> list:
    """Uses of upstream private names: on any object but ``self``, or on
    ``self`` inside a class that extends an upstream class; and through
    ``getattr``/``setattr``/``hasattr`` with the name as a string."""
    import ast

    found = []

    def visit(node, in_upstream_subclass):
        if isinstance(node, ast.ClassDef):
            bases = {b.id if isinstance(b, ast.Name) else getattr(b, "attr", "")
                     for b in node.bases}
            in_upstream_subclass = bool(bases & upstream_classes)
        if isinstance(node, ast.Attribute) and node.attr in upstream_names:
            on_self = isinstance(node.value, ast.Name) and node.value.id == "self"
            if not on_self or in_upstream_subclass:
                found.append((node.lineno, node.attr))
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "setattr", "hasattr") and len(node.args) > 1
                and isinstance(node.args[1], ast.Constant) and node.args[1].value in upstream_names):
            found.append((node.lineno, node.args[1].value))
        for child in ast.iter_child_nodes(node):
            visit(child, in_upstream_subclass)

    visit(tree, False)
    return found


def test_only_the_adapter_touches_upstream_private_state():
    import ast
    from pathlib import Path

    import mlx_lm.generate
    import mlx_lm.models.cache

    import mlx_lm_server

    names = _upstream_private_names()
    assert {"_idx", "_next_tokens", "_right_padding"} <= names
    classes = {n for m in (mlx_lm.generate, mlx_lm.models.cache) for n, v in vars(m).items()
               if isinstance(v, type) and v.__module__ == m.__name__}
    package = Path(mlx_lm_server.__file__).parent
    bad = {}
    for path in package.rglob("*.py"):
        if path.parent.name == "mlx_lm_adapter":
            continue
        found = _violations(ast.parse(path.read_text()), names, classes)
        if found:
            bad[str(path.relative_to(package))] = found
    assert not bad, f"upstream private state used outside the adapter (runtime/mlx_lm_adapter/): {bad}"


def test_the_adapter_check_catches_what_it_names():
    """The rule itself: a subclass's ``self._idx``, another object's
    ``batch._next_tokens`` and a ``getattr`` string are caught; our own
    ``self._step`` in a plain class is not."""
    import ast

    src = '''
class Cache(BatchKVCache):
    def f(self):
        return self._idx

class Mine:
    def g(self, batch):
        self._step = 1
        getattr(batch, "_right_padding", None)
        return batch._next_tokens
'''
    found = _violations(ast.parse(src), {"_idx", "_next_tokens", "_right_padding", "_step"},
                        {"BatchKVCache"})
    assert sorted(a for _, a in found) == ["_idx", "_next_tokens", "_right_padding"]


def _most_decoding(model, tokenizer, step) -> tuple[int, int]:
    """The most sequences decoding at once, and how many finished, when 12
    prompts of staggered lengths compete for 4 slots."""
    gen = BatchGenerator(model, completion_batch_size=4, prefill_batch_size=4,
                         prefill_step_size=8)
    prompts = [tokenizer.encode("one two three " * (1 + i % 5)) for i in range(12)]
    gen.insert(prompts, max_tokens=[3 + 2 * (i % 4) for i in range(12)])
    most, finished = 0, 0
    while finished < 12:
        _, responses = step(gen)
        finished += sum(r.finish_reason is not None for r in responses)
        most = max(most, len(gen._generation_batch))
    return most, finished


def test_the_batch_cap_holds_while_prompts_are_prefilled(smollm2):
    """Upstream admits prompts up to the cap minus the decoding rows alone, so
    prompts still prefilling overshoot it once they join; ``next_within_cap``
    holds the excess back."""
    from mlx_lm_server.runtime.mlx_lm_adapter import next_within_cap

    model, tokenizer = smollm2
    assert _most_decoding(model, tokenizer, BatchGenerator.next)[0] > 4  # upstream's overshoot
    assert _most_decoding(model, tokenizer, next_within_cap) == (4, 12)


def test_calls_are_json_objects_names_mlx_lms_json_parser(qwen05_path, smollm2_path):
    """A forced tool choice needs calls written as JSON objects: Qwen2.5's
    parser is mlx-lm's ``json_tools``; another parser, or none, is not."""
    from types import SimpleNamespace

    from mlx_lm.tool_parsers import json_tools, pythonic
    from mlx_lm.utils import load_tokenizer

    from mlx_lm_server.runtime.mlx_lm_adapter import calls_are_json_objects

    qwen = load_tokenizer(qwen05_path)
    assert qwen.tool_parser is json_tools.parse_tool_call and calls_are_json_objects(qwen)
    assert not calls_are_json_objects(load_tokenizer(smollm2_path))
    assert not calls_are_json_objects(SimpleNamespace(tool_parser=pythonic.parse_tool_call))


def test_hf_tokenizer_is_the_one_inside_mlx_lms_wrapper(smollm2):
    """llguidance needs the Hugging Face tokenizer itself, which mlx-lm's
    ``TokenizerWrapper`` keeps in a private field."""
    from transformers import PreTrainedTokenizerBase

    from mlx_lm_server.runtime.mlx_lm_adapter import hf_tokenizer

    _, tokenizer = smollm2
    inner = hf_tokenizer(tokenizer)
    assert isinstance(inner, PreTrainedTokenizerBase)
    assert inner.encode("one two", add_special_tokens=False) == tokenizer.encode(
        "one two", add_special_tokens=False)
    assert hf_tokenizer(inner) is inner


# What the package may take from mlx-lm outside the adapter (runtime/mlx_lm_adapter/): its public API.
PUBLIC_UPSTREAM = {
    "mlx_lm": {"load"},
    "mlx_lm.generate": {"BatchGenerator"},
    "mlx_lm.sample_utils": {"apply_min_p", "apply_top_k", "apply_top_p", "greedy_sampler",
                            "make_logits_processors"},
    "mlx_lm.models.cache": {"ArraysCache", "BatchKVCache", "BatchRotatingKVCache", "KVCache",
                            "QuantizedKVCache", "RotatingKVCache", "LRUPromptCache",
                            "make_prompt_cache", "can_trim_prompt_cache", "trim_prompt_cache",
                            "save_prompt_cache", "load_prompt_cache"},
    "mlx_lm.utils": {"load_model", "sharded_load", "quantize_model", "save_config",
                     "save_model", "DEFAULT_ALLOW_PATTERNS"},
}


def _upstream_imports(tree) -> list:
    """(line, module, name) for every name imported from mlx-lm; a bare
    ``import mlx_lm...`` counts as importing everything (name ``*``)."""
    import ast

    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "mlx_lm":
            found += [(node.lineno, node.module, a.name) for a in node.names]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name, "*") for a in node.names
                      if a.name.split(".")[0] == "mlx_lm"]
    return found


def test_only_public_mlx_lm_names_are_imported_outside_the_adapter():
    """Any other name (a private class such as ``StopSequences``, a module of
    parsers) goes through the adapter, so the next release breaks one file."""
    import ast
    from pathlib import Path

    import mlx_lm_server

    package = Path(mlx_lm_server.__file__).parent
    bad = {}
    for path in package.rglob("*.py"):
        if path.parent.name == "mlx_lm_adapter":
            continue
        found = [(line, f"{module}.{name}") for line, module, name
                 in _upstream_imports(ast.parse(path.read_text()))
                 if name not in PUBLIC_UPSTREAM.get(module, set())]
        if found:
            bad[str(path.relative_to(package))] = found
    assert not bad, f"mlx-lm names outside the adapter (runtime/mlx_lm_adapter/) that are not on the public list: {bad}"


def test_the_import_check_catches_what_it_names():
    import ast

    src = ("from mlx_lm.generate import BatchGenerator, StopSequences\n"
           "import mlx_lm.tool_parsers.json_tools\n"
           "from mlx_lm import load\n")
    found = [(m, n) for _, m, n in _upstream_imports(ast.parse(src))
             if n not in PUBLIC_UPSTREAM.get(m, set())]
    assert found == [("mlx_lm.generate", "StopSequences"), ("mlx_lm.tool_parsers.json_tools", "*")]


def test_node_positions_take_over_every_layers_rope_or_say_why_not(smollm2):
    """Trees need every attention layer's positions: a ``rope`` module in
    each decoder layer, taken over. One layer without one (here removed)
    refuses the whole model, naming it; a family that uses positions past
    its RoPE too is refused by name; a RoPE called in a layout the wrapper
    cannot place fails loudly instead of placing nodes at their index."""
    import mlx.core as mx
    from mlx_lm.models import llama

    from mlx_lm_server.runtime import mlx_lm_adapter as adapter
    from mlx_lm_server.runtime.mlx_lm_adapter import positions

    model, _ = smollm2
    assert adapter.node_positions_refused(model) is None
    ropes = [layer.self_attn.rope for layer in model.layers]
    assert all(isinstance(r, positions._NodeRoPE) for r in ropes)

    args = llama.ModelArgs.from_dict(dict(
        model_type="llama", hidden_size=64, num_hidden_layers=3, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=256))
    partial = llama.Model(args)
    partial.layers[1].self_attn.rope = None
    refused = adapter.node_positions_refused(partial)
    assert refused is not None and "layer 1 (TransformerBlock) has no `rope`" in refused

    for family in positions._POSITIONS_PAST_ROPE:  # still this mlx-lm's, still scaling by position
        source = inspect.getsource(__import__(family, fromlist=["Model"]))
        assert "_get_llama_4_attn_scale" in source, family

    slot = adapter.node_positions(model)
    slot[0] = mx.zeros((1, 3), mx.int32)
    try:
        with pytest.raises(ValueError, match="cannot place the nodes"):
            ropes[0](mx.zeros((1, 3, 9, 64)))  # [B, L, heads, dims]: not a layout it places
    finally:
        slot[0] = None


def test_long_prompts_are_prefilled_one_at_a_time_and_short_ones_together(smollm2):
    """With ``prompts_within`` (a CPU's admission), three prompts longer than
    a prefill step never share one: the first gets its first token before
    the others start; four short ones still go through in one step. Every
    sequence finishes, none over the cap."""
    from mlx_lm_server.runtime.mlx_lm_adapter import next_within_cap
    from mlx_lm_server.serving.batch import prompts_within

    model, tokenizer = smollm2

    def run(prompts, admit):
        gen = BatchGenerator(model, completion_batch_size=4, prefill_batch_size=4,
                             prefill_step_size=32)
        uids = gen.insert(prompts, max_tokens=[2] * len(prompts))
        most, first, finished = 0, [], 0
        while finished < len(prompts):
            _, responses = next_within_cap(gen, admit)
            most = max(most, len(gen._prompt_batch))
            first += [r.uid for r in responses if r.uid not in first]
            finished += sum(r.finish_reason is not None for r in responses)
        return most, first, uids

    long = [tokenizer.encode("one two three four " * (20 + i)) for i in range(3)]
    most, first, uids = run(long, prompts_within(32, 32))
    assert most == 1 and first == uids  # one at a time, in order
    assert run(long, None)[0] == 3  # upstream: all three prefilled together
    short = [tokenizer.encode("one two") for _ in range(4)]
    assert run(short, prompts_within(32, 32))[0] == 4
