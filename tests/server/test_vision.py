"""Images in prompts: a tiny random-weight Gemma 3 vision-language folder
built from mlx-vlm's own classes (``tiny_models.build_gemma3_vlm``), served
through the three APIs, against mlx-vlm's own ``generate`` on the same
folder, image and prompt; batched with text and with each other; the
prompt cache keyed by the image; bad images refused; the families whose
images are refused (a text-only model, an M-RoPE family not served) said so."""

from __future__ import annotations

import base64
import concurrent.futures as cf
import http.server
import io
import struct
import threading
import time
import zlib
from pathlib import Path

import httpx
import mlx.core as mx
import numpy as np
import pytest

pytest.importorskip("mlx_vlm")

from PIL import Image  # noqa: E402
from tiny_models import build, build_gemma3_vlm, with_vision_config  # noqa: E402

from mlx_lm_server.decoding.sampling import SamplingParams  # noqa: E402
from mlx_lm_server.http import tool_images  # noqa: E402
from mlx_lm_server.http.openai_schema import ChatCompletionRequest  # noqa: E402
from mlx_lm_server.runtime.ports import free_ports  # noqa: E402
from mlx_lm_server.serving.request import GenerationRequest  # noqa: E402
from mlx_lm_server.spec_decode.config import SpecDecodeConfig  # noqa: E402
from mlx_lm_server.vision import images as vimages  # noqa: E402
from mlx_lm_server.vision.images import ImageError, decoded, image_bytes  # noqa: E402
from mlx_lm_server.vision.prompt import cache_key, image_id  # noqa: E402

QUESTION = "Describe this image."


def png(seed: int, size=(40, 50)) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 255, (*size, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "PNG")
    return buf.getvalue()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def declared_png(width: int, height: int) -> bytes:
    """A 1 x 1 PNG whose header declares ``width`` x ``height`` (a bomb's header)."""
    data = png(0, (1, 1))
    start = data.index(b"IHDR")
    body = struct.pack(">II", width, height) + data[start + 12:start + 17]
    chunk = b"IHDR" + body
    return data[:start] + chunk + struct.pack(">I", zlib.crc32(chunk)) + data[start + 21:]


def openai_body(model: str, url: str, text: str = QUESTION, **kw) -> dict:
    return {"model": model, "temperature": 0, "max_tokens": 16, **kw, "messages": [
        {"role": "user", "content": [{"type": "text", "text": text},
                                     {"type": "image_url", "image_url": {"url": url}}]}]}


def chat(server, body: dict) -> httpx.Response:
    return httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120)


def answer(server, body: dict) -> str:
    r = chat(server, body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


# ---- images: bytes, bounds, decoding (no model) -------------------------------------


def test_a_data_url_decodes_and_names_the_image_by_its_bytes():
    a, b = png(1), png(2)
    got = decoded(image_bytes(data_url(a)))
    assert got.image.size == (50, 40) and got.image.mode == "RGB"
    assert got.digest == decoded(a).digest != decoded(b).digest


@pytest.mark.parametrize("url, words", [
    ("data:image/png;base64," + base64.b64encode(png(0)[:60]).decode(), "could not be decoded"),
    (data_url(b"not an image at all"), "could not be decoded"),
    ("data:image/png;base64,@@@@", "not valid base64"),
    ("data:image/png,rawbytes", "must be base64"),
    ("ftp://example.com/a.png", "data: URL"),
    (data_url(declared_png(8000, 8000)), "8000 x 8000 pixels"),
    (data_url(declared_png(50_000, 50_000)), "too large"),
])
def test_a_bad_image_is_an_image_error_naming_what_is_wrong(url, words):
    with pytest.raises(ImageError, match=words):
        vimages.load_image(url)


def test_bytes_over_the_bound_are_refused_before_decoding(monkeypatch):
    with pytest.raises(ImageError, match="over 1000 bytes"):
        vimages.load_image(data_url(png(0, (100, 100))), max_bytes=1000)


class _Slow(http.server.BaseHTTPRequestHandler):
    body = b""
    delay = 0.0

    def do_GET(self):
        time.sleep(self.delay)
        self.send_response(200)
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args):
        pass


@pytest.fixture
def image_host():
    """A local HTTP server answering with ``_Slow.body`` after ``_Slow.delay`` s."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Slow)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/image.png"
    server.shutdown()


def test_an_http_url_is_fetched_within_its_bounds(image_host, monkeypatch):
    monkeypatch.setattr(_Slow, "body", png(3))
    assert vimages.load_image(image_host).digest == decoded(png(3)).digest
    with pytest.raises(ImageError, match="over 100 bytes"):
        vimages.load_image(image_host, max_bytes=100)
    monkeypatch.setattr(_Slow, "delay", 3.0)
    tic = time.monotonic()
    with pytest.raises(ImageError, match="could not be fetched"):
        vimages.load_image(image_host, timeout=0.5)
    assert time.monotonic() - tic < 2.5
    closed, = free_ports()
    with pytest.raises(ImageError, match="could not be fetched"):
        vimages.load_image(f"http://127.0.0.1:{closed}/gone.png")


def test_the_cache_key_names_each_image_by_its_hash():
    image, text = 9, [1, 2]
    prompt = [*text, image, image, 3, image, image, 4]
    a, b = b"a" * 32, b"b" * 32
    key = cache_key(prompt, image, [a, b])
    assert key == (1, 2, image_id(a), image_id(a), 3, image_id(b), image_id(b), 4)
    assert all(t < 0 for t in (image_id(a), image_id(b))) and image_id(a) != image_id(b)
    # The same first image: the keys agree up to the second one.
    other = cache_key(prompt, image, [a, a])
    assert other[:5] == key[:5] and other[5] != key[5]
    # Runs that are not one per image: every placeholder takes all the images' id.
    merged = cache_key([1, image, image, 2], image, [a, b])
    assert merged[1] == merged[2] == image_id(a + b)


def test_a_tool_results_images_are_laid_out_three_ways_in_their_order():
    """In place; after the run of tool messages (opening the user turn that
    follows); or every tool message a user turn merged with its neighbours."""
    image = [{"type": "image"}]
    messages = [
        {"role": "user", "content": "shoot"}, {"role": "assistant", "content": ""},
        {"role": "tool", "content": [{"type": "text", "text": "a"}, *image]},
        {"role": "tool", "content": "b"},
        {"role": "user", "content": [{"type": "text", "text": "q"}, *image]}]
    assert tool_images.holds_tool_images(messages)
    assert not tool_images.holds_tool_images(tool_images.without_tool_images(messages))
    assert tool_images.in_place(messages) == messages
    assert tool_images.images_after(messages) == [
        *messages[:2], {"role": "tool", "content": "a"}, {"role": "tool", "content": "b"},
        {"role": "user", "content": [*image, {"type": "text", "text": "q"}, *image]}]
    assert tool_images.images_after(messages[:3] + [messages[1]]) == [
        *messages[:2], {"role": "tool", "content": "a"}, {"role": "user", "content": image},
        messages[1]]
    assert tool_images.as_user(messages) == [*messages[:2], {"role": "user", "content": [
        {"type": "text", "text": "a"}, *image, {"type": "text", "text": "b"},
        {"type": "text", "text": "q"}, *image]}]
    # Two user turns in a row that hold no tool result stay two.
    assert tool_images.as_user(messages[:1] * 2) == messages[:1] * 2


def _template(tool: str) -> str:
    """A chat template whose tool messages are written by ``tool``."""
    part = ("{% for p in m.content %}{% if p.type == 'image' %}<img>{% else %}{{ p.text }}"
            "{% endif %}{% endfor %}")
    return ("{% for m in messages %}{% if m.role == 'tool' %}" + tool + "{% else %}"
            "[{{ m.role }}]{% if m.content is string %}{{ m.content }}{% else %}" + part +
            "{% endif %}{% endif %}{% endfor %}").replace("PARTS", part)


@pytest.mark.parametrize("tool, want", [
    ("[tool]{% if m.content is string %}{{ m.content }}{% else %}PARTS{% endif %}",
     "[user]shoot[assistant][tool]a<img>[user]q"),  # Qwen's: in place
    ("[tool]{% if m.content is string %}{{ m.content }}{% else %}{% for p in m.content %}"
     "{% if p.type == 'text' %}{{ p.text }}{% endif %}{% endfor %}{% endif %}",
     "[user]shoot[assistant][tool]a[user]<img>q"),  # drops them: a user turn after
    ("{{ raise_exception('roles must alternate') }}",
     "[user]shoot[assistant][user]a<img>q"),  # Gemma 3's: the tool result a user turn
], ids=["in place", "images after", "as user"])
def test_a_tool_results_images_take_the_first_layout_the_template_writes(tool, want):
    from jinja2 import Environment

    def raise_exception(message):
        raise ValueError(message)

    template = Environment().from_string(_template(tool))
    render = lambda messages: template.render(  # noqa: E731
        messages=messages, raise_exception=raise_exception)
    messages = [{"role": "user", "content": "shoot"}, {"role": "assistant", "content": ""},
                {"role": "tool", "content": [{"type": "text", "text": "a"}, {"type": "image"}]},
                {"role": "user", "content": [{"type": "text", "text": "q"}]}]
    assert tool_images.rendered(render, messages) == want
    text_only = tool_images.without_tool_images(messages)
    if "raise" not in tool:  # no images in tool messages: as it is
        assert tool_images.rendered(render, text_only) == want.replace("<img>", "")
    with pytest.raises(ValueError, match="never"):
        tool_images.rendered(lambda _: raise_exception("never"), messages)


# ---- through the server ---------------------------------------------------------------


@pytest.fixture(scope="module")
def vlm_path(tmp_path_factory, smollm2_path) -> Path:
    return build_gemma3_vlm(tmp_path_factory.mktemp("gemma3-vlm"), smollm2_path)


def _spec(mode: str, folder: Path = None) -> SpecDecodeConfig:
    """``auto`` as the server resolves it for ``folder`` (what it picks for a VLM)."""
    from mlx_lm_server.spec_decode.auto import auto_mode

    return SpecDecodeConfig(mode=auto_mode(str(folder)) if mode == "auto" else mode,
                            num_speculative_tokens=4, dynamic=False, adaptive_k=False,
                            calibration_seconds=0)


@pytest.fixture(scope="module")
def servers(vlm_path):
    """The folder served plainly and with ``--spec-decode auto``."""
    from conftest import LiveServer

    out = {mode: LiveServer(vlm_path, max_batch_size=8, spec=_spec(mode, vlm_path))
           for mode in ("none", "auto")}
    yield out
    for server in out.values():
        server.close()


def mlx_vlm_reference(folder: Path, image: bytes, max_tokens: int, tmp_path: Path,
                      messages: list = None, whole: bool = False) -> str:
    """mlx-vlm's own greedy generate on the folder, image and prompt the
    template writes for ``messages`` (``openai_body``'s by default);
    ``whole``: it must not stop early, so that every token is compared."""
    from mlx_vlm import generate, load

    model, processor = load(str(folder))
    messages = messages or [
        {"role": "user", "content": [{"type": "text", "text": QUESTION}, {"type": "image"}]}]
    prompt = processor.tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True)
    path = tmp_path / "image.png"
    path.write_bytes(image)
    out = generate(model, processor, prompt, image=[str(path)], max_tokens=max_tokens,
                   temperature=0.0, verbose=False)
    assert not whole or out.generation_tokens == max_tokens, out
    return out.text.lstrip()  # a chat answer's leading space is trimmed (docs/serving.md)


def test_an_image_through_each_api_answers_as_mlx_vlm_does(servers, vlm_path, tmp_path):
    """Greedy: OpenAI chat, Anthropic Messages and Responses agree with each
    other, with and without speculation, and with mlx-vlm's own generate;
    another image gives another answer (the image is read)."""
    image = png(1)
    want = mlx_vlm_reference(vlm_path, image, 16, tmp_path)
    b64 = base64.b64encode(image).decode()
    for mode, server in servers.items():
        assert answer(server, openai_body(server.model, data_url(image))) == want, mode
        r = httpx.post(server.url + "/v1/messages", timeout=120, json={
            "model": server.model, "max_tokens": 16, "temperature": 0, "messages": [
                {"role": "user", "content": [
                    {"type": "text", "text": QUESTION},
                    {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                 "data": b64}}]}]})
        assert r.status_code == 200, r.text
        assert r.json()["content"][0]["text"] == want, mode
        r = httpx.post(server.url + "/v1/responses", timeout=120, json={
            "model": server.model, "max_output_tokens": 16, "temperature": 0, "input": [
                {"role": "user", "content": [
                    {"type": "input_text", "text": QUESTION},
                    {"type": "input_image", "image_url": data_url(image)}]}]})
        assert r.status_code == 200, r.text
        assert r.json()["output"][0]["content"][0]["text"] == want, mode
    assert answer(servers["none"], openai_body(servers["none"].model, data_url(png(2)))) != want
    metrics = httpx.get(servers["auto"].url + "/v1/spec_decode/metrics", timeout=10).json()
    assert metrics["enabled"] and metrics["totals"]["verify_steps"] > 0, metrics["totals"]


def image_block(data: bytes) -> dict:
    return {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                        "data": base64.b64encode(data).decode()}}


def tool_result_body(model: str, image: dict, max_tokens: int = 16) -> dict:
    """A Messages turn after a screenshot tool's call: its result holds the image."""
    return {"model": model, "max_tokens": max_tokens, "temperature": 0, "messages": [
        {"role": "user", "content": "Take a screenshot."},
        {"role": "assistant", "content": [
            {"type": "tool_use", "id": "call_1", "name": "screenshot", "input": {}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "call_1", "content": [
                {"type": "text", "text": "Here it is."}, image]},
            {"type": "text", "text": QUESTION}]}]}


def messages_answer(server, body: dict) -> str:
    r = httpx.post(server.url + "/v1/messages", timeout=120, json=body)
    assert r.status_code == 200, r.text
    return r.json()["content"][0]["text"]


def test_an_image_in_a_tool_result_answers_as_a_user_turn_holding_it(servers, vlm_path,
                                                                     tmp_path):
    """Gemma 3's template refuses a tool message (roles must alternate), so
    the tool result is a user turn, its text and image, then the user's
    text: greedy, the same as mlx-vlm's generate on that conversation, with
    and without speculation; another image another answer; a bad image in
    the tool result a 400 naming its place."""
    image = png(1)
    want = mlx_vlm_reference(vlm_path, image, 16, tmp_path, messages=[
        {"role": "user", "content": "Take a screenshot."}, {"role": "assistant", "content": ""},
        {"role": "user", "content": [{"type": "text", "text": "Here it is."}, {"type": "image"},
                                     {"type": "text", "text": QUESTION}]}])
    for mode, server in servers.items():
        assert messages_answer(server, tool_result_body(server.model, image_block(image))) \
            == want, mode
    server = servers["none"]
    assert messages_answer(server, tool_result_body(server.model, image_block(png(2)))) != want
    r = httpx.post(server.url + "/v1/messages", timeout=60,
                   json=tool_result_body(server.model, image_block(b"nope")))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"].startswith("messages.2.content.0.content.1: "), r.text


def test_eight_concurrent_requests_half_with_images_answer_as_alone(servers):
    server = servers["auto"]
    bodies = [openai_body(server.model, data_url(png(10 + i)), text=f"Picture {i}:")
              if i % 2 == 0 else
              {"model": server.model, "temperature": 0, "max_tokens": 16, "messages": [
                  {"role": "user", "content": f"one two three four {i} one two three four"}]}
              for i in range(8)]
    alone = [answer(server, b) for b in bodies]
    with cf.ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda b: answer(server, b), bodies))
    assert together == alone


@pytest.mark.parametrize("url, words", [
    ("data:image/png;base64," + base64.b64encode(png(0)[:60]).decode(), "could not be decoded"),
    (data_url(b"GIF89a not really"), "could not be decoded"),
    (data_url(declared_png(50_000, 50_000)), "too large"),
    ("http://127.0.0.1:9/unreachable.png", "could not be fetched"),
])
def test_a_bad_image_is_a_400_and_the_server_goes_on(servers, url, words):
    server = servers["none"]
    tic = time.monotonic()
    r = chat(server, openai_body(server.model, url))
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert words in error["message"] and error["param"] == "messages.0.content.1", error
    assert time.monotonic() - tic < vimages.FETCH_TIMEOUT_S + 2
    assert answer(server, openai_body(server.model, data_url(png(1))))


def test_the_model_list_says_which_models_take_images(servers):
    server = servers["none"]
    (entry,) = httpx.get(server.url + "/v1/models", timeout=10).json()["data"]
    assert entry["input_modalities"] == ["text", "image"]


# ---- the prompt cache ----------------------------------------------------------------


@pytest.fixture(scope="module")
def wide_vlm_path(tmp_path_factory, smollm2_path) -> Path:
    """Windows wider than a conversation: an entry cut back to a prompt is a hit."""
    return build_gemma3_vlm(tmp_path_factory.mktemp("gemma3-vlm-wide"), smollm2_path,
                            sliding_window=512)


def _turn_two(model: str, url: str, first: str) -> dict:
    return {"model": model, "temperature": 0, "max_tokens": 8, "messages": [
        {"role": "user", "content": [{"type": "text", "text": QUESTION},
                                     {"type": "image_url", "image_url": {"url": url}}]},
        {"role": "assistant", "content": first},
        {"role": "user", "content": "And the colours?"}]}


def test_a_turn_that_resends_the_image_is_served_from_the_cache_and_after_a_restart(
        wide_vlm_path, tmp_path):
    from conftest import LiveServer

    url, other = data_url(png(1)), data_url(png(2))
    folder = tmp_path / "prompts"
    server = LiveServer(wide_vlm_path, spec=_spec("auto", wide_vlm_path), prompt_cache_dir=str(folder))
    try:
        r = chat(server, openai_body(server.model, url, max_tokens=8))
        first = r.json()["choices"][0]["message"]["content"]
        prompt_len = r.json()["usage"]["prompt_tokens"]
        r = chat(server, _turn_two(server.model, url, first))
        assert r.status_code == 200, r.text
        hit = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert hit >= prompt_len - 1, (hit, prompt_len)  # past the image
        want = r.json()["choices"][0]["message"]["content"]
        # Another image with the same text: the cache serves only what comes before it.
        r = chat(server, _turn_two(server.model, other, first))
        miss = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        req, _ = server.service.prepare(ChatCompletionRequest.model_validate(
            _turn_two(server.model, other, first)))
        first_placeholder = next(i for i, t in enumerate(req.cache_key) if t < 0)
        assert 0 < miss <= first_placeholder, (miss, first_placeholder)
    finally:
        server.close()
    server = LiveServer(wide_vlm_path, spec=_spec("auto", wide_vlm_path), prompt_cache_dir=str(folder))
    try:
        r = chat(server, _turn_two(server.model, url, first))
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= prompt_len - 1
        assert r.json()["choices"][0]["message"]["content"] == want
    finally:
        server.close()
    plain = LiveServer(wide_vlm_path, spec=_spec("none"), prompt_cache_size=0)
    try:
        assert answer(plain, _turn_two(plain.model, url, first)) == want
    finally:
        plain.close()


# ---- models whose images are refused ---------------------------------------------------


def test_a_text_only_model_answers_an_image_with_a_400_naming_it(smollm2_path):
    from conftest import LiveServer

    server = LiveServer(smollm2_path, spec=_spec("none"))
    try:
        r = chat(server, openai_body(server.model, data_url(png(1))))
        assert r.status_code == 400
        message = r.json()["error"]["message"]
        assert server.model in message and "text-only" in message, message
        r = httpx.post(server.url + "/v1/messages", timeout=60,
                       json=tool_result_body(server.model, image_block(png(1))))
        assert r.status_code == 400 and r.json()["error"]["message"] == message, r.text
        (entry,) = httpx.get(server.url + "/v1/models", timeout=10).json()["data"]
        assert entry["input_modalities"] == ["text"]
    finally:
        server.close()


def test_a_text_model_starts_without_importing_mlx_vlm(smollm2_path):
    """The text-only install and start-up are what they were: serving a
    text model reads its config for a ``vision_config`` and imports nothing
    of mlx-vlm (its import alone takes seconds and pulls torch-sized
    dependencies where they are installed)."""
    import subprocess
    import sys

    code = ("import sys; from mlx_lm_server.config import ServerConfig; "
            "from mlx_lm_server.assembly import load_service; "
            f"service = load_service(ServerConfig(model={str(smollm2_path)!r})); "
            "service.scheduler.shutdown(); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'mlx_vlm'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout


def test_an_mrope_family_not_served_refuses_images_for_their_positions_and_serves_text(
        tmp_path, smollm2_path, monkeypatch):
    """An M-RoPE family whose images are not served (Qwen3.5's layout, taken
    off ``MROPE_SERVED`` here; Qwen2.5-VL and Qwen3-VL are such families):
    images are a 400 saying why, text answers. Qwen3.5's images:
    tests/server/test_vision_mrope.py."""
    from conftest import LiveServer

    monkeypatch.setattr("mlx_lm_server.vision.tower.MROPE_SERVED", ())

    folder = with_vision_config(build("qwen3_5", tmp_path / "qwen3_5", smollm2_path), {
        "model_type": "qwen3_5", "depth": 2, "hidden_size": 32, "num_heads": 2,
        "out_hidden_size": 64, "patch_size": 16, "spatial_merge_size": 2})
    server = LiveServer(folder, spec=_spec("none"))
    try:
        r = chat(server, openai_body(server.model, data_url(png(1))))
        assert r.status_code == 400
        assert "M-RoPE" in r.json()["error"]["message"], r.text
        r = chat(server, {"model": server.model, "max_tokens": 4, "temperature": 0,
                          "messages": [{"role": "user", "content": "hello"}]})
        assert r.status_code == 200, r.text
    finally:
        server.close()


# ---- sampled: the exact distribution with an image in the prompt -----------------------


def test_sampled_tokens_keep_the_exact_distribution_with_an_image(vlm_path):
    """Temperature 1.5, top_k 2, n-gram drafts verified by the rejection
    sampler: joint frequencies of three tokens over 600 seeded requests with
    an image in the prompt against the exact distribution from plain
    forwards over the merged embeddings. Bound: TV below 0.1 over 8 outcomes
    (sampling error alone about 0.05)."""
    from mlx_lm import load

    from mlx_lm_server.assembly import make_scheduler
    from mlx_lm_server.runtime.mlx_vlm_adapter import input_embeddings
    from mlx_lm_server.spec_decode import make_engine
    from mlx_lm_server.vision.images import LoadedImage
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
        emb = input_embeddings(tower.parts, list(tokens), images.inputs)
        return model(mx.array([tokens]), input_embeddings=emb)[0, -1]

    config = SpecDecodeConfig(mode="ngram", num_speculative_tokens=4, dynamic=False,
                              adaptive_k=False)
    s = make_scheduler(model, tokenizer, max_batch_size=32, max_queued_requests=1024,
                       engine=make_engine(model, config, tokenizer, "target"), vision=tower)
    s.start()
    exact = _exact_distribution(model, prompt, 3, 2, 1.5, logits_after=logits_after)
    n = 600
    try:
        reqs = [GenerationRequest(prompt, 3, SamplingParams(seed=i, temperature=1.5, top_k=2),
                                  images=images) for i in range(n)]
        counts = {}
        for ids, _, _ in _run(s, reqs):
            counts[tuple(ids)] = counts.get(tuple(ids), 0) + 1
        drafts = s.spec_stats.tokens.num_draft_tokens
    finally:
        _stop(s)
    assert drafts > 0
    tv = 0.5 * sum(abs(counts.get(k, 0) / n - exact.get(k, 0.0)) for k in set(exact) | set(counts))
    assert tv < 0.1, (tv, counts, exact)


def test_a_bad_image_names_its_place_on_each_apis_wire(servers):
    server, bad = servers["none"], data_url(b"not an image")
    r = httpx.post(server.url + "/v1/messages", timeout=60, json={
        "model": server.model, "max_tokens": 4, "messages": [
            {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
            {"role": "user", "content": [
                {"type": "text", "text": QUESTION},
                {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                             "data": base64.b64encode(b"nope").decode()}}]}]})
    assert r.status_code == 400 and "messages.2.content.1" in r.json()["error"]["message"], r.text
    r = httpx.post(server.url + "/v1/responses", timeout=60, json={
        "model": server.model, "input": [{"role": "user", "content": [
            {"type": "input_text", "text": QUESTION}, {"type": "input_image", "image_url": bad}]}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input.0.content.1", r.text
