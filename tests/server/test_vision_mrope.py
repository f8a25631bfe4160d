"""Images for an M-RoPE family: a tiny random-weight Qwen3.5 vision-language
folder built from mlx-vlm's own classes (``tiny_models.build_qwen35_vlm``:
an image's tokens at their place in a 2 x 3 grid, so the text after it is
numbered below its index, the model's rope delta), served through the
three APIs against mlx-vlm's own ``generate`` on the same folder, image
and prompt, with speculation (drafts refused roll the caches back) and
without; batched with text; the prompt cache keyed by the image and by the
prompt's shift; the sampled distribution with an image in the prompt."""

from __future__ import annotations

import base64
import concurrent.futures as cf
import io
from pathlib import Path

import httpx
import mlx.core as mx
import numpy as np
import pytest

pytest.importorskip("mlx_vlm")

from PIL import Image  # noqa: E402
from tiny_models import build_qwen35_vlm  # noqa: E402
from test_vision import QUESTION, answer, data_url  # noqa: E402
from test_vision import mlx_vlm_reference as _mlx_vlm_reference  # noqa: E402
from test_vision import openai_body as _openai_body  # noqa: E402

from mlx_lm_server.decoding.sampling import SamplingParams  # noqa: E402
from mlx_lm_server.http.anthropic_schema import MessagesRequest  # noqa: E402
from mlx_lm_server.http.openai_schema import ChatCompletionRequest  # noqa: E402
from mlx_lm_server.serving.request import GenerationRequest  # noqa: E402
from mlx_lm_server.spec_decode.config import SpecDecodeConfig  # noqa: E402
from mlx_lm_server.vision.images import decoded  # noqa: E402
from mlx_lm_server.vision.prompt import image_id  # noqa: E402

NUM_TOKENS = 24


def openai_body(model: str, url: str, text: str = QUESTION, **kw) -> dict:
    return _openai_body(model, url, text, **{"max_tokens": NUM_TOKENS, **kw})


def mlx_vlm_reference(*args, **kw) -> str:
    """mlx-vlm's greedy generate, every one of its tokens compared."""
    return _mlx_vlm_reference(*args, whole=True, **kw)


def png(seed: int, size=(64, 96)) -> bytes:
    """A 64 x 96 image: a 2 x 3 grid of merged patches (6 tokens, 3 positions wide)."""
    pixels = np.random.default_rng(seed).integers(0, 255, (*size, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "PNG")
    return buf.getvalue()


def _spec(mode: str, folder: Path = None) -> SpecDecodeConfig:
    from mlx_lm_server.spec_decode.auto import auto_mode

    return SpecDecodeConfig(mode=auto_mode(str(folder)) if mode == "auto" else mode,
                            num_speculative_tokens=4, dynamic=False, adaptive_k=False,
                            calibration_seconds=0)


@pytest.fixture(scope="module")
def vlm_path(tmp_path_factory, smollm2_path) -> Path:
    return build_qwen35_vlm(tmp_path_factory.mktemp("qwen35-vlm"), smollm2_path)


@pytest.fixture(scope="module")
def servers(vlm_path):
    """The folder served plainly, with ``--spec-decode auto`` and with n-gram drafts."""
    from conftest import LiveServer

    out = {mode: LiveServer(vlm_path, max_batch_size=8, spec=_spec(mode, vlm_path))
           for mode in ("none", "auto", "ngram")}
    yield out
    for server in out.values():
        server.close()


def test_the_prompt_is_numbered_as_mlx_vlm_numbers_it_moved_by_its_delta(servers):
    """The positions the server prefills with are mlx-vlm's ``get_rope_index``,
    each moved up by the rope delta (here 3: 6 image tokens over 3
    positions), so that the last token sits at its index; the cache key
    names the shift."""
    server = servers["none"]
    req, _ = server.service.prepare(ChatCompletionRequest.model_validate(
        openai_body(server.model, data_url(png(1)))))
    positions = req.images.positions
    n = len(req.prompt_tokens)
    assert positions.shape == (3, n) and positions[:, -1].tolist() == [n - 1] * 3
    start = req.prompt_tokens.index(server.service.vision.image_token)
    grid = positions[:, start:start + 6] - positions[0, start]
    assert grid.tolist() == [[0] * 6, [0, 0, 0, 1, 1, 1], [0, 1, 2, 0, 1, 2]]
    assert positions[0, 0] == 3  # the delta: the prompt's first token moved up by it
    assert req.cache_key[0] < 0 and req.cache_key[0] != req.cache_key[start]


def test_a_layers_rope_at_grid_positions_is_mlx_vlms_mrope(vlm_path):
    """The adapter's ``grid_positions`` (upstream's RoPE at each axis's
    positions, each frequency from its axis) against mlx-vlm's own M-RoPE
    on the same queries and keys at random positions: equal to float
    rounding; the rotated half and the half passed through both."""
    from mlx_lm import load
    from mlx_vlm.models.qwen3_5.language import Qwen3_5RotaryEmbedding

    from mlx_lm_server.runtime import mlx_lm_adapter

    model, _ = load(str(vlm_path))
    assert mlx_lm_adapter.grid_refused(model, 8) is None
    assert "rotates 16 dimensions" in mlx_lm_adapter.grid_refused(model, 4)
    attention = next(m for m in model.modules() if hasattr(m, "rope"))
    theirs = Qwen3_5RotaryEmbedding(16, base=10000.0, mrope_section=[3, 3, 2])
    axes = np.asarray(theirs.position_selector).tolist()
    assert sorted(set(axes)) == [0, 1, 2]
    mx.random.seed(0)
    q, k = mx.random.normal((2, 4, 7, 32)), mx.random.normal((2, 2, 7, 32))
    positions = mx.array(np.random.default_rng(0).integers(0, 50, (3, 2, 7)))
    with mlx_lm_adapter.grid_positions(model, positions, axes):
        ours = attention.rope(q), attention.rope(k)
    for a, b in zip(ours, theirs.apply_rotary(q, k, positions)):
        assert mx.abs(a - b).max().item() < 1e-5
    plain = attention.rope(q, offset=3)  # out of the block: upstream's RoPE again
    assert mx.abs(plain - attention.rope.inner(q, offset=3)).max().item() == 0


def test_an_image_through_each_api_answers_as_mlx_vlm_does(servers, vlm_path, tmp_path):
    """Greedy, 24 tokens: OpenAI chat, Anthropic Messages and Responses agree
    with mlx-vlm's own generate, without speculation and with n-gram drafts
    (some refused: the caches rolled back past them); another image gives
    another answer."""
    image = png(1)
    want = mlx_vlm_reference(vlm_path, image, NUM_TOKENS, tmp_path)
    b64 = base64.b64encode(image).decode()
    for mode, server in servers.items():
        assert answer(server, openai_body(server.model, data_url(image))) == want, mode
        r = httpx.post(server.url + "/v1/messages", timeout=120, json={
            "model": server.model, "max_tokens": NUM_TOKENS, "temperature": 0, "messages": [
                {"role": "user", "content": [
                    {"type": "text", "text": QUESTION},
                    {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                 "data": b64}}]}]})
        assert r.status_code == 200, r.text
        assert r.json()["content"][0]["text"] == want, mode
        r = httpx.post(server.url + "/v1/responses", timeout=120, json={
            "model": server.model, "max_output_tokens": NUM_TOKENS, "temperature": 0, "input": [
                {"role": "user", "content": [
                    {"type": "input_text", "text": QUESTION},
                    {"type": "input_image", "image_url": data_url(image)}]}]})
        assert r.status_code == 200, r.text
        assert r.json()["output"][0]["content"][0]["text"] == want, mode
    assert answer(servers["none"], openai_body(servers["none"].model, data_url(png(2)))) != want
    for mode in ("auto", "ngram"):
        totals = httpx.get(servers[mode].url + "/v1/spec_decode/metrics",
                           timeout=10).json()["totals"]
        assert totals["verify_steps"] > 0, (mode, totals)
        assert 0 < totals["accepted_tokens"] < totals["draft_tokens"], (mode, totals)


def test_an_image_in_a_tool_result_answers_in_the_tool_message(servers, vlm_path, tmp_path):
    """Qwen's template writes a tool message's image where it is: greedy, 24
    tokens, the same as mlx-vlm's generate on the conversation with the image
    inside the tool message, with and without speculation; a bad image in the
    tool result a 400 naming its place."""
    image = png(1)
    b64 = base64.b64encode(image).decode()
    body = lambda model, data: {  # noqa: E731
        "model": model, "max_tokens": NUM_TOKENS, "temperature": 0, "messages": [
            {"role": "user", "content": "Take a screenshot."},
            {"role": "assistant", "content": [
                {"type": "tool_use", "id": "call_1", "name": "screenshot", "input": {}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "call_1", "content": [
                    {"type": "text", "text": "Here it is."},
                    {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                 "data": data}}]},
                {"type": "text", "text": QUESTION}]}]}
    want = mlx_vlm_reference(vlm_path, image, NUM_TOKENS, tmp_path, messages=[
        {"role": "user", "content": "Take a screenshot."}, {"role": "assistant", "content": ""},
        {"role": "tool", "content": [{"type": "text", "text": "Here it is."}, {"type": "image"}]},
        {"role": "user", "content": QUESTION}])
    for mode, server in servers.items():
        r = httpx.post(server.url + "/v1/messages", timeout=120, json=body(server.model, b64))
        assert r.status_code == 200, r.text
        assert r.json()["content"][0]["text"] == want, mode
    server = servers["none"]
    # The cache key names the image by its bytes, as a user message's image.
    keys = [server.service.prepare(MessagesRequest.model_validate(
        body(server.model, data)).to_chat())[0].cache_key
        for data in (b64, base64.b64encode(png(2)).decode())]
    digest = decoded(image).digest
    start = next(i for i, t in enumerate(keys[0][1:], 1) if t < 0)
    assert keys[0][start] == image_id(digest) != keys[1][start]
    assert keys[0][1:start] == keys[1][1:start]
    r = httpx.post(server.url + "/v1/messages", timeout=60, json=body(
        server.model, base64.b64encode(b"nope").decode()))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"].startswith("messages.2.content.0.content.1: "), r.text


def test_the_model_list_says_it_takes_images(servers):
    (entry,) = httpx.get(servers["none"].url + "/v1/models", timeout=10).json()["data"]
    assert entry["input_modalities"] == ["text", "image"]


def test_eight_concurrent_requests_half_with_images_answer_as_alone(servers):
    """Image rows (their text numbered from the index once prefilled) and
    text rows in one batch, speculated: each answer as the request alone,
    and as without speculation."""
    server = servers["auto"]
    bodies = [openai_body(server.model, data_url(png(10 + i)), text=f"Picture {i}:",
                          max_tokens=16)
              if i % 2 == 0 else
              {"model": server.model, "temperature": 0, "max_tokens": 16, "messages": [
                  {"role": "user", "content": f"one two three four {i} one two three four"}]}
              for i in range(8)]
    alone = [answer(server, b) for b in bodies]
    with cf.ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda b: answer(server, b), bodies))
    assert together == alone
    assert [answer(servers["none"], b) for b in bodies] == alone


def _tower(folder: Path):
    from mlx_lm import load

    from mlx_lm_server.vision.tower import VisionTower

    model, tokenizer = load(str(folder))
    tower, support = VisionTower.load(str(folder), "vlm", model)
    assert support.takes_images, support
    return model, tokenizer, tower


def _scheduler(model, tokenizer, tower, cache: bool):
    from mlx_lm_server.assembly import make_scheduler
    from mlx_lm_server.serving.prompt_cache import PromptCache
    from mlx_lm_server.spec_decode import make_engine

    config = SpecDecodeConfig(mode="ngram", num_speculative_tokens=4, dynamic=False,
                              adaptive_k=False)
    s = make_scheduler(model, tokenizer, max_batch_size=8, vision=tower,
                       engine=make_engine(model, config, tokenizer, "target"),
                       prompt_cache=PromptCache(10, 1 << 32) if cache else None)
    s.start()
    return s


def _image_prompt(tokenizer, tower, text: str, seed: int):
    """(tokens, inputs, digest) of a user turn holding ``text`` and image ``seed``."""
    from mlx_lm_server.runtime.mlx_vlm_adapter import processed_prompt

    image = decoded(png(seed))
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "text", "text": text}, {"type": "image"}]}],
        tokenize=False, add_generation_prompt=True)
    tokens, inputs = processed_prompt(tower.parts, chat, [image.image])
    return tokens, inputs, image.digest


def test_a_follow_up_with_the_image_is_served_from_the_cache(vlm_path):
    """Turn two (turn one, its reply, a question) starts from turn one's
    cached layers, past the image (the text after it numbered from its index
    in both), and answers as without a cache; a turn two that adds another
    image moves every position by another delta, so turn one's entry is not
    taken for it (served from it, its answer would differ)."""
    from test_hybrid_caches import _run
    from test_prompt_cache import _stop

    model, tokenizer, tower = _tower(vlm_path)
    first, inputs, digest = _image_prompt(tokenizer, tower, QUESTION, 1)
    more, more_inputs, more_digest = _image_prompt(tokenizer, tower, "And this one?", 2)
    cached, fresh = _scheduler(model, tokenizer, tower, True), \
        _scheduler(model, tokenizer, tower, False)
    greedy = SamplingParams(temperature=0)

    def request(tokens, inputs, digests, max_tokens=16):
        return GenerationRequest(tokens, max_tokens, greedy,
                                 images=tower.prompt_images(tokens, inputs, digests))

    try:
        (reply, _, _), = _run(cached, [request(first, inputs, (digest,))])
        second = first + reply + tokenizer.encode(" And the colours?<|im_end|>\n")
        (got, _, done), = _run(cached, [request(second, inputs, (digest,))])
        (want, _, _), = _run(fresh, [request(second, inputs, (digest,))])
        assert done.cached_tokens == len(first) + len(reply)
        assert got == want
        both = {k: np.concatenate([inputs[k], more_inputs[k]]) for k in inputs}
        third = first + reply + more
        (got, _, done), = _run(cached, [request(third, both, (digest, more_digest))])
        (want, _, _), = _run(fresh, [request(third, both, (digest, more_digest))])
        assert done.cached_tokens == 0
        assert got == want
    finally:
        _stop(cached)
        _stop(fresh)


def test_sampled_tokens_keep_the_exact_distribution_with_an_image(vlm_path):
    """Temperature 1.5, top_k 2, drafts (the greedy answer as each request's
    prediction, then n-grams) verified by the rejection sampler, refused
    ones rolled back: joint frequencies of three tokens over 600 seeded
    requests with an image in the prompt against the exact distribution from plain
    forwards over the merged embeddings at mlx-vlm's own positions (not
    moved). Bound: TV below 0.1 over 8 outcomes (sampling error alone about
    0.05)."""
    from mlx_lm import load

    from mlx_lm_server.assembly import make_scheduler
    from mlx_lm_server.runtime import mlx_lm_adapter
    from mlx_lm_server.runtime.mlx_vlm_adapter import grid_positions, input_embeddings
    from mlx_lm_server.spec_decode import make_engine
    from mlx_lm_server.vision.tower import VisionTower
    from test_hybrid_caches import _exact_distribution, _run, _stop

    model, tokenizer = load(str(vlm_path))
    tower, support = VisionTower.load(str(vlm_path), "vlm", model)
    assert support.takes_images
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "text", "text": "one two one two one two"},
                                      {"type": "image"}]}],
        tokenize=False, add_generation_prompt=True)
    prompt, images = tower.prompt(text, [decoded(png(1))])

    def logits_after(model, tokens):
        # mlx-vlm's positions: the prompt's, then the text from the largest + 1.
        base = grid_positions(tower.parts, list(prompt), images.inputs)
        after = base[:, -1:] + np.arange(1, len(tokens) - len(prompt) + 1)
        positions = mx.array(np.concatenate([base, after], axis=1)[:, None, :])
        emb = input_embeddings(tower.parts, list(tokens), images.inputs)
        with mlx_lm_adapter.grid_positions(model, positions, tower.parts.mrope_axes):
            return model(mx.array([tokens]), input_embeddings=emb)[0, -1]

    config = SpecDecodeConfig(mode="ngram", num_speculative_tokens=4, dynamic=False,
                              adaptive_k=False)
    s = make_scheduler(model, tokenizer, max_batch_size=32, max_queued_requests=1024,
                       engine=make_engine(model, config, tokenizer, "target"), vision=tower)
    s.start()
    exact = _exact_distribution(model, prompt, 3, 2, 1.5, logits_after=logits_after)
    n = 600
    try:
        # Drafted from the first step: the greedy tokens as the prediction.
        (greedy, _, _), = _run(s, [GenerationRequest(prompt, 3, SamplingParams(temperature=0),
                                                     images=images)])
        reqs = [GenerationRequest(prompt, 3, SamplingParams(seed=i, temperature=1.5, top_k=2),
                                  images=images, prediction=tuple(greedy)) for i in range(n)]
        counts = {}
        for ids, _, _ in _run(s, reqs):
            counts[tuple(ids)] = counts.get(tuple(ids), 0) + 1
        drafts = s.spec_stats.tokens.num_draft_tokens
        accepted = s.spec_stats.tokens.num_accepted_tokens
    finally:
        _stop(s)
    assert 0 < accepted < drafts, (accepted, drafts)
    tv = 0.5 * sum(abs(counts.get(k, 0) / n - exact.get(k, 0.0)) for k in set(exact) | set(counts))
    assert tv < 0.1, (tv, counts, exact)
