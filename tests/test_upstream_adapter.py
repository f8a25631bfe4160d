"""Fail loudly when upstream mlx-lm moves under the pieces this package relies on."""

import dataclasses
import inspect
from importlib.metadata import version

from mlx_lm.generate import BatchGenerator, GenerationBatch

from mlx_lm_server.upstream import sequences_in_generator


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
    from mlx_lm_server import upstream

    model, tokenizer = smollm2
    gen = BatchGenerator(model)
    batch = upstream.generation_batch(gen)
    assert isinstance(batch, GenerationBatch)
    gen.insert([tokenizer.encode("one two three")], max_tokens=[4])
    while not len(upstream.generation_batch(gen)):
        gen.next()
    batch = upstream.generation_batch(gen)
    for name in ("_next_tokens", "_next_logprobs", "_token_context", "_num_tokens",
                 "_matchers", "tokens", "max_tokens", "logits_processors", "prompt_cache",
                 "uids"):
        assert hasattr(batch, name), name
    assert upstream.pending_tokens(batch).shape == (1,)
    assert len(upstream.pending_logprobs(batch)) == 1
    assert upstream.tokens_left(batch, 0) == 4

    seen = []
    upstream.install_generation_step(gen, lambda b: seen.append(b) or upstream.plain_step(b))
    _, responses = gen.next()
    assert seen == [batch] and len(responses) == 1
    assert upstream.tokens_left(batch, 0) == 3
    gen.close()
